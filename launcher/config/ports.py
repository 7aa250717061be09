"""Ports picked once per checkout: the value `auto` of a port key (envs/cluster/local.env sets the Ray ports so).

The first command that resolves such a configuration picks free ports on this machine and records them in
V4_LOCAL_DIR/ports.json; every later command takes the recorded ones. Recorded, not picked again: while this
checkout's Ray listens on them they are no longer free, and a scan would move away from the cluster it started.
V4_LOCAL_DIR is under the checkout in the local default, so two clones each get ports of their own and can run their
local Rays side by side (fixed ports made the second stop at preflight, or meet the first one's Ray).

Where: from 20000 up to the kernel's ephemeral range (net.ipv4.ip_local_port_range, 32768 by default). Ray's own
daemons bind random ports, which come from that range, as do outgoing connections, so a port below it is not taken
between `v4 cluster down` and the next `up` by something of ours. Ports come in slots of four (GCS, dashboard, client
server, rendezvous); a checkout starts at its own slot, a hash of its V4_LOCAL_DIR, so two checkouts picking at the
same moment, before either listens, still get different ones. A slot with any port in use is skipped.

A dry run (`v4 run --dry-run`, `v4 bootstrap --dry-run`) resolves inside `read_only()`: it takes a record that
exists and, where there is none, picks free ports without recording them (its plan says so), so that it writes
nothing.

Provenance: `v4 config show --explain` shows such a key as coming from `auto: <record>`, overriding the `auto` of
its file. A recorded port taken later by something else is reported by preflight's `ports` check; deleting the
record (after `v4 cluster down`) makes the next command pick again.
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import socket
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import msgspec

from launcher.config.envfile import Assignment
from launcher.errors import ConfigError

AUTO = "auto"
# The keys that may be `auto`, in their order within a slot.
AUTO_KEYS = ("V4_RAY_PORT", "V4_DASHBOARD_PORT", "V4_RAY_CLIENT_PORT", "V4_DIST_PORT")
SLOT = len(AUTO_KEYS)
LOW = 20000
# Defaults other tools listen on (torch's rendezvous, SGLang's server): never picked, though free now.
AVOID = frozenset({29500, 30000})
RECORD_NAME = "ports.json"

Port = Annotated[int, msgspec.Meta(ge=1024, le=65535)]
_read_only = False


@contextmanager
def read_only():
    """Resolve without writing a record: missing ports are picked, not recorded (a dry run touches no file)."""
    global _read_only
    outer, _read_only = _read_only, True
    try:
        yield
    finally:
        _read_only = outer


class Record(msgspec.Struct, forbid_unknown_fields=True):
    """V4_LOCAL_DIR/ports.json."""
    local_dir: str
    ports: dict[str, Port]
    schema: int = 1


def record_path(values: dict) -> Path:
    """The record of the head's V4_LOCAL_DIR ({node_ip} replaced, as launcher.nodes.node_local_dir does)."""
    return Path(str(values["V4_LOCAL_DIR"]).replace("{node_ip}", str(values["V4_MASTER_IP"]))) / RECORD_NAME


def is_auto(cfg, key: str) -> bool:
    """Whether `key`'s value was picked for this checkout (its latest assignment is the record's)."""
    hist = cfg.history.get(key) or []
    return bool(hist) and hist[-1].where.startswith(f"{AUTO}: ")


def auto_keys(cfg) -> list[str]:
    return [k for k in AUTO_KEYS if is_auto(cfg, k)]


