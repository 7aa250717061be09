"""Preflight on three SSH hosts: clean, then one planted fault at a time on one host."""
from __future__ import annotations

import json
import os
import socket
import struct
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from launcher import preflight
from launcher.config import Selection, resolve
from launcher.errors import ConfigError

pytestmark = pytest.mark.netns
ROOT = Path(__file__).resolve().parents[2]

# A stand-in `docker` on the test hosts: this machine has the docker client but no engine, so no container can exist.
# Each host's container is a state file named after the host (lines running=, label=, image=; no file = none);
# `exec` runs the command on the host, outside the client's session as dockerd would; `rm` deletes the file.
FAKE_DOCKER = r"""#!/bin/bash
st="$FAKE_DOCKER_DIR/$(hostname)"
get() { sed -n "s/^$1=//p" "$st"; }
case "$1" in
  inspect)
    [ -f "$st" ] || { echo "Error: No such object: ${@: -1}" >&2; exit 1; }
    case "$*" in
      *"|"*) echo "$(get running)|$(get label)|$(get image)" ;;
      *Labels*) get label ;;
      *Running*) get running ;;
      *Image*) get image ;;
      *) echo "[]" ;;
    esac ;;
  exec)
    [ -f "$st" ] && [ "$(get running)" = true ] || { echo "Error response from daemon: No such container: $3" >&2; exit 1; }
    shift; [ "$1" = -i ] && shift; shift; exec setsid -f -w "$@" ;;
  rm)
    [ "$(get rm)" = fail ] && { echo "Error response from daemon: removal of container in progress" >&2; exit 1; }
    rm -f "$st" ;;
  *) echo "stand-in docker: $1 is not supported" >&2; exit 1 ;;
esac
"""


@contextmanager
def fake_docker(c, states: dict[int, str]):
    """Every host's sshd gives its sessions the stand-in docker; `states`: host index -> its container (state file)."""
    d = c.root / "fakedocker"
    (d / "bin").mkdir(parents=True, exist_ok=True)
    (d / "bin" / "docker").write_text(FAKE_DOCKER)
    (d / "bin" / "docker").chmod(0o755)
    (d / "state").mkdir(exist_ok=True)
    for f in (d / "state").iterdir():
        f.unlink()
    for i, text in states.items():
        (d / "state" / c.hosts[i].hostname).write_text(text)
    for h in c.hosts:
        c.restart_sshd(h, extra_config=f"SetEnv PATH={d / 'bin'}:/usr/local/bin:/usr/bin:/bin "
                                       f"FAKE_DOCKER_DIR={d / 'state'}")
    try:
        yield d / "state"
    finally:
        for h in c.hosts:
            c.restart_sshd(h)


def container_cfg(c, **sets):
    path = c.env_file(c.root / "container.env", V4_CONTAINER="v4c", V4_IMAGE="img:1", **sets)
    return resolve(Selection(cluster=str(path), hw="cpu"))


def ssh_sockets(ips) -> int:
    """This process's established TCP connections to port 22 of `ips`."""
    mine = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            mine.add(link[8:-1])
    n = 0
    for line in open("/proc/self/net/tcp").read().splitlines()[1:]:
        f = line.split()
        rip, rport = f[2].split(":")
        ip = socket.inet_ntoa(struct.pack("<I", int(rip, 16)))
        n += int(rport, 16) == 22 and f[3] == "01" and ip in ips and f[9] in mine
    return n


def settled_ssh_sockets(ips, at_most: int) -> int:
    deadline = time.monotonic() + 3
    while (n := ssh_sockets(ips)) > at_most and time.monotonic() < deadline:
        time.sleep(0.1)
    return n


def _by(results, status="FAIL"):
    return sorted((r.name, r.node) for r in results if r.status == status)


def _checks_with_sshd(c, h, cfg, **sshd):
    """Every check, while host `h`'s sshd runs with `sshd` (restart_sshd's options); its sshd restored after."""
    c.restart_sshd(h, **sshd)
    try:
        return preflight.run_checks(cfg)
    finally:
        c.restart_sshd(h)


def test_clean_cluster_passes(netns_cluster, netns_cfg):
    rs = preflight.run_checks(netns_cfg)
    assert _by(rs) == [], preflight.render_table(rs)
    ips = [h.ip for h in netns_cluster.hosts]
    for name in preflight.check_names():
        assert [r.node for r in rs if r.name == name] == ips, name
    ok = {(r.name, r.node) for r in rs if r.status == "PASS"}
    for name in ("ssh", "python", "versions", "packages", "known_bad", "socket_ifname", "disk", "shared_work",
                 "clock"):
        assert all((name, ip) in ok for ip in ips), name
    assert ("ports", ips[0]) in ok
    ssh = {r.node: r.detail for r in rs if r.name == "ssh"}
    assert all(h.hostname in ssh[h.ip] for h in netns_cluster.hosts)
    sock = {r.node: r.detail for r in rs if r.name == "socket_ifname"}
    assert sock[ips[1]].startswith("v4eth1 (" + ips[1])       # detected, not a hard-coded eth0


