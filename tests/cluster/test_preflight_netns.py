"""Preflight on three SSH hosts: clean, then one planted fault at a time on one host."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from launcher import preflight
from launcher.errors import ConfigError

pytestmark = pytest.mark.netns


def _by(results, status="FAIL"):
    return sorted((r.name, r.node) for r in results if r.status == status)


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
    c.restart_sshd(h, extra_config=f"SetEnv PYTHONPATH={tmp_path / 'site'}")
    try:
        rs = preflight.run_checks(netns_cfg)
    finally:
        c.restart_sshd(h)
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
    c.restart_sshd(h, private_mounts=[(str(private), str(netns_cfg["V4_WORK"]))])
    try:
        rs = preflight.run_checks(netns_cfg)
    finally:
        c.restart_sshd(h)
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
