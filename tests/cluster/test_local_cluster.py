"""The embedded default: LocalNode + a local Ray on this machine (own ports, own directories)."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import tagged_pids
from launcher import cluster, jobs, preflight, registry
from launcher.config import Selection, resolve

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def local_cfg(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("local")
    # Short node-local path: Ray's AF_UNIX socket paths live below it.
    local = Path(f"/tmp/v4loc-{tmp.name[-6:]}")
    sets = (f"V4_RAY_PORT={_free_port()}", f"V4_DASHBOARD_PORT={_free_port()}", f"V4_DIST_PORT={_free_port()}",
            f"V4_WORK={tmp / 'work'}", f"V4_LOCAL_DIR={local}", "V4_RAY_NUM_CPUS=1")
    cfg = resolve(Selection(cluster="local", hw="cpu", sets=sets))
    yield cfg
    cluster.down(cfg)
    subprocess.run(["rm", "-rf", str(local)])


def test_local_preflight_passes(local_cfg):
    rs = preflight.run_checks(local_cfg)
    assert not preflight.failed(rs), preflight.render_table(rs)
    assert {r.node for r in rs} == {"127.0.0.1"}


def test_local_up_probe_down(local_cfg):
    st = cluster.up(local_cfg)
    assert st.healthy and [n.ip for n in st.nodes] == ["127.0.0.1"]
    assert st.nodes[0].gcs_state == "ALIVE" and st.nodes[0].resources["CPU"] == 1
    assert not cluster.up(local_cfg).changed
    run = registry.create_run(local_cfg, prefix="probe", argv=["test"])
    outcome, seen = jobs.probe(local_cfg, run)
    assert outcome.ok and [s["ip"] for s in seen] == ["127.0.0.1"]
    assert run.info()["status"] == "passed"
    assert "V4_PROBE" in run.step_log("probe").read_text()
    # Another cluster sharing V4_LOCAL_DIR (another port) sees nothing of ours and stops nothing.
    other = resolve(Selection(cluster="local", hw="cpu", sets=(*local_cfg.selection.sets, f"V4_RAY_PORT={_free_port()}")))
    assert [r["recorded"] for r in cluster.down(other)] == [False]
    assert cluster.status(local_cfg).healthy
    token = json.loads(Path(cluster.cluster_commands(local_cfg)[0].state_dir, "ray_procs.json").read_text())["session"]
    ours = tagged_pids(f"V4_RAY_SESSION={token}")
    assert ours
    reports = cluster.down(local_cfg)
    assert reports[0]["ok"] and reports[0]["recorded"]
    assert tagged_pids(f"V4_RAY_SESSION={token}") == []
    st = cluster.status(local_cfg)
    assert not st.healthy and not st.nodes[0].recorded


def test_probe_against_no_cluster_is_a_cluster_error(local_cfg):
    from launcher.errors import ClusterError
    with pytest.raises(ClusterError, match="does not answer"):
        jobs.client(local_cfg)
