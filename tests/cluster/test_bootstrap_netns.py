"""BOOTSTRAP.md as a new user walks it, on three SSH hosts (network namespaces with real sshd and real Ray):
`v4 cluster init` from a cluster file, then `v4 bootstrap` through validate, SSH, preflight, Ray up and the probe
job on every host."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.netns
ROOT = Path(__file__).resolve().parents[2]


def v4(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "launcher", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def test_cluster_init_then_bootstrap_on_three_hosts(netns_cluster, tmp_path):
    src = netns_cluster.env_file(tmp_path / "site.env")
    target = ROOT / "envs" / "cluster" / "bsnetns.env"
    assert not target.exists()
    try:
        r = v4("cluster", "init", "bsnetns", "--from", str(src), "--set", "V4_RAY_READY_TIMEOUT=120")
        assert r.returncode == 0 and f"wrote {target}" in r.stdout, r.stderr
        assert "v4 bootstrap --cluster bsnetns" in r.stderr
        r = v4("bootstrap", "--cluster", "bsnetns", "--hw", "cpu", "--until", "probe")
        assert r.returncode == 0, r.stderr[-4000:]
        for i, step in enumerate(["validate", "ssh", "preflight", "up", "probe"], 1):
            assert f"[{i}/5] {step}:" in r.stderr
        ips = [h.ip for h in netns_cluster.hosts]
        assert all(ip in r.stdout + r.stderr for ip in ips)           # the probe answered from every host
        state = json.loads((netns_cluster.root / "work/.v4-bootstrap/bsnetns.json").read_text())
        assert [s["status"] for s in state["steps"].values()] == ["passed"] * 5
        again = v4("bootstrap", "--cluster", "bsnetns", "--hw", "cpu", "--until", "probe")
        assert again.returncode == 0 and again.stderr.count(": passed ") == 5, again.stderr
    finally:
        v4("cluster", "down", "--cluster", "bsnetns", "--hw", "cpu")
        target.unlink(missing_ok=True)
