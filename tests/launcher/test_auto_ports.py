"""`auto` ports (launcher/config/ports.py): the local default's Ray ports are picked free once per checkout (its
V4_LOCAL_DIR), recorded there, and the same on every later call, whatever listens on them by then."""
from __future__ import annotations

import json
import socket
import threading

import pytest

from launcher.config import Selection, resolve
from launcher.config.ports import AUTO_KEYS, port_free
from launcher.errors import ConfigError

RAY_KEYS = ("V4_RAY_PORT", "V4_DASHBOARD_PORT", "V4_RAY_CLIENT_PORT")


def local(local_dir, *sets):
    return resolve(Selection(cluster="local", hw="cpu", sets=(f"V4_LOCAL_DIR={local_dir}", *sets), environ={}))


def ports(cfg) -> dict[str, int]:
    return {k: cfg[k] for k in RAY_KEYS}


def test_each_checkout_gets_its_own_ports_recorded_and_stable(tmp_path):
    a, b = local(tmp_path / "a"), local(tmp_path / "b")
    pa, pb = ports(a), ports(b)
    assert all(isinstance(p, int) and 20000 <= p < 32768 for p in (*pa.values(), *pb.values()))
    assert len(set(pa.values())) == 3 and not set(pa.values()) & set(pb.values())
    rec = json.loads((tmp_path / "a/ports.json").read_text())
    assert rec["ports"] == pa and rec["local_dir"] == str(tmp_path / "a")
    # the rendezvous port is not a cluster port: rank 0 picks one for each job, so two runs never meet on it
    assert a["V4_DIST_PORT"] == 0 and "V4_DIST_PORT" not in rec["ports"]
    # taken meanwhile (by this checkout's own Ray, in real use): still the recorded ports, not the next free ones
    held = []
    try:
        for p in pa.values():
            s = socket.socket()
            s.bind(("127.0.0.1", p))
            s.listen()
            held.append(s)
        assert ports(local(tmp_path / "a")) == pa
    finally:
        for s in held:
            s.close()


def test_provenance_names_the_record_and_the_auto_it_replaced(tmp_path):
    cfg = local(tmp_path / "c")
    rows = {r["key"]: r for r in cfg.explain()}
    first = rows["V4_RAY_PORT"]
    assert first["from"] == f"auto: picked free now, recorded in {tmp_path / 'c/ports.json'}"
    assert first["overrode"]["value"] == "auto" and first["overrode"]["from"].startswith("envs/cluster/local.env:")
    again = {r["key"]: r for r in local(tmp_path / "c").explain()}["V4_RAY_PORT"]
    assert again["from"] == f"auto: recorded in {tmp_path / 'c/ports.json'}" and again["value"] == first["value"]
    # a number given for one key wins over `auto`; the others stay this checkout's
    mixed = local(tmp_path / "c", "V4_DASHBOARD_PORT=23999")
    assert mixed["V4_DASHBOARD_PORT"] == 23999 and mixed["V4_RAY_PORT"] == cfg["V4_RAY_PORT"]


def test_a_slot_in_use_is_skipped(tmp_path):
    """What another program listens on is never picked: the checkout's first slot taken, it gets the next free one."""
    probe = local(tmp_path / "probe")                      # the slot this directory's hash starts at
    (tmp_path / "probe/ports.json").unlink()
    blocker = socket.socket()
    blocker.bind(("127.0.0.1", probe["V4_DASHBOARD_PORT"]))
    blocker.listen()
    try:
        moved = local(tmp_path / "probe")
    finally:
        blocker.close()
    assert probe["V4_DASHBOARD_PORT"] not in ports(moved).values()
    assert all(port_free(p) for p in ports(moved).values())


def test_commands_starting_together_agree_on_the_ports(tmp_path):
    got, errors = [], []

    def one():
        try:
            got.append(ports(local(tmp_path / "together")))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)
    threads = [threading.Thread(target=one) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(got) == 6 and all(g == got[0] for g in got)


def test_a_damaged_record_is_a_config_error_that_says_how_to_pick_again(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d/ports.json").write_text('{"local_dir": "x", "ports": {"V4_RAY_PORT": 99}}')
    with pytest.raises(ConfigError) as e:
        local(tmp_path / "d")
    assert "not a port record" in e.value.message and f"delete {tmp_path / 'd/ports.json'}" in e.value.fix


def test_auto_is_refused_where_this_machine_cannot_pick_for_the_head(tmp_path):
    """An SSH cluster's ports must be the same for every checkout that uses its file: numbers, never `auto`."""
    with pytest.raises(ConfigError, match=r"V4_RAY_PORT=auto \(cli --set V4_RAY_PORT\): `auto` ports are picked free "
                                          r"on this machine, so only for a cluster on it, but V4_TRANSPORT=ssh"):
        resolve(Selection(cluster="h20_8node", hw="h20", sets=("V4_RAY_PORT=auto",), environ={}))
    with pytest.raises(ConfigError, match="a port number or `auto`"):
        local(tmp_path / "e", "V4_RAY_PORT=automatic")


def test_the_client_port_must_be_one_rays_client_server_takes(tmp_path):
    with pytest.raises(ConfigError, match=r"V4_RAY_CLIENT_PORT=80 \(cli --set V4_RAY_CLIENT_PORT\) is not a port "
                                          r"Ray's client server takes \(1024-65535\)"):
        local(tmp_path / "f", "V4_RAY_CLIENT_PORT=80")


def test_auto_keys_are_the_port_keys_that_say_so():
    from launcher.config import SCHEMA
    assert all(SCHEMA[k].type == "port" for k in AUTO_KEYS)
