"""The embedded default: LocalNode + a local Ray on this machine (own ports, own directories),
with jobs submitted, followed and stopped through the registry and the CLI."""
from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import free_port, tagged_pids
from launcher import cluster, jobs, preflight, registry
from launcher.node_scripts import ray_procs
from launcher.config import Selection, resolve
from launcher.plan import JobSpec

ROOT = Path(__file__).resolve().parents[2]



@pytest.fixture(scope="module")
def local_cfg(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("local")
    # Short node-local path: Ray's AF_UNIX socket paths live below it.
    local = Path(f"/tmp/v4loc-{tmp.name[-6:]}")
    sets = (f"V4_RAY_PORT={free_port()}", f"V4_DASHBOARD_PORT={free_port()}", f"V4_DIST_PORT={free_port()}",
            f"V4_WORK={tmp / 'work'}", f"V4_LOCAL_DIR={local}", "V4_RAY_NUM_CPUS=1")
    cfg = resolve(Selection(cluster="local", hw="cpu", sets=sets))
    yield cfg
    cluster.down(cfg)
    subprocess.run(["rm", "-rf", str(local)])


def v4(cfg, *args, **kw) -> subprocess.CompletedProcess:
    sets = [x for s in cfg.selection.sets for x in ("--set", s)]
    return subprocess.run([sys.executable, "-m", "launcher", *args, "--hw", "cpu", *sets], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, **kw)


def _job(sid: str, code: str) -> JobSpec:
    return JobSpec(submission_id=sid, entrypoint=f"{sys.executable} -c {shlex.quote(code)}", runtime_env={},
                   entrypoint_num_cpus=0, entrypoint_num_gpus=0, timeout_s=120, submit="")


def test_local_preflight_passes(local_cfg):
    rs = preflight.run_checks(local_cfg)
    assert not preflight.failed(rs), preflight.render_table(rs)
    assert {r.node for r in rs} == {"127.0.0.1"}


def test_no_cluster_is_a_cluster_error(local_cfg):
    from launcher.errors import ClusterError
    with pytest.raises(ClusterError, match="does not answer"):
        jobs.client(local_cfg)
    assert v4(local_cfg, "cluster", "status").returncode == 5


def test_local_up_and_probe(local_cfg):
    st = cluster.up(local_cfg)
    assert st.healthy and [n.ip for n in st.nodes] == ["127.0.0.1"]
    assert st.nodes[0].gcs_state == "ALIVE" and st.nodes[0].resources["CPU"] == 1
    assert not cluster.up(local_cfg).changed
    run = registry.create_run(local_cfg, prefix="probe", argv=["test"])
    outcome, seen = jobs.probe(local_cfg, run)
    assert outcome.ok and [s["ip"] for s in seen] == ["127.0.0.1"]
    assert run.info()["status"] == "passed"
    assert "V4_PROBE" in run.step_log("probe").read_text()


def test_the_cluster_refuses_what_has_no_token(local_cfg):
    """Ray's token auth is on: the Jobs API answers 401 without the token (a job there would run code on every node),
    and the token sits in a directory only its owner can read."""
    import stat
    import urllib.error
    import urllib.request
    url = cluster.dashboard_url(local_cfg) + "/api/jobs/"
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(url, timeout=30)
    assert e.value.code == 401
    token = cluster.read_auth_token(local_cfg)
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    assert urllib.request.urlopen(req, timeout=30).status == 200
    path = Path(cluster.auth_token_path(local_cfg, "127.0.0.1"))
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert len(token) >= 32
    assert v4(local_cfg, "cluster", "token").stdout.strip() == token


def test_failing_job_and_timeout(local_cfg):
    bad = jobs.submit_and_wait(local_cfg, _job("t-fail-" + str(time.time_ns()), "import sys; print('boom'); sys.exit(7)"))
    assert not bad.ok and bad.status == "FAILED" and bad.exit_code == 7 and "boom" in bad.log_tail
    job = _job("t-slow-" + str(time.time_ns()), "import time; time.sleep(300)")
    job.timeout_s = 3
    slow = jobs.submit_and_wait(local_cfg, job)
    assert slow.status == "TIMEOUT" and slow.exit_code == 124
    assert jobs.client(local_cfg).get_job_info(slow.submission_id).status.value == "STOPPED"


def test_runs_logs_follow_and_stop(local_cfg):
    run = registry.create_run(local_cfg, prefix="t", argv=["test"])
    sid = jobs.submit(local_cfg, _job(f"{run.id}-talk", "import time\nfor i in range(4):\n"
                                                      "    print('line', i, flush=True); time.sleep(1)"))
    run.set_step("talk", "running", submission_id=sid)
    r = v4(local_cfg, "runs", "logs", run.id, "-f")
    assert r.returncode == 0 and all(f"line {i}" in r.stdout for i in range(4)), r.stderr[-2000:]

    sid = jobs.submit(local_cfg, _job(f"{run.id}-long", "import time; time.sleep(600)"))
    run.set_step("long", "running", submission_id=sid)
    r = v4(local_cfg, "runs", "stop", run.id[:-1])
    assert r.returncode == 0 and sid in r.stderr
    c = jobs.client(local_cfg)
    for _ in range(30):
        if c.get_job_info(sid).status.value == "STOPPED":
            break
        time.sleep(1)
    assert c.get_job_info(sid).status.value == "STOPPED"
    show = json.loads(v4(local_cfg, "runs", "show", run.id, "--json").stdout)
    assert show["run"]["status"] == "stopped"
    assert {s["name"]: s["status"] for s in show["steps"]}["long"] == "stopped"



def test_a_resumed_step_follows_the_ray_job_its_launcher_left_running(local_cfg, tmp_path):
    """The launcher was interrupted while its step's Ray job ran: the resume asks Ray about that job and follows it
    to its end, so no second job works on the same outputs (real Ray, the real jobs module)."""
    from launcher import pipeline
    from launcher.plan import Step

    starts = tmp_path / "starts"
    code = f"import time\nopen({str(starts)!r}, 'a').write('start\\n')\ntime.sleep(4)\nprint('finished', flush=True)"
    run = registry.create_run(local_cfg, prefix="t", argv=["test"])
    job = _job(f"{run.id}-work", code)
    sid = jobs.submit(local_cfg, job)                              # the first attempt's job ...
    run.set_step("work", "running", submission_id=sid)              # ... recorded, then the launcher was gone
    step = Step("work", "job", "a step whose job outlived its launcher", job=job)
    pipeline._job(local_cfg, run, step, jobs)
    s = run.step_status("work")
    assert s["status"] == "done" and s["submission_ids"] == [sid]
    assert starts.read_text() == "start\n"                         # one job ran, not two
    assert "finished" in run.step_log("work").read_text()


def test_a_passed_run_says_ray_stays_up_and_how_to_stop_it(local_cfg, capsys):
    """Ray outlives a run on purpose (it is the checkout's cluster, another run may be using it, and the next one
    starts at once), and the summary says so: its ports, what it holds on this machine, the command that stops it."""
    import shlex

    from launcher import pipeline
    from launcher.plan import Plan
    assert cluster.status(local_cfg).healthy
    run = registry.create_run(local_cfg, prefix="t", argv=["test"])
    (run.dir / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.5, "step_time_s": 0.5}) + "\n")
    plan = Plan(run_id=run.id, run_dir=str(run.dir), selection={}, dashboard=cluster.dashboard_url(local_cfg),
                executor="ray", steps=[])
    pipeline._summary(local_cfg, run, plan, 1.0, as_json=True)
    out, err = capsys.readouterr()
    left = json.loads(out)["ray_left_running"]
    assert json.loads((run.dir / "summary.json").read_text())["ray_left_running"] == left
    gcs, dash, client = (local_cfg[k] for k in ("V4_RAY_PORT", "V4_DASHBOARD_PORT", "V4_RAY_CLIENT_PORT"))
    assert (left["gcs"], left["dashboard"], left["client_server"]) == (
        f"127.0.0.1:{gcs}", f"http://127.0.0.1:{dash}", f"127.0.0.1:{client}")
    assert left["processes"] >= 5 and left["memory_mb"] > 50, left       # raylet, gcs_server, dashboard, ...
    assert (f"Ray stays up for later runs: cluster local (1 node(s)), GCS 127.0.0.1:{gcs}, dashboard "
            f"http://127.0.0.1:{dash}, client server 127.0.0.1:{client}; {left['processes']} processes, "
            f"{left['memory_mb']} MB here\n  stop it: {left['down']}\n") in err
    # the printed command finds this very cluster (asked with `status`: the module's last test stops it)
    argv = shlex.split(left["down"])
    assert argv[:3] == ["v4", "cluster", "down"]
    r = subprocess.run([sys.executable, "-m", "launcher", "cluster", "status", "--json", *argv[3:]], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and json.loads(r.stdout)["gcs"] == f"127.0.0.1:{gcs}", r.stderr


def test_local_down_scoped_and_complete(local_cfg):
    # Another cluster sharing V4_LOCAL_DIR (another port) sees nothing of ours and stops nothing.
    other = resolve(Selection(cluster="local", hw="cpu", sets=(*local_cfg.selection.sets, f"V4_RAY_PORT={free_port()}")))
    assert [r["recorded"] for r in cluster.down(other)] == [False]
    assert cluster.status(local_cfg).healthy
    rec = json.loads(Path(cluster.cluster_commands(local_cfg)[0].state_dir, "ray_procs.json").read_text())
    token = rec["session"]
    assert tagged_pids(f"V4_RAY_SESSION={token}")
    # raylet's agents (dashboard, runtime env) do not always show the token in /proc/PID/environ
    raylet = next(p["pid"] for p in rec["procs"] if p["name"] == "raylet")
    below_raylet = []
    for pid in ray_procs.descendants([raylet]):
        try:
            below_raylet.append({"pid": pid, "start": ray_procs.proc_start(pid)})
        except OSError:
            pass                                   # a worker that exited meanwhile
    assert below_raylet, "raylet has no child processes: nothing to check"
    reports = cluster.down(local_cfg)
    assert reports[0]["ok"] and reports[0]["recorded"]
    # signalled one after another (raylet, monitor, gcs_server, the rest), Ray's daemons end on SIGTERM; together
    # they waited on one another past the grace and needed SIGKILL
    assert reports[0]["killed"] == [], reports[0]["killed"]
    assert tagged_pids(f"V4_RAY_SESSION={token}") == []
    assert [p for p in below_raylet if ray_procs.alive(p)] == [], "processes raylet started outlive `cluster down`"
    st = cluster.status(local_cfg)
    assert not st.healthy and not st.nodes[0].recorded