def _fake_dists(root, **versions):
    for dist, v in versions.items():
        d = root / f"{dist}-{v}.dist-info"
        d.mkdir(parents=True)
        (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {v}\n")


def test_other_package_versions_on_one_host(netns_cluster, netns_cfg, tmp_path):
    c, h = netns_cluster, netns_cluster.hosts[2]
    _fake_dists(tmp_path / "site", ray="2.59.0", tilelang="0.1.10")
    rs = _checks_with_sshd(c, h, netns_cfg, extra_config=f"SetEnv PYTHONPATH={tmp_path / 'site'}")
    assert _by(rs) == [("known_bad", h.ip), ("versions", h.ip)], preflight.render_table(rs)
    v = next(r for r in rs if r.name == "versions" and r.node == h.ip)
    assert "ray 2.59.0 (others: 2.60.0)" in v.detail and "tilelang 0.1.10" in v.detail
    kb = next(r for r in rs if r.name == "known_bad" and r.node == h.ip)
    assert "2199" in kb.detail
    assert kb.fix == "upgrade to tilelang>=0.1.11 or set TL_ENABLE_AGGRESSIVE_SHARED_MEMORY_MERGE False"


def test_work_not_shared_on_one_host(netns_cluster, netns_cfg, tmp_path):
    c, h = netns_cluster, netns_cluster.hosts[1]
    private = tmp_path / "private_work"
    private.mkdir()
    rs = _checks_with_sshd(c, h, netns_cfg, private_mounts=[(str(private), str(netns_cfg["V4_WORK"]))])
    assert _by(rs) == [("shared_work", h.ip)], preflight.render_table(rs)
    r = next(r for r in rs if r.name == "shared_work" and r.node == h.ip)
    assert "does not show the file the head wrote" in r.detail and h.ip in r.fix


def test_taken_port_on_the_head(netns_cluster, netns_cfg):
    c, h = netns_cluster, netns_cluster.hosts[0]
    port = int(netns_cfg["V4_DASHBOARD_PORT"])
    # SO_REUSEADDR: the Ray tests before this one leave the head's dashboard port in TIME_WAIT.
    code = (f"import socket, time; s = socket.socket(); "
            f"s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(('{h.ip}', {port})); s.listen(); "
            "print('listening', flush=True); time.sleep(600)")
    p = c.in_ns(h, sys.executable, "-c", code, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "listening"
        rs = preflight.run_checks(netns_cfg)
        cli = subprocess.run([sys.executable, "-m", "launcher", "preflight", "--json", "--only", "ports",
                              "--cluster", netns_cfg.selection.cluster, "--hw", "cpu"],
                             cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=300)
    finally:
        p.kill(); p.wait()
    assert _by(rs) == [("ports", h.ip)], preflight.render_table(rs)
    r = next(r for r in rs if r.name == "ports")
    assert f"V4_DASHBOARD_PORT={port} is taken by python" in r.detail and str(p.pid) in r.detail
    assert cli.returncode == 3, cli.stderr                      # the command's exit code: preflight failed
    out = json.loads(cli.stdout)
    assert not out["ok"] and out["summary"]["FAIL"] == 1 and out["results"][0]["fix"]


def test_missing_ssh_key_on_one_host(netns_cluster, netns_cfg):
    h = netns_cluster.hosts[2]
    saved = h.authorized_keys.read_text()
    h.authorized_keys.write_text("")
    try:
        rs = preflight.run_checks(netns_cfg)
    finally:
        h.authorized_keys.write_text(saved)
    assert _by(rs) == [("ssh", h.ip)], preflight.render_table(rs)
    r = next(r for r in rs if r.name == "ssh" and r.node == h.ip)
    assert "authentication failed" in r.detail and "authorized_keys" in r.fix
    assert not [x for x in rs if x.node == h.ip and x.name != "ssh"]     # nothing else claimed about it


def test_only_skip_and_unknown_names(netns_cfg):
    rs = preflight.run_checks(netns_cfg, only=["ssh", "clock"])
    assert {r.name for r in rs} == {"ssh", "clock"}
    rs = preflight.run_checks(netns_cfg, skip=["clock"])
    assert "clock" not in {r.name for r in rs}
    with pytest.raises(ConfigError, match="did you mean 'ports'"):
        preflight.run_checks(netns_cfg, only=["portz"])


def test_run_checks_closes_its_ssh_connections(netns_cluster, netns_cfg):
    ips = [h.ip for h in netns_cluster.hosts]
    before = ssh_sockets(ips)
    rs = preflight.run_checks(netns_cfg, only=["ssh"])
    assert [r.status for r in rs] == ["PASS"] * 3
    assert settled_ssh_sockets(ips, before) <= before, "preflight left its SSH connections open"


def test_missing_key_file_is_named_not_unreachable(netns_cluster, tmp_path):
    """V4_SSH_KEY pointing nowhere is one mistake on this machine, not three unreachable hosts behind firewalls."""
    key = tmp_path / "no_such_key"
    cfg = resolve(Selection(cluster=str(netns_cluster.env_file(tmp_path / "nokey.env", V4_SSH_KEY=key)), hw="cpu"))
    t = time.monotonic()
    rs = preflight.run_checks(cfg, only=["ssh", "python"])
    assert time.monotonic() - t < 5
    assert _by(rs) == [("ssh", h.ip) for h in netns_cluster.hosts], preflight.render_table(rs)
    for r in rs:
        assert f"V4_SSH_KEY={key} does not exist" in r.detail and "unreachable" not in r.detail, r
        assert "V4_SSH_KEY" in r.fix and "firewall" not in r.fix, r


def test_a_login_that_runs_nothing_is_an_ssh_failure(netns_cluster, netns_cfg):
    """SSH connects, but the account's shell runs no command (nologin): the `true` probe fails, and that is what the
    ssh row says, with the shell's own words; not a python row telling to install the environment."""
    c, h = netns_cluster, netns_cluster.hosts[2]
    rs = _checks_with_sshd(c, h, netns_cfg, extra_config="ForceCommand /usr/sbin/nologin")
    assert _by(rs) == [("ssh", h.ip)], preflight.render_table(rs)
    r = next(r for r in rs if r.name == "ssh" and r.node == h.ip)
    assert "`true` over SSH exited with rc 1" in r.detail and "not available" in r.detail
    assert "nologin" in r.fix
    assert not [x for x in rs if x.node == h.ip and x.name != "ssh"]


def _cli(cfg, *args):
    return subprocess.run([sys.executable, "-m", "launcher", "preflight", *args, "--cluster", cfg.selection.cluster,
                           "--hw", "cpu"], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_strict_output_agrees_with_the_exit_code(netns_cfg):
    """V4_SOCKET_IFNAME=lo exists and is up but does not carry the nodes' addresses: a WARN on each node."""
    args = ("--only", "socket_ifname", "--set", "V4_SOCKET_IFNAME=lo")
    lenient, strict = _cli(netns_cfg, *args), _cli(netns_cfg, *args, "--strict")
    assert lenient.returncode == 0 and lenient.stdout.rstrip().endswith("3 WARN -- preflight passed"), lenient.stdout
    assert strict.returncode == 3, strict.stderr
    assert "preflight passed" not in strict.stdout and "preflight FAILED" in strict.stdout, strict.stdout
    out = json.loads(_cli(netns_cfg, *args, "--strict", "--json").stdout)
    assert out["ok"] is False and out["strict"] is True and out["summary"]["WARN"] == 3


def test_container_mode_before_cluster_up(netns_cluster):
    """Container mode on a fresh cluster: preflight runs before `v4 cluster up` creates the containers. Nothing FAILs
    for that: the hosts' facts are read on the hosts, the image's software waits for the container."""
    c = netns_cluster
    cfg = container_cfg(c)
    ips = [h.ip for h in c.hosts]
    with fake_docker(c, {}):
        rs = preflight.run_checks(cfg)
    assert _by(rs) == [], preflight.render_table(rs)
    by = {(r.name, r.node): r for r in rs}
    for ip in ips:
        assert by["container", ip].status == "PASS" and "not created yet" in by["container", ip].detail
        assert "`v4 cluster up` creates it from img:1" in by["container", ip].detail
        for name in ("python", "versions", "packages", "known_bad"):
            assert by[name, ip].status == "SKIP" and "v4 cluster up" in by[name, ip].detail, by[name, ip]
        for name in ("ssh", "socket_ifname", "disk", "shared_work", "clock", "ulimit"):
            assert by[name, ip].status == "PASS", by[name, ip]
    assert by["ports", ips[0]].status == "PASS"


def test_container_mode_foreign_stale_and_current_containers(netns_cluster):
    c = netns_cluster
    cfg = container_cfg(c)
    h0, h1, h2 = (h.ip for h in c.hosts)
    with fake_docker(c, {0: "running=true\nlabel=netns\nimage=img:1\n",        # ours, current: facts inside
                         1: "running=true\nlabel=someone-else\nimage=x:2\n",   # not ours: `up` would refuse it
                         2: "running=true\nlabel=netns\nimage=img:0\n"}):      # ours, another image
        rs = preflight.run_checks(cfg)
    assert _by(rs) == [("container", h1)], preflight.render_table(rs)
    by = {(r.name, r.node): r for r in rs}
    assert "facts read inside it" in by["container", h0].detail and by["python", h0].status == "PASS"
    assert by["versions", h0].status == "PASS"
    assert "label v4.launcher=someone-else" in by["container", h1].detail and "docker rm -f v4c" in by["container", h1].fix
    assert by["python", h1].status == "SKIP"
    assert by["container", h2].status == "WARN" and "runs img:0, not V4_IMAGE=img:1" in by["container", h2].detail
    assert "`v4 cluster down`, then `v4 cluster up`" in by["container", h2].fix

