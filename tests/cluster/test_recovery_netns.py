"""Runs that survive, on three SSH hosts (network namespaces with real sshd and real Ray; launcher/recovery.py,
docs/resilience.md). In file order, on one Ray cluster per configuration:

1. `preflight --only nccl` with a host that does not answer: its ssh row fails, not a table that passes without it.
2. `v4 run --exclude-bad-nodes` with a failing check planted on host 2 (V4_WORK not shared there): the run goes on
   without it (world 3 -> 2); the registry, the summary, `runs show` and `cluster status` name it and why.
3. Training on the head and host 1, host 2 a standby (V4_STANDBY_IPS): host 1's Ray and processes killed mid-train
   -- the launcher notices it from the GCS, stops the job, the standby passes preflight and its Ray comes up, and the
   step resumes from the last checkpoint on the same layout (the steps run twice give the same losses as the first
   time); then host 2 killed too -- the head goes on alone (world 2 -> 1). The registry, `runs show` and `cluster
   status` name both nodes.
4. A worker off the network during a job: named from the GCS's node state within V4_NODE_DEAD_TIMEOUT, the job
   stopped (without the watch the wait would last until PRESET_JOB_TIMEOUT).
5. The head's GCS killed during a run: a clean exit 5 naming the head, with the resume command; no traceback.
Each test prints what it measured (docs/resilience.md quotes the figures).
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import free_port
from launcher import cluster, jobs
from launcher.config import Selection, resolve
from netns import pids_in_namespaces

pytestmark = [pytest.mark.netns, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
# a small smoke: 8 steps, a checkpoint every 2, on every node; the hosts are slow (six engineers share two cores)
RUN = ("--preset", "smoke", "--hw", "cpu", "--set", "PRESET_NUM_NODES=0", "--set", "PRESET_NUM_STEPS=8",
       "--set", "PRESET_SAVE_INTERVAL=2", "--set", "PRESET_STRICT_PREFLIGHT=0", "--set", "PRESET_JOB_TIMEOUT=900",
       "--set", "PRESET_GLOBAL_BATCH_SIZE=12")                 # a multiple of every DP here: 3, 2 and 1


@pytest.fixture(scope="module")
def ports():
    """One set of Ray ports for the module (each configuration below uses them: one Ray at a time)."""
    return {"V4_RAY_PORT": free_port(), "V4_DASHBOARD_PORT": free_port(), "V4_RAY_CLIENT_PORT": free_port(),
            "V4_DIST_PORT": 0, "V4_RAY_NUM_CPUS": 2, "V4_NODE_DEAD_TIMEOUT": 6, "V4_RAY_READY_TIMEOUT": 180}


@pytest.fixture(scope="module")
def inputs(netns_cluster):
    """The train step's inputs (generated weights, converted; the prepared data) in the hosts' shared V4_WORK, made
    once by the local executor: the runs below are the train step alone."""
    c = netns_cluster
    r = subprocess.run([sys.executable, "-m", "launcher", "run", "--preset", "smoke", "--cluster", "local",
                        "--hw", "cpu",
                        "--set", "V4_EXECUTOR=local", "--set", f"V4_WORK={c.root / 'work'}",
                        "--set", f"V4_LOCAL_DIR={c.root / 'local'}", "--set", "PRESET_GATES=",
                        "--set", "PRESET_STEPS=weights prepare_data dequantize convert"],
                       cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
    return ("--set", "PRESET_STEPS=train")


@pytest.fixture(scope="module")
def made(netns_cluster, ports):
    """The cluster files this module made; whatever Ray they brought up is stopped at the end."""
    files: list[Path] = []
    yield files
    for h in netns_cluster.hosts:                       # a host killed by a test gets its sshd back
        if h.sshd is None or h.sshd.poll() is not None:
            netns_cluster.start_sshd(h)
    # Every file has the module's ports and V4_LOCAL_DIR, so each node keeps what any of them started in one state
    # directory (launcher.cluster.ray_state_dir): one `down` over all the hosts stops it all.
    if files:
        try:
            cluster.down(resolve(Selection(cluster=str(netns_cluster.env_file(netns_cluster.root / "all.env", **ports)),
                                           hw="cpu")), progress=lambda m: None)
        except Exception:   # noqa: BLE001 - teardown: the netns teardown kills what is left
            pass


def cluster_file(c, made, ports, name: str, **values) -> Path:
    path = c.env_file(c.root / f"{name}.env", **ports, **values)
    made.append(path)
    return path


def launch(path: Path, err: Path, *args) -> subprocess.Popen:
    with open(err, "w") as f:
        return subprocess.Popen([sys.executable, "-m", "launcher", "run", "--cluster", str(path), *RUN, *args],
                                cwd=ROOT, stdout=subprocess.DEVNULL, stderr=f, stdin=subprocess.DEVNULL)


def v4(path: Path, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launcher", *args, "--cluster", str(path), "--hw", "cpu"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


def wait_for(pred, timeout: float, what: str, proc: subprocess.Popen | None = None, err: Path | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (v := pred()):
            return v
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the launcher ended ({proc.returncode}) before {what}:\n"
                                 + (err.read_text()[-5000:] if err else ""))
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}" + (f":\n{err.read_text()[-5000:]}" if err else ""))


def rows(run: Path, name: str = "metrics.jsonl") -> list[dict]:
    p = run / name
    return [json.loads(x) for x in p.read_text().splitlines() if x.strip()] if p.exists() else []


def run_dir(c, err: Path) -> Path:
    line = next(ln for ln in err.read_text().splitlines() if ln.startswith("run ") and ": /" in ln)
    return Path(line.split(": ", 1)[1])


def kill_host(c, h) -> float:
    """SIGKILL to every process of host `h` (its Ray, the ranks there, its sshd), as a host that dies: nothing of it
    says goodbye to the GCS. The time it happened."""
    t = time.time()
    for _ in range(3):                       # a process forked meanwhile is in the next sweep
        for pid in pids_in_namespaces([h.ns]):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)
    h.sshd = None
    return t


def test_preflight_only_nccl_fails_on_a_host_that_does_not_answer(netns_cluster, made, ports):
    c, h = netns_cluster, netns_cluster.hosts[2]
    path = cluster_file(c, made, ports, "pf")
    saved = h.authorized_keys.read_text()
    h.authorized_keys.write_text("")
    try:
        r = v4(path, "preflight", "--only", "nccl", "--json")
    finally:
        h.authorized_keys.write_text(saved)
    assert r.returncode == 3, r.stderr
    out = json.loads(r.stdout)
    assert [(x["name"], x["node"], x["status"]) for x in out["results"] if x["status"] == "FAIL"] == [
        ("ssh", h.ip, "FAIL")], out
    assert not out["ok"]


def test_a_node_that_fails_preflight_is_left_out(netns_cluster, made, ports, tmp_path):
    """Ray already up on all three hosts (an earlier `cluster up`), then host 2 goes bad: the run stops the Ray v4
    started there (else its ranks could be placed on it, and `cluster up` would refuse the node it does not hold) and
    comes up on the other two."""
    c = netns_cluster
    head, w1, w2 = c.hosts
    path = cluster_file(c, made, ports, "three")
    assert cluster.up(resolve(Selection(cluster=str(path), hw="cpu")), progress=lambda m: None).healthy
    private = tmp_path / "not_shared"
    private.mkdir()
    # the planted failure: host 2 sees its own empty directory at V4_WORK (preflight `shared_work` fails there)
    c.restart_sshd(w2, private_mounts=[(str(private), str(c.root / "work"))])
    err = tmp_path / "a.err"
    try:
        p = launch(path, err, "--exclude-bad-nodes", "--set", "PRESET_STEPS=weights", "--set", "PRESET_GATES=")
        wait_for(lambda: "[preflight] going on with" in err.read_text(), 600, "preflight", p, err)
    finally:
        c.restart_sshd(w2)
    rc = p.wait(timeout=600)
    text = err.read_text()
    assert rc == 0, text[-6000:]
    run = run_dir(c, err)
    assert f"[preflight] leaving out {w2.ip}: shared_work: {c.root / 'work'} on {w2.ip} does not show" in text
    assert f"[preflight] going on with 2 node(s): {head.ip} {w1.ip} (world 3 -> 2, DP 2)" in text
    assert f"[preflight] {w2.ip}: stopped the " in text and "Ray process(es) v4 had started there" in text
    assert "[cluster] bringing up Ray on 2 node(s)" in text and "cluster netns: already up (2 nodes ALIVE)" in text
    values = json.loads((run / "config.json").read_text())["values"]
    assert (values["V4_NUM_NODES"], values["WORLD_SIZE"], values["DP"]) == (2, 2, 2)
    assert values["V4_WORKER_IPS"] == [w1.ip]
    up = json.loads((run / "steps" / "cluster-up" / "status.json").read_text())["cluster"]
    assert [n["ip"] for n in up["nodes"]] == [head.ip, w1.ip]
    rec = json.loads((run / "run.json").read_text())["recovery"]
    assert [(e["ip"], e["by"], e["checks"]) for e in rec["left_out"]] == [(w2.ip, "preflight", ["shared_work"])]
    assert rec["restarts"] == []
    summary = json.loads((run / "summary.json").read_text())
    assert [e["ip"] for e in summary["left_out"]] == [w2.ip] and summary["restarts"] == 0
    assert f"left out: {w2.ip} (preflight: shared_work: " in text
    show = v4(path, "runs", "show", run.name).stdout
    assert f"left out: {w2.ip} (preflight, " in show and "does not show the file the head wrote" in show, show
    status = v4(path, "cluster", "status")
    assert f"left out by runs:\n  - {w2.ip}: shared_work: " in status.stdout, status.stdout
    assert f"(run {run.name}, preflight," in status.stdout


def test_lost_nodes_resume_on_a_standby_then_on_the_rest(netns_cluster, made, ports, inputs, tmp_path):
    """Host 1 killed after step 3: standby host 2 takes its place (world 2 -> 2) and the step it repeats comes out
    the same; then host 2 killed after step 5: no standby is left, the head goes on alone (world 2 -> 1, the
    checkpoint read at DP 1)."""
    c = netns_cluster
    head, w1, w2 = c.hosts
    path = cluster_file(c, made, ports, "standby", V4_WORKER_IPS=w1.ip, V4_NUM_NODES=2, V4_STANDBY_IPS=w2.ip)
    err = tmp_path / "b.err"
    p = launch(path, err, *inputs)
    run = wait_for(lambda: "] SFT on megatron-core" in err.read_text() and run_dir(c, err), 900, "the train step", p,
                   err)
    wait_for(lambda: any(r["step"] >= 3 for r in rows(run)), 900, "step 3", p, err)
    t_kill = kill_host(c, w1)
    wait_for(lambda: any(r.get("restarts") for r in rows(run)), 900, "the standby's first step", p, err)
    t_again = time.time()
    wait_for(lambda: any(r.get("restarts") == 1 and r["step"] >= 5 for r in rows(run)), 900, "step 5", p, err)
    t_kill2 = kill_host(c, w2)
    wait_for(lambda: any(r.get("restarts") == 2 for r in rows(run)), 900, "the head's first step alone", p, err)
    t_again2 = time.time()
    rc = p.wait(timeout=900)
    text = err.read_text()
    assert rc == 0, text[-6000:]
    assert "Traceback" not in text
    assert f"[recovery] preflight of standby node(s) {w2.ip}" in text and f"bringing up Ray on standby {w2.ip}" in text
    # named by the GCS (DEAD), or -- where the job failed before the GCS had decided -- by `cluster status` (its SSH
    # gone with its sshd)
    lost_as = r"node {} lost: (DEAD in the Ray GCS|unreachable: )"
    assert re.search(lost_as.format(re.escape(w1.ip)), text) and re.search(lost_as.format(re.escape(w2.ip)), text)
    rec = json.loads((run / "run.json").read_text())["recovery"]
    r1, r2 = rec["restarts"]
    assert (r1["cause"], r1["nodes"], r1["standby"], r1["nodes_after"]) == ("node_lost", [w1.ip], [w2.ip],
                                                                           [head.ip, w2.ip])
    assert (r2["cause"], r2["nodes"], r2["standby"], r2["nodes_after"]) == ("node_lost", [w2.ip], [], [head.ip])
    assert (r1["world_before"], r1["world_after"], r2["world_before"], r2["world_after"]) == (2, 2, 2, 1)
    assert all(0 <= r["steps_lost"] <= 2 for r in (r1, r2))                 # at most the save interval
    assert [(e["ip"], e["by"], e["replaced_by"]) for e in rec["left_out"]] == [(w1.ip, "lost", w2.ip),
                                                                              (w2.ip, "lost", "")]
    got = {x["step"]: x for x in rows(run)}
    assert sorted(got) == list(range(1, 9))                                  # each step once
    assert [got[s]["world"] for s in sorted(got)] == [2] * r2["from_step"] + [1] * (8 - r2["from_step"])
    assert [got[s].get("restarts") for s in sorted(got)] == (
        [None] * r1["from_step"] + [1] * (r2["from_step"] - r1["from_step"]) + [2] * (8 - r2["from_step"]))
    # the steps the first job had done past its checkpoint, done again on the standby: the same layout from the same
    # checkpoint gives them bit for bit
    again = [x for x in rows(run, "metrics.superseded.jsonl") if x["by_attempt"] == 1]
    assert [x["step"] for x in again] == list(range(r1["from_step"] + 1, r1["last_step"] + 1))
    assert again, "the kill came after the step's save: nothing was run twice to compare"
    for x in again:
        assert (x["loss"], x["grad_norm"]) == (got[x["step"]]["loss"], got[x["step"]]["grad_norm"]), x["step"]
    assert all(g["passed"] for g in json.loads((run / "gates.json").read_text()))
    assert not [d for d in (run / "checkpoints").glob("iter_*") if not any(d.iterdir())]   # no save cut short left
    summary = json.loads((run / "summary.json").read_text())
    assert summary["restarts"] == 2 and summary["steps_lost"] == r1["steps_lost"] + r2["steps_lost"]
    assert "restarts: 2 (node_lost: " in text
    show = v4(path, "runs", "show", run.name).stdout
    assert "restarts: 2 of PRESET_MAX_RESTARTS=2 for the run (0 left)" in show, show
    assert f"train  node lost: {w1.ip}" in show and f"world 2 -> 2, standby {w2.ip}" in show
    assert f"train  node lost: {w2.ip}" in show and "world 2 -> 1" in show
    assert f"left out: {w1.ip} (lost in train" in show and f"standby {w2.ip} in its place" in show
    status = v4(path, "cluster", "status").stdout
    assert f"left out by runs:\n  - {w1.ip}: " in status and f"\n  - {w2.ip}: " in status, status
    assert status.count(f"(run {run.name}, lost,") == 2
    print(f"\nhost 1 killed after step {r1['last_step']}: noticed {r1['at'] - t_kill:.1f} s after the kill "
          f"({r1['noticed_after_s']} s after the GCS declared it dead); standby {w2.ip} checked and its Ray up in "
          f"{r1['restart_s']:.0f} s; training again {t_again - t_kill:.0f} s after the kill; {len(again)} step(s) "
          f"repeated, identical.\nhost 2 killed after step {r2['last_step']}: noticed {r2['at'] - t_kill2:.1f} s after "
          f"the kill, next job {r2['restart_s']:.2f} s later, training again {t_again2 - t_kill2:.0f} s after the "
          "kill")


def test_a_worker_off_the_network_is_named_from_the_gcs(netns_cluster, made, ports):
    from launcher.plan import JobSpec
    from launcher.recovery import node_watch
    c = netns_cluster
    head, w1, w2 = c.hosts
    for h in (w1, w2):
        if h.sshd is None:
            c.start_sshd(h)
    path = cluster_file(c, made, ports, "drop", V4_WORKER_IPS=w2.ip, V4_NUM_NODES=2)
    cfg = resolve(Selection(cluster=str(path), hw="cpu"))
    assert cluster.up(cfg, progress=lambda m: None).healthy
    job = JobSpec(submission_id=f"drop-{os.getpid()}", entrypoint="sleep 600", runtime_env={},
                  entrypoint_num_cpus=0, entrypoint_num_gpus=0, timeout_s=300, submit="")
    out = {}

    def cut():            # once the job runs
        client = jobs.client(cfg)
        wait_for(lambda: jobs.job_status(cfg, job.submission_id, client) == "RUNNING", 120, "the job to run")
        out["t"] = time.time()
        c.set_link(w2, up=False)

    import threading
    t = threading.Thread(target=cut, daemon=True)
    t.start()
    try:
        o = jobs.submit_and_wait(cfg, job, progress=lambda m: None, watch=node_watch(cfg))
    finally:
        t.join()
        c.set_link(w2, up=True)
    took = time.time() - out["t"]
    assert o.status == "NODE_LOST" and o.lost["nodes"] == [w2.ip], o
    assert f"node {w2.ip} lost: DEAD in the Ray GCS" in o.message
    assert took < 120                                  # not PRESET_JOB_TIMEOUT (300 s here)
    assert jobs.job_status(cfg, o.submission_id) in jobs.TERMINAL
    print(f"\nworker off the network: named {took:.1f} s after its link went down (V4_NODE_DEAD_TIMEOUT=6; "
          f"{o.lost['after_s']} s after the GCS declared it dead)")


def test_the_head_lost_is_a_clean_error_with_the_resume_command(netns_cluster, made, ports, tmp_path):
    """The real CLI on a plan cut to one job step that sleeps (tests/launcher/one_step_v4.py); the head's GCS killed
    while it runs."""
    c = netns_cluster
    head, w1, w2 = c.hosts
    if w1.sshd is None:
        c.start_sshd(w1)
    # host 1, not host 2: the raylet host 2 had before its link went down may still be ending
    path = cluster_file(c, made, ports, "drop2", V4_WORKER_IPS=w1.ip, V4_NUM_NODES=2)
    cfg = resolve(Selection(cluster=str(path), hw="cpu"))
    assert cluster.up(cfg, progress=lambda m: None).healthy
    err = tmp_path / "c.err"
    with open(err, "w") as f:
        p = subprocess.Popen([sys.executable, str(ROOT / "tests" / "launcher" / "one_step_v4.py"), "run",
                              "--cluster", str(path), *RUN], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=f,
                             stdin=subprocess.DEVNULL, env={**os.environ, "V4_TEST_ENTRY": "sleep 600"})
    try:
        wait_for(lambda: "submitted to" in err.read_text(), 300, "the job", p, err)
        run = run_dir(c, err)
        sid = f"{run.name}-weights"
        wait_for(lambda: jobs.job_status(cfg, sid) == "RUNNING", 120, "the job to run", p, err)
        gcs = cluster.status(cfg).nodes[0].proc("gcs_server")["pid"]
        t = time.time()
        os.kill(gcs, signal.SIGKILL)
        rc = p.wait(timeout=300)
    finally:
        if p.poll() is None:
            p.kill()
    took = time.time() - t
    text = err.read_text()
    assert rc == 5, text[-4000:]
    assert "Traceback" not in text, text[-4000:]
    assert f"the head {head.ip} has not answered for" in text and "its Ray GCS or dashboard is gone" in text, text
    assert f"  resume: v4 run --preset smoke --cluster {path}" in text and f"--resume {run.name}" in text
    assert "fix: `v4 cluster status` shows what is left; `v4 cluster up` starts the head again" in text
    status = json.loads((run / "steps" / "weights" / "status.json").read_text())
    assert status["status"] == "failed" and status["job_status"] == "HEAD_LOST"
    print(f"\nthe head's GCS killed: a clean exit 5 with the resume command {took:.1f} s later "
          f"(V4_NODE_DEAD_TIMEOUT=6)")