def assign_auto(cfg) -> None:
    """Replace every `auto` port of `cfg` by this checkout's recorded port, picking and recording missing ones."""
    wanted = [k for k in AUTO_KEYS if cfg.values.get(k) == AUTO]
    if not wanted:
        return
    v = cfg.values
    where = {k: cfg.history[k][-1].where for k in wanted}
    if v["V4_TRANSPORT"] != "local":
        raise ConfigError(
            f"{', '.join(f'{k}=auto ({where[k]})' for k in wanted)}: `auto` ports are picked free on this machine, so "
            f"only for a cluster on it, but V4_TRANSPORT={v['V4_TRANSPORT']} ({cfg.history['V4_TRANSPORT'][-1].where})",
            fix="write the port numbers the head should use into the cluster file")
    path = record_path(v)
    if not path.is_absolute():
        raise ConfigError(f"V4_LOCAL_DIR={v['V4_LOCAL_DIR']} must be an absolute path: `auto` ports are recorded "
                          "in it", fix="set V4_LOCAL_DIR to an absolute path")
    fixed = {int(x) for k in (*AUTO_KEYS, "V4_PROMETHEUS_PORT", "V4_GRAFANA_PORT", "V4_SSH_PORT")
             if isinstance((x := v.get(k)), int) and x}
    ports, picked = _recorded_or_picked(path, wanted, fixed)
    for k in wanted:
        idx = len(cfg.history[k])
        how = ("picked free now, not recorded (dry run): the next command records its own pick in" if k in picked
               and _read_only else "picked free now, recorded in" if k in picked else "recorded in")
        cfg.history[k].append(Assignment(k, str(ports[k]), True, f"{AUTO}: {how} {path}"))
        cfg.resolved[(k, idx)] = str(ports[k])
        v[k] = ports[k]


def _recorded_or_picked(path: Path, wanted: list[str], fixed: set[int]) -> tuple[dict[str, int], set[str]]:
    rec = _read(path)
    if rec is not None and all(k in rec.ports for k in wanted):
        return rec.ports, set()                       # the usual call: no lock, nothing written
    if _read_only:
        have = dict(rec.ports) if rec else {}
        missing = [k for k in wanted if k not in have]
        have.update(pick(str(path.parent), missing, fixed | set(have.values())))
        return have, set(missing)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as e:
        raise ConfigError(f"cannot record this checkout's ports in {path}: {e.strerror}",
                          fix=f"make {path.parent} writable (V4_LOCAL_DIR), or set the ports to numbers") from None
    try:
        # Two commands of one checkout starting together must agree: the second waits, then reads the first's.
        fcntl.flock(fd, fcntl.LOCK_EX)
        rec = _read(path) or Record(local_dir=str(path.parent), ports={})
        missing = [k for k in wanted if k not in rec.ports]
        if missing:
            rec.ports.update(pick(str(path.parent), missing, fixed | set(rec.ports.values())))
            tmp = path.with_name(f".{path.name}.{os.getpid()}")
            tmp.write_bytes(msgspec.json.encode(rec) + b"\n")
            os.replace(tmp, path)
        return rec.ports, set(missing)
    finally:
        os.close(fd)


def _read(path: Path) -> Record | None:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise ConfigError(f"cannot read this checkout's port record {path}: {e.strerror}",
                          fix=f"make {path} readable, or set the ports to numbers") from None
    try:
        return msgspec.json.decode(data, type=Record)
    except msgspec.DecodeError as e:
        raise ConfigError(f"{path}: not a port record ({e})",
                          fix=f"delete {path}: the next command picks free ports again (run `v4 cluster down` first "
                              "if this checkout's Ray may still run)") from None


def pick(seed: str, keys: list[str], avoid: set[int] = frozenset()) -> dict[str, int]:
    """Free ports for `keys`, from the first slot, starting at `seed`'s, where each is free (bind test) and not in
    `avoid`."""
    lo, hi = LOW, _ephemeral_low()
    if hi - lo < 64 * SLOT:            # an ephemeral range starting low leaves nothing below it: use the usual bounds
        hi = 32768
    slots = (hi - lo) // SLOT
    start = int.from_bytes(hashlib.sha256(seed.encode()).digest()[:8], "big") % slots
    for i in range(slots):
        base = lo + SLOT * ((start + i) % slots)
        ports = {k: base + AUTO_KEYS.index(k) for k in keys}
        if all(p not in AVOID and p not in avoid and port_free(p) for p in ports.values()):
            return ports
    raise ConfigError(f"no free ports for {', '.join(keys)} between {lo} and {hi}",
                      fix="set the ports to numbers (--set KEY=PORT or the cluster file)")


def port_free(port: int) -> bool:
    """Nothing is bound to TCP `port` on any address, IPv4 or IPv6 (no SO_REUSEADDR: a socket in TIME_WAIT counts
    as taken too)."""
    for family, addr in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                if family == socket.AF_INET6:
                    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                s.bind((addr, port))
        except OSError as e:
            if e.errno in (errno.EAFNOSUPPORT, errno.EADDRNOTAVAIL):
                continue                            # no IPv6 here
            return False
    return True


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768
