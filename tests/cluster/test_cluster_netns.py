"""`cluster up | status | down` on three SSH hosts (network namespaces), with real Ray.

The tests share one cluster and run in file order: up -> up again -> kill a raylet -> heal ->
down next to a foreign Ray.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import tagged_pids
from launcher import cluster
from launcher.config import Selection, resolve
from launcher.errors import ClusterError
from launcher.nodes import opened
# the stand-in docker for the hosts (no Docker engine here) and the SSH socket count, shared with the preflight tests
from test_preflight_netns import container_cfg, fake_docker, settled_ssh_sockets, ssh_sockets

pytestmark = pytest.mark.netns
ROOT = Path(__file__).resolve().parents[2]


def v4(cfg, *args, check=True) -> subprocess.CompletedProcess:
    """The real CLI, as a user runs it, against the test cluster's env file."""
    r = subprocess.run([sys.executable, "-m", "launcher", *args, "--cluster", cfg.selection.cluster, "--hw", "cpu"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    if check:
        assert r.returncode == 0, f"v4 {' '.join(args)} -> {r.returncode}\n{r.stderr[-3000:]}"
    return r


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture(scope="module")
def ray_up(netns_cluster, netns_cfg):
    try:
        yield cluster.up(netns_cfg)
    finally:
        cluster.down(netns_cfg)


def test_up_reaches_readiness_with_three_nodes(netns_cluster, netns_cfg, ray_up):
    st = ray_up
    assert st.healthy, st.problems
    assert st.changed
    assert [n.ip for n in st.nodes] == [h.ip for h in netns_cluster.hosts]
    assert [n.gcs_state for n in st.nodes] == ["ALIVE"] * 3
    assert [n.hostname for n in st.nodes] == [h.hostname for h in netns_cluster.hosts]
    assert all(n.resources["CPU"] == 1 and n.resources.get("GPU", 0) == 0 for n in st.nodes)
    assert all(n.proc("raylet") and n.proc("raylet")["alive"] for n in st.nodes)
    assert st.nodes[0].proc("gcs_server")["alive"] and st.dashboard_ok


def test_up_twice_is_a_noop(netns_cfg, ray_up, capsys):
    before = {n.ip: n.proc("raylet")["pid"] for n in cluster.status(netns_cfg).nodes}
    st = cluster.up(netns_cfg)
    assert st.healthy and not st.changed
    assert "already up" in capsys.readouterr().err
    assert {n.ip: n.proc("raylet")["pid"] for n in st.nodes} == before


def test_status_and_up_close_their_ssh_connections(netns_cluster, netns_cfg, ray_up):
    ips = [h.ip for h in netns_cluster.hosts]
    before = ssh_sockets(ips)
    assert cluster.status(netns_cfg).healthy
    assert not cluster.up(netns_cfg).changed
    assert settled_ssh_sockets(ips, before) <= before, "status/up left SSH connections open"


def test_probe_job_runs_across_the_nodes(netns_cluster, netns_cfg, ray_up):
    out = json.loads(v4(netns_cfg, "cluster", "probe", "--json").stdout)
    hosts = netns_cluster.hosts
    assert sorted(n["ip"] for n in out["nodes"]) == [h.ip for h in hosts]
    assert sorted(n["hostname"] for n in out["nodes"]) == [h.hostname for h in hosts]
    assert all(n["socket_ifname"] == f"v4eth{i}" for i, n in enumerate(sorted(out["nodes"], key=lambda n: n["ip"])))
    run_id, sid = out["run_id"], out["outcome"]["submission_id"]
    assert out["outcome"]["ok"] and out["outcome"]["exit_code"] == 0
    # the registry tracked it ...
    runs = json.loads(v4(netns_cfg, "runs", "ls", "--json").stdout)["runs"]
    assert [r["status"] for r in runs if r["id"] == run_id] == ["passed"]
    show = json.loads(v4(netns_cfg, "runs", "show", run_id[:-2], "--json").stdout)
    assert show["steps"][0]["name"] == "probe" and show["steps"][0]["submission_id"] == sid
    assert "V4_PROBE" in v4(netns_cfg, "runs", "logs", run_id).stdout
    manifest = json.loads((Path(show["dir"]) / "manifest.json").read_text())
    assert manifest["config"]["values"]["V4_MASTER_IP"] == hosts[0].ip and manifest["code"]["sha"]
    # ... and so does the cluster
    st = json.loads(v4(netns_cfg, "cluster", "status", "--json").stdout)
    assert st["healthy"] and [j["status"] for j in st["jobs"] if j["submission_id"] == sid] == ["SUCCEEDED"]


def test_dequantize_spreads_its_shards_over_the_nodes(netns_cluster, netns_cfg, ray_up, tmp_path):
    """The dequantize step's spread (jobs/dequantize.py) as a Ray job on the three hosts: one task pinned to each
    node converts its share of the output shards into the shared destination, the job's own call then finds them
    all complete and writes the index; the result is a one-process conversion's, byte for byte."""
    from safetensors.torch import load_file
    from dsv4.checkpoint import dequantize_checkpoint, generate_checkpoint
    from dsv4.config import ModelConfig
    from launcher.jobs import submit_and_wait
    from launcher.nodes import python_on_nodes
    from launcher.plan import JobSpec, working_dir_excludes

    src, dst, one = tmp_path / "src", tmp_path / "spread", tmp_path / "one"
    generate_checkpoint(ModelConfig.preset("tiny"), src)
    shard = 1 << 20                                          # ~1 MB shards: more of them than nodes
    n_shards = dequantize_checkpoint(src, one, shard_bytes=shard).n_shards
    assert n_shards > 3
    code = ("from jobs.dequantize import _ray_nodes, _spread; from dsv4.checkpoint import dequantize_checkpoint; "
            f"nodes = _ray_nodes(); _spread({str(src)!r}, {str(dst)!r}, nodes, {shard}); "
            f"s = dequantize_checkpoint({str(src)!r}, {str(dst)!r}, shard_bytes={shard}); "
            "print('V4_DEQ', len(nodes), s.shards_written, s.shards_skipped, flush=True)")
    job = JobSpec(submission_id=f"dequant-spread-{os.getpid()}", entrypoint=f"{python_on_nodes(netns_cfg)} -c {code!r}",
                  runtime_env={"working_dir": str(ROOT), "excludes": working_dir_excludes(ROOT)},
                  entrypoint_num_cpus=0, entrypoint_num_gpus=0, timeout_s=300, submit="")
    out = submit_and_wait(netns_cfg, job, progress=lambda m: None)
    assert out.ok, out.log_tail
    assert f"V4_DEQ 3 0 {n_shards}" in out.log_tail                 # the parts wrote every shard
    ips = {line.split(" on ")[1].split(":")[0] for line in out.log_tail.splitlines() if "dequantize: part" in line}
    assert ips == {h.ip for h in netns_cluster.hosts}, out.log_tail
    for f in sorted(one.glob("*.safetensors")):
        a, b = load_file(str(f)), load_file(str(dst / f.name))
        assert a.keys() == b.keys() and all(bool((a[k] == b[k]).all()) for k in a)
    assert (dst / "model.safetensors.index.json").read_text() == (one / "model.safetensors.index.json").read_text()


def test_killed_worker_raylet_shows_in_status_and_up_heals_it(netns_cluster, netns_cfg, ray_up):
    victim = cluster.status(netns_cfg).nodes[2]
    pid = victim.proc("raylet")["pid"]
    os.kill(pid, signal.SIGKILL)
    st = cluster.status(netns_cfg)
    assert not st.healthy
    assert any(victim.ip in p and "raylet" in p for p in st.problems), st.problems
    assert [n.ip for n in st.nodes if not n.proc("raylet")["alive"]] == [victim.ip]
    r = v4(netns_cfg, "cluster", "status", check=False)
    assert r.returncode == 5 and f"pid {pid} DEAD" in r.stdout and "NOT healthy" in r.stdout
    healed = cluster.up(netns_cfg)              # restarts that worker only
    assert healed.healthy and healed.changed
    assert healed.nodes[0].proc("raylet")["pid"] == st.nodes[0].proc("raylet")["pid"]
    assert healed.nodes[2].proc("raylet")["pid"] != pid


def test_up_fails_at_once_when_every_ray_runs_but_the_cluster_is_wrong(netns_cluster, ray_up, tmp_path):
    """Asked for 2 CPUs a node while every node's Ray runs with 1: nothing to start, and waiting
    V4_RAY_READY_TIMEOUT would not change it. `up` says so at once, with what to do."""
    path = netns_cluster.env_file(tmp_path / "cpus2.env", V4_RAY_NUM_CPUS=2, V4_RAY_READY_TIMEOUT=60)
    cfg = resolve(Selection(cluster=str(path), hw="cpu"))
    t = time.monotonic()
    with pytest.raises(ClusterError, match="Ray runs on every node but the cluster is not healthy") as e:
        cluster.up(cfg)
    assert time.monotonic() - t < 20
    assert "Ray sees 1 CPU(s), expected 2" in e.value.message
    assert "V4_RAY_NUM_CPUS" in e.value.fix and "`v4 cluster down`, then `v4 cluster up`" in e.value.fix


def test_waiting_for_readiness_says_how_long_it_has_left(netns_cluster, ray_up, tmp_path, monkeypatch):
    """Every poll says something: what it waits for where that changed, else how long it has waited and has left
    (the heartbeat, 1 s here, is shorter than a poll). Counted against the polls, not the clock: on a loaded machine
    one poll over SSH can take seconds."""
    path = netns_cluster.env_file(tmp_path / "cpus2.env", V4_RAY_NUM_CPUS=2)
    cfg = resolve(Selection(cluster=str(path), hw="cpu"))
    lines: list[str] = []
    polls = []
    real_status = cluster.status
    monkeypatch.setattr(cluster, "status", lambda *a, **kw: polls.append(1) or real_status(*a, **kw))
    with opened(cfg) as nodes, pytest.raises(ClusterError, match="not ready after 6 s"):
        cluster.wait_ready(cfg, nodes, progress=lines.append, timeout=6, heartbeat=1)
    beats = [x for x in lines if x.startswith("ray: still waiting")]
    assert len(polls) >= 2 and beats and len(lines) == len(polls), (len(polls), lines)
    assert "s so far" in beats[0] and "s left (V4_RAY_READY_TIMEOUT=6)" in beats[0], beats


def test_down_stops_only_what_it_started(netns_cluster, netns_cfg, ray_up, tmp_path):
    c = netns_cluster
    host = c.hosts[1]
    # A Ray this tool did not start, on the same host (own port, temp dir and tag).
    foreign_tmp = c.root / "foreign"
    env = dict(os.environ, FOREIGN_RAY="1", PATH=os.path.dirname(sys.executable) + ":" + os.environ["PATH"])
    r = subprocess.run(["ip", "netns", "exec", host.ns, sys.executable, "-m", "ray.scripts.scripts", "start",
                        "--head", f"--node-ip-address={host.ip}", "--port=6999", "--include-dashboard=false",
                        "--num-cpus=1", "--num-gpus=0", f"--temp-dir={foreign_tmp}",
                        "--dashboard-agent-listen-port=0", "--disable-usage-stats"],
                       env=env, capture_output=True, text=True, timeout=120, start_new_session=True)
    assert r.returncode == 0, r.stderr[-2000:]
    foreign = tagged_pids("FOREIGN_RAY=")
    try:
        assert any("raylet" in open(f"/proc/{p}/comm").read() for p in foreign)
        ours = tagged_pids("V4_RAY_SESSION=v4-netns-")
        assert len(ours) >= 3 * 3
        assert cluster.read_auth_token(netns_cfg)
        ips = [h.ip for h in c.hosts]
        before = ssh_sockets(ips)
        reports = cluster.down(netns_cfg)
        assert settled_ssh_sockets(ips, before) <= before, "down left SSH connections open"
        assert [rep["ok"] for rep in reports] == [True] * 3, reports
        # each node's daemons signalled one after another end on SIGTERM (ray_procs.STOP_ORDER)
        assert [rep["killed"] for rep in reports] == [[]] * 3, reports
        time.sleep(0.5)
        assert [p for p in ours if _alive(p)] == [], "a process started by `up` survived `down`"
        assert tagged_pids("V4_RAY_SESSION=v4-netns-") == []
        assert all(_alive(p) for p in foreign), "down touched a Ray it did not start"
        st = cluster.status(netns_cfg)
        assert not st.healthy and not st.gcs_ok
        assert not any(n.recorded for n in st.nodes)
        # the token went with the Ray it was made for: `v4 cluster token` has nothing stale to print
        assert not [ip for ip in ips if Path(cluster.auth_token_path(netns_cfg, ip)).exists()]
        assert cluster.read_auth_token(netns_cfg) == ""
        assert v4(netns_cfg, "cluster", "token", check=False).returncode == 5
    finally:
        for p in tagged_pids("FOREIGN_RAY="):
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_down_in_container_mode_twice(netns_cluster):
    """Container mode: the first `down` stops what runs in v4's containers and removes them; the second finds no
    container, hence nothing of ours running: ok, not a failed `docker exec`. A container v4 did not make is left
    alone; a removal that fails is a failed `down`."""
    c = netns_cluster
    cfg = container_cfg(c)
    ours = "running=true\nlabel=netns\nimage=img:1\n"
    with fake_docker(c, {0: ours, 1: ours, 2: "running=true\nlabel=someone-else\nimage=x:2\n"}) as state:
        first = cluster.down(cfg)
        assert [r["ok"] for r in first] == [True] * 3, first
        assert [r["container"] for r in first] == ["running", "running", "not v4's"], first
        assert [r["container_removed"] for r in first] == [True, True, False], first
        assert sorted(p.name for p in state.iterdir()) == [c.hosts[2].hostname]      # someone else's stays
        second = cluster.down(cfg)
        assert [r["ok"] for r in second] == [True] * 3, second
        assert [r["container"] for r in second] == ["absent", "absent", "not v4's"], second
        (state / c.hosts[1].hostname).write_text(ours + "rm=fail\n")
        third = cluster.down(cfg)
    assert [r["ok"] for r in third] == [True, False, True], third
    assert "removal of container in progress" in third[1]["error"]


def test_up_when_the_head_refuses_sftp_is_a_cluster_error(netns_cluster, netns_cfg, tmp_path):
    """The head runs commands but refuses SFTP (where `up` copies the auth token): exit 5 with the head named and a
    fix, not a paramiko traceback with exit 1."""
    c, h = netns_cluster, netns_cluster.hosts[0]
    wrapper = tmp_path / "no_sftp.sh"
    wrapper.write_text('#!/bin/bash\ncase "$SSH_ORIGINAL_COMMAND" in *sftp*) echo "sftp is disabled here" >&2; '
                       'exit 1;; esac\nexec bash -c "$SSH_ORIGINAL_COMMAND"\n')
    wrapper.chmod(0o755)
    c.restart_sshd(h, extra_config=f"ForceCommand {wrapper}")
    try:
        r = v4(netns_cfg, "cluster", "up", check=False)
    finally:
        c.restart_sshd(h)
    assert r.returncode == 5, r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    assert f"installing the Ray auth token on {h.ip} failed" in r.stderr and "SFTP" in r.stderr, r.stderr[-3000:]
    assert f"fix: `v4 preflight --only ssh` checks SSH (and SFTP) to {h.ip}" in r.stderr
    assert tagged_pids("V4_RAY_SESSION=v4-netns-") == []            # nothing was started
