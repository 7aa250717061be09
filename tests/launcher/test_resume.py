"""Resuming, stopping and timing out a run, without Ray: `--resume` resolution, what a resumed step does with the
job an earlier attempt left running, `v4 runs stop` and SIGTERM on the local executor, the local deadline, the
commands a run prints, and a real launcher process interrupted mid-step then resumed (section 6; the same on a real
local Ray: tests/cluster/test_resume_ray.py). Local jobs here are tiny shell/python commands put in place of the
real entrypoints."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from launcher import pipeline, registry
from launcher import plan as planning
from launcher.cli import main
from launcher.config import Selection, resolve
from launcher.errors import ConfigError, JobError
from launcher.jobs import Outcome
from launcher.plan import JobSpec

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable


def config(work, *sets, executor="local", env_files=()):
    return resolve(Selection(preset="smoke", hw="cpu", env_files=tuple(env_files),
                             sets=(f"V4_WORK={work}", f"V4_EXECUTOR={executor}", *sets)))


def job_plan(cfg, *entrypoints):
    """The plan of `cfg` cut down to len(entrypoints) job steps running these commands instead (no preflight, no
    gates: what is tested is the step loop)."""
    names = list(planning.PIPELINE)[:len(entrypoints)]
    cfg.values["PRESET_STEPS"] = names
    plan = planning.build(cfg)
    plan.steps = [s for s in plan.steps if s.kind == "job"]
    for step, entry in zip(plan.steps, entrypoints):
        step.job.entrypoint = entry
    return plan


def v4(capsys, *args):
    with pytest.raises(SystemExit) as e:
        main(list(args))
    out, err = capsys.readouterr()
    return e.value.code, out, err


def wait_for(pred, timeout=15.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (v := pred()):
            return v
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def group_gone(pgid) -> bool:
    try:
        os.killpg(pgid, 0)
        return False
    except ProcessLookupError:
        return True


def sleeper(run_dir, ignore_term=False):
    """A process group (as a local job is) whose environment says which run it belongs to, reaped by a thread
    as the launcher would reap it."""
    code = ("import signal, time\n" + ("signal.signal(signal.SIGTERM, signal.SIG_IGN)\n" if ignore_term else "")
            + "print('ready', flush=True)\ntime.sleep(60)\n")
    p = subprocess.Popen([PY, "-c", code], start_new_session=True, stdout=subprocess.PIPE, text=True,
                         env={**os.environ, "V4_RUN_DIR": str(run_dir)})
    assert p.stdout.readline().strip() == "ready"
    threading.Thread(target=p.wait, daemon=True).start()
    return p


# --- 1. --resume names a run: resolved before planning, refused when it names none -------------------------------

def test_resume_latest_or_a_prefix_plans_that_run(capsys, tmp_path):
    cfg = config(tmp_path)
    old = registry.create_run(cfg, run_id="stageA-20260101-000000-0001")
    new = registry.create_run(cfg, run_id="stageA-20260102-000000-0002")
    for ref, want in (("latest", new.id), ("stageA-20260101", old.id), (new.id, new.id)):
        code, out, err = v4(capsys, "run", "--preset", "smoke", "--hw", "cpu", "--set", f"V4_WORK={tmp_path}",
                            "--resume", ref, "--dry-run", "--json")
        assert code == 0, err
        plan = json.loads(out)
        assert plan["run_id"] == want and plan["run_dir"] == f"{tmp_path}/runs/{want}"
        train = next(s for s in plan["steps"] if s["name"] == "train")
        assert train["job"]["submission_id"] == f"{want}-train"


@pytest.mark.parametrize("ref", ["nonexist", "x; rm -rf /", "latest"])
def test_resume_of_no_run_is_a_usage_error_even_on_dry_run(capsys, tmp_path, ref):
    code, out, err = v4(capsys, "run", "--preset", "smoke", "--hw", "cpu", "--set", f"V4_WORK={tmp_path}",
                        "--resume", ref, "--dry-run")
    assert code == 2 and out == ""
    assert f"--resume {ref!r}: no run" in err and "fix: `v4 runs ls`" in err


def test_plan_refuses_a_run_id_that_is_not_one(tmp_path):
    with pytest.raises(ConfigError, match="is not PREFIX-YYYYmmdd-HHMMSS-xxxx"):
        planning.build(config(tmp_path), run_id="latest")


# --- 2, 9. the printed commands: every selection flag, secrets redacted -----------------------------------------

def test_rerun_command_keeps_every_flag_and_hides_secrets(tmp_path):
    env = tmp_path / "my.env"
    env.write_text("PRESET_NUM_STEPS=3\n")
    cfg = config(tmp_path, "V4_REDIS_PASSWORD=hunter2", env_files=[str(env)])
    cmd = pipeline.rerun_command(cfg, "--resume stageA-20260101-000000-0001", skip_checks=("ports", "disk"),
                                 force=True)
    assert cmd == (f"v4 run --preset smoke --cluster local --hw cpu --env-file {env} --set V4_WORK={tmp_path} "
                   "--set V4_EXECUTOR=local --set \"V4_REDIS_PASSWORD=${V4_REDIS_PASSWORD:?export V4_REDIS_PASSWORD "
                   "first: its value is not printed}\" --skip-check ports --skip-check disk "
                   "--force --resume stageA-20260101-000000-0001")
    assert "hunter2" not in cmd
    assert pipeline.rerun_command(cfg, preset="dryrun").startswith("v4 run --preset dryrun --cluster local")


# --- 3. a resumed step and the job an earlier attempt left running ----------------------------------------------

RUNNING = {"status": "running", "submission_id": "r-train"}
INTERRUPTED = {"status": "interrupted", "submission_id": "r-train"}         # Ctrl-C while the job ran (issue 42)


@pytest.mark.parametrize("step, state, can_follow, restart, action", [
    (RUNNING, "RUNNING", True, False, "follow"),
    (RUNNING, "PENDING", True, False, "follow"),
    (RUNNING, "SUCCEEDED", True, False, "collect"),
    (RUNNING, "FAILED", True, False, "new"),
    (RUNNING, "STOPPED", True, False, "new"),
    (RUNNING, None, True, False, "new"),                           # Ray never saw it (killed before submit)
    (RUNNING, "RUNNING", False, False, "refuse"),                  # a local group on another host
    (RUNNING, None, False, False, "new"),
    (INTERRUPTED, "RUNNING", True, False, "follow"),
    (INTERRUPTED, "SUCCEEDED", True, False, "collect"),
    (INTERRUPTED, "FAILED", True, False, "new"),
    (INTERRUPTED, "RUNNING", True, True, "stop"),                  # --restart-running
    (INTERRUPTED, "SUCCEEDED", True, True, "collect"),             # nothing running to restart: it is done
    ({**INTERRUPTED, "stop_requested": True}, "RUNNING", True, False, "stop"),   # a stop cut short: finish it
    ({"status": "stopped", "submission_id": "r-train"}, "RUNNING", True, False, "stop"),   # `runs stop` under way
    ({"status": "failed", "submission_id": "r-train", "job_status": "TIMEOUT"}, "RUNNING", True, False, "stop"),
    ({"status": "failed", "submission_id": "r-train"}, "RUNNING", True, False, "follow"),  # the launcher died of a bug
    ({"status": "failed", "submission_id": "r-train", "job_status": "FAILED"}, "FAILED", True, False, "new"),
    ({"status": "running"}, "RUNNING", True, False, "new"),
    ({}, None, True, False, "new"),
])
def test_resume_action(step, state, can_follow, restart, action):
    assert pipeline.resume_action(step, state, can_follow, restart) == action


class FakeRay:
    """The three calls of launcher.jobs a job step makes, answering from `states` (Ray's view of each job id)."""

    def __init__(self, states):
        self.states, self.calls = states, []

    def job_status(self, cfg, sid):
        self.calls.append(("status", sid))
        return self.states.get(sid)

    def wait(self, cfg, sid, timeout_s, log_path=None, progress=None, **kw):
        self.calls.append(("wait", sid))
        return Outcome(sid, "SUCCEEDED", 0, 1.0, "", str(log_path), "")

    def submit_and_wait(self, cfg, job, log_path=None, progress=None, **kw):
        self.calls.append(("submit", job.submission_id))
        return Outcome(job.submission_id, "SUCCEEDED", 0, 1.0, "", str(log_path), "")


@pytest.mark.parametrize("state, calls", [
    ("RUNNING", [("status", "{sid}"), ("wait", "{sid}")]),        # followed: no second job on the same checkpoints
    ("SUCCEEDED", [("status", "{sid}"), ("wait", "{sid}")]),      # finished unwatched: its result is taken
    ("FAILED", [("status", "{sid}"), ("submit", "{sid}-r1")]),
    (None, [("status", "{sid}"), ("submit", "{sid}-r1")]),
])
def test_resumed_ray_step_follows_the_job_it_left_running(tmp_path, state, calls):
    cfg = config(tmp_path, executor="ray")
    plan = planning.build(cfg)
    run = registry.create_run(cfg, plan)
    step = next(s for s in plan.steps if s.name == "train")
    sid = step.job.submission_id
    run.set_step("train", "running", submission_id=sid)             # then Ctrl-C: the Ray job kept running
    ray = FakeRay({sid: state})
    pipeline._job(cfg, run, step, ray)
    assert ray.calls == [(c, s.format(sid=sid)) for c, s in calls]
    assert run.step_status("train")["status"] == "done"


def run_beside_a_live_job(tmp_path):
    """(cfg, plan, run, process): a new one-step run, and a live process group that says it belongs to it."""
    cfg = config(tmp_path)
    plan = job_plan(cfg, "true")
    run = registry.create_run(cfg, plan)
    return cfg, plan, run, sleeper(run.dir)


def test_resumed_local_step_follows_its_earlier_job_and_refuses_one_on_another_host(tmp_path):
    cfg, plan, run, p = run_beside_a_live_job(tmp_path)
    sid = plan.steps[0].job.submission_id
    try:
        run.set_step("weights", "running", submission_id=sid, pgid=p.pid, host="elsewhere")
        with pytest.raises(JobError, match="may still run on elsewhere") as e:
            pipeline._job(cfg, run, plan.steps[0], None)
        assert e.value.fix.startswith(f"on elsewhere: v4 runs stop {run.id} --cluster local --hw cpu")
        assert "--restart-running" in e.value.fix
        run.set_step("weights", "interrupted", host=socket.gethostname())
        ended = threading.Timer(1.0, os.killpg, (p.pid, signal.SIGKILL))
        ended.start()
        with pytest.raises(JobError, match="without recording its exit status"):   # followed until it ended
            pipeline._job(cfg, run, plan.steps[0], None)
    finally:
        if not group_gone(p.pid):
            os.killpg(p.pid, signal.SIGKILL)
    s = run.step_status("weights")
    assert s["status"] == "failed" and s["submission_ids"] == [sid] and s["pgid"] == p.pid
    wait_for(lambda: group_gone(p.pid), what="the sleeper to end")
    pipeline._job(cfg, run, plan.steps[0], None)                   # gone: a new attempt, under a new id
    s = run.step_status("weights")
    assert s["status"] == "done" and s["submission_id"].endswith("-r1") and s["pgid"] != p.pid


def test_resume_with_settings_that_change_what_the_run_computes_is_refused(tmp_path, capsys):
    cfg = config(tmp_path)
    plan = job_plan(cfg, "true")
    run = registry.create_run(cfg, plan)
    run.write_json("config.json", {"values": cfg.job_values()}, private=True)     # as execute() writes it

    def again(*sets):                                  # the same selection (job_plan cut its steps) plus `sets`
        c = config(tmp_path, *sets)
        c.values["PRESET_STEPS"] = cfg.values["PRESET_STEPS"]
        return c
    registry.open_run(again("PRESET_JOB_TIMEOUT=99"), plan)                       # operational: no conflict
    other = again("PRESET_NUM_STEPS=500", "PRESET_SEQ_LEN=64")
    with pytest.raises(ConfigError, match="another configuration") as e:
        registry.open_run(other, plan)
    assert "PRESET_NUM_STEPS: 6 -> 500" in e.value.message and "PRESET_SEQ_LEN" in e.value.message
    assert "--force" in e.value.fix
    registry.open_run(other, plan, force=True)                                   # said, then allowed
    assert "continues with changed settings: PRESET_NUM_STEPS" in capsys.readouterr().err


def test_resume_is_refused_while_another_launcher_drives_the_run(tmp_path):
    cfg, plan, run, p = run_beside_a_live_job(tmp_path)
    try:
        run.update(launcher={"host": socket.gethostname(), "pid": p.pid})
        with pytest.raises(ConfigError, match=f"still driven by launcher pid {p.pid}"):
            registry.open_run(cfg, plan)
    finally:
        os.killpg(p.pid, signal.SIGKILL)
    wait_for(lambda: group_gone(p.pid), what="the sleeper to end")
    assert registry.open_run(cfg, plan).info()["launcher"]["pid"] == os.getpid()


# --- 4. stopping ------------------------------------------------------------------------------------------------

MARK_STOPPED = (f"{PY} -c \"import os; from pathlib import Path; from launcher.registry import Run; "
                f"d = Path(os.environ['V4_RUN_DIR']); Run(d.name, d).finish('stopped', error='by the test')\"")


def test_no_step_starts_after_the_run_was_stopped(tmp_path, capsys):
    """`v4 runs stop` between two steps: the launcher re-reads the run before each step, and keeps it stopped."""
    cfg = config(tmp_path, "V4_REDIS_PASSWORD=hunter2")
    marker = tmp_path / "second-step-ran"
    plan = job_plan(cfg, MARK_STOPPED, f"touch {marker}")
    with pytest.raises(JobError, match="was stopped"):
        pipeline.execute(cfg, plan, skip_checks=("ports",), force=True)
    run = registry.find_run(cfg, plan.run_id)
    assert not marker.exists() and run.info()["status"] == "stopped"
    assert run.step_status("weights")["status"] == "done" and run.step_status("prepare_data") == {}
    err = capsys.readouterr().err
    assert f"run {plan.run_id} STOPPED" in err
    # the resume line keeps --skip-check and --force, and takes the secret from the shell instead of printing it
    secret = '"V4_REDIS_PASSWORD=${V4_REDIS_PASSWORD:?export V4_REDIS_PASSWORD first: its value is not printed}"'
    assert (f"resume: v4 run --preset smoke --cluster local --hw cpu --set V4_WORK={tmp_path} --set V4_EXECUTOR=local "
            f"--set {secret} --skip-check ports --force --resume {plan.run_id}") in err
    assert (f"logs:   v4 runs logs {plan.run_id} --cluster local --hw cpu --set V4_WORK={tmp_path} "
            f"--set V4_EXECUTOR=local --set {secret}") in err
    assert "hunter2" not in err and "hunter2" not in run.path("manifest.json").read_text()


def test_a_printed_secret_set_pastes_as_the_value_in_the_shell_or_refuses():
    """What a printed command's secret --set becomes when pasted into bash: the exported value, or an error (never
    a placeholder taken as the password)."""
    import subprocess
    from launcher.config.resolve import shell_set
    word = shell_set("V4_REDIS_PASSWORD=hunter2")
    assert "hunter2" not in word
    echo = ["bash", "-c", f"printf '%s' {word}"]
    ok = subprocess.run(echo, env={"V4_REDIS_PASSWORD": "s3 cr$t'x", "PATH": os.environ["PATH"]},
                        capture_output=True, text=True)
    assert ok.returncode == 0 and ok.stdout == "V4_REDIS_PASSWORD=s3 cr$t'x"
    unset = subprocess.run(echo, env={"PATH": os.environ["PATH"]}, capture_output=True, text=True)
    assert unset.returncode != 0 and unset.stdout == "" and "export V4_REDIS_PASSWORD first" in unset.stderr
    assert shell_set("V4_WORK=/a b") == "'V4_WORK=/a b'"


@pytest.mark.parametrize("ignore_term", [False, True])
def test_runs_stop_ends_a_local_job_without_ray(capsys, tmp_path, monkeypatch, ignore_term):
    monkeypatch.setattr(pipeline, "STOP_GRACE_S", 0.5)
    cfg = config(tmp_path)
    run = registry.create_run(cfg, prefix="stageA")
    p = sleeper(run.dir, ignore_term=ignore_term)
    try:
        run.set_step("train", "running", submission_id=f"{run.id}-train", pgid=p.pid, host=socket.gethostname())
        code, _, err = v4(capsys, "runs", "stop", run.id, "--hw", "cpu", "--set", f"V4_WORK={tmp_path}")
        assert code == 0, err
        assert "cluster up" not in err and f"(pgid {p.pid})" in err
        wait_for(lambda: p.returncode is not None, 5, "the job to end")
        assert p.returncode == (-signal.SIGKILL if ignore_term else -signal.SIGTERM)
        assert run.info()["status"] == "stopped" and run.step_status("train")["status"] == "stopped"
    finally:
        if p.returncode is None:
            os.killpg(p.pid, signal.SIGKILL)


def test_runs_stop_leaves_a_reused_process_group_alone(capsys, tmp_path):
    """A pgid recorded long ago may now be someone else's: not a process of this run, not signalled."""
    cfg = config(tmp_path)
    run = registry.create_run(cfg, prefix="stageA")
    p = sleeper(tmp_path / "another-run")
    try:
        run.set_step("train", "running", submission_id=f"{run.id}-train", pgid=p.pid, host=socket.gethostname())
        code, _, err = v4(capsys, "runs", "stop", run.id, "--hw", "cpu", "--set", f"V4_WORK={tmp_path}")
        assert code == 0 and "(no running job)" in err and p.poll() is None
    finally:
        os.killpg(p.pid, signal.SIGKILL)


LAUNCHER = """
import sys
from launcher import pipeline, plan as planning
from launcher.config import Selection, resolve
cfg = resolve(Selection(preset="smoke", hw="cpu", sets=("V4_WORK={work}", "V4_EXECUTOR=local",
                                                        "PRESET_STEPS=weights")))
plan = planning.build(cfg)
plan.steps = [s for s in plan.steps if s.kind == "job"]
plan.steps[0].job.entrypoint = {entry!r}
print(plan.run_id, flush=True)
pipeline.execute(cfg, plan)
"""


def test_sigterm_to_the_launcher_stops_the_local_job(tmp_path):
    entry = f"{PY} -c \"import time; print('started', flush=True); time.sleep(60)\""
    proc = subprocess.Popen([PY, "-c", textwrap.dedent(LAUNCHER.format(work=tmp_path, entry=entry))], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pgid = None
    try:
        run_id = proc.stdout.readline().strip()
        status = tmp_path / "runs" / run_id / "steps/weights/status.json"
        log = tmp_path / "runs" / run_id / "steps/weights/log"
        pgid = wait_for(lambda: status.is_file() and json.loads(status.read_text()).get("pgid"), what="the pgid")
        wait_for(lambda: log.is_file() and "started" in log.read_text(), what="the job to start")
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=20)
        wait_for(lambda: group_gone(pgid), 5, "the job's process group to end")
        info = json.loads((tmp_path / "runs" / run_id / "run.json").read_text())
        assert info["status"] == "failed" and info["error"] == "interrupted: SIGTERM"
    finally:
        if proc.poll() is None:
            proc.kill()
        if pgid and not group_gone(pgid):
            os.killpg(pgid, signal.SIGKILL)


# --- 5. the local executor's deadline ---------------------------------------------------------------------------

def local_job(cmd, timeout_s):
    return JobSpec(submission_id="t-job", entrypoint=cmd, runtime_env={"working_dir": str(ROOT), "env_vars": {}},
                   entrypoint_num_cpus=1, entrypoint_num_gpus=0, timeout_s=timeout_s, submit="")


def test_a_silent_job_is_timed_out(tmp_path):
    t0 = time.monotonic()
    out = pipeline.run_local(config(tmp_path), local_job("sleep 20", 1.5), tmp_path / "log", progress=lambda m: None)
    assert out.status == "TIMEOUT" and out.exit_code == 124 and time.monotonic() - t0 < 8


def test_the_deadline_is_the_jobs_runtime_not_its_output(tmp_path):
    quiet = lambda m: None  # noqa: E731
    cfg = config(tmp_path)
    out = pipeline.run_local(cfg, local_job("sleep 1; echo late", 3), tmp_path / "a", progress=quiet)
    assert out.ok and out.exit_code == 0 and out.log_tail == "late"
    t0 = time.monotonic()
    out = pipeline.run_local(cfg, local_job("echo early; sleep 5; echo late", 1), tmp_path / "b", progress=quiet)
    assert out.status == "TIMEOUT" and time.monotonic() - t0 < 4
    assert out.log_tail == "early"
    out = pipeline.run_local(cfg, local_job("echo bad; exit 3", 5), tmp_path / "c", progress=quiet)
    assert out.status == "FAILED" and out.exit_code == 3 and out.log_tail == "bad"


def test_runs_logs_follows_a_local_job_until_it_ends(capsys, tmp_path):
    """`v4 runs logs RUN -f` on a running local step tails its log (no Ray involved) and returns when the job's
    process group is gone."""
    cfg = config(tmp_path)
    plan = job_plan(cfg, "true")
    run = registry.create_run(cfg, plan)
    log = run.step_log("weights")
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("line 1\n")
    writer = (f"import time\nfor i in (2, 3, 4):\n    time.sleep(0.4)\n"
              f"    open({str(log)!r}, 'a').write(f'line {{i}}\\n')\n")
    p = subprocess.Popen([PY, "-c", writer], start_new_session=True, env={**os.environ, "V4_RUN_DIR": str(run.dir)})
    threading.Thread(target=p.wait, daemon=True).start()
    run.set_step("weights", "running", submission_id=plan.steps[0].job.submission_id, pgid=p.pid,
                 host=socket.gethostname())
    t0 = time.monotonic()
    code, out, err = v4(capsys, "runs", "logs", run.id, "-f", "--hw", "cpu", "--set", f"V4_WORK={tmp_path}")
    assert code == 0, err
    assert out == "line 1\nline 2\nline 3\nline 4\n" and "process group" in err
    assert time.monotonic() - t0 < 15


# --- 6. interrupted for real, then resumed: never a second job beside the first (issue 42) -----------------------
# The launcher is the real CLI in its own process (resume_harness), signalled as a person or a scheduler would; the
# job holds a port, so a second one beside it dies of EADDRINUSE as the real trainer did.

import resume_harness as rh  # noqa: E402


def test_ctrl_c_twice_then_resume_waits_for_the_stopping_local_job(tmp_path):
    """Ctrl-C stops a local job (SIGTERM to its group); a second Ctrl-C while it still saves ends the launcher with
    the job alive. The resume must finish that stop before it starts the step again: never two beside each other."""
    marks, entry, args = rh.holding_setup(tmp_path, "--set", "V4_EXECUTOR=local")
    first, second = rh.Launcher(tmp_path, "first", args, entry), None
    try:
        rh.wait_for(lambda: rh.count(marks, "start") or first.ended(), 60, "the job to start")
        first.proc.send_signal(signal.SIGINT)
        rh.wait_for(lambda: rh.count(marks, "term") or first.ended(), 30, "the job to get SIGTERM")
        first.proc.send_signal(signal.SIGINT)
        assert first.wait() == 130, first.err
        run_id = first.run_id
        s = rh.step_status(tmp_path, run_id)
        assert s["status"] == "interrupted" and not rh.group_gone(s["pgid"])          # still saving
        assert f"its local job (process group {s['pgid']}) is still ending" in first.err, first.err
        second = rh.Launcher(tmp_path, "second", first.printed("resume:"), entry)
        # the fixed launcher stops it again (a second SIGTERM); a broken one starts a job beside it at once
        rh.wait_for(lambda: rh.count(marks, "term") == 2 or second.ended() or rh.count(marks, "EADDRINUSE"), 60,
                    "the resume to act")
        (marks / "saved").touch()
        rh.wait_for(lambda: rh.count(marks, "start") == 2 or second.ended(), 60, "the step's second job")
        (marks / "hold").unlink()
        assert second.wait() == 0, second.err
        assert rh.never_overlapped(marks) and rh.count(marks, "start") == 2, rh.events(marks)
        assert "stopping it first (an earlier attempt was stopping it)" in second.err, second.err
        done = rh.step_status(tmp_path, run_id)
        assert done["status"] == "done" and done["submission_ids"] == [f"{run_id}-weights", f"{run_id}-weights-r1"]
        assert rh.group_gone(s["pgid"])
    finally:
        rh.stop_leftovers(tmp_path, first, *([second] if second else []))


@pytest.mark.parametrize("restart", [False, True])
def test_resume_after_the_launcher_was_killed_follows_or_restarts_the_local_job(tmp_path, restart):
    """The launcher is SIGKILLed mid-step (OOM, a lost terminal): its local job runs on, writing its log itself. The
    resume follows that job to its end and takes its exit status; with --restart-running it stops it first, then runs
    the step anew. Either way one job at a time, and the run passes."""
    marks, entry, args = rh.holding_setup(tmp_path, "--set", "V4_EXECUTOR=local")
    (marks / "saved").touch()                   # a stopped job exits at once
    first, second = rh.Launcher(tmp_path, "first", args, entry), None
    try:
        rh.wait_for(lambda: rh.count(marks, "start") or first.ended(), 60, "the job to start")
        run_id = first.run_id
        pgid = rh.wait_for(lambda: rh.step_status(tmp_path, run_id).get("pgid"), 10, "the pgid")
        first.kill()
        assert not rh.group_gone(pgid) and rh.step_status(tmp_path, run_id)["status"] == "running"
        second = rh.Launcher(tmp_path, "second", [*args, "--resume", run_id, *(["--restart-running"] * restart)],
                             entry)
        if restart:
            rh.wait_for(lambda: rh.count(marks, "start") == 2 or second.ended(), 60, "the step's second job")
        else:
            rh.wait_for(lambda: second.said("following it") or second.ended(), 60, "the resume to act")
        (marks / "hold").unlink()
        assert second.wait() == 0, second.err
        assert rh.never_overlapped(marks), rh.events(marks)
        s = rh.step_status(tmp_path, run_id)
        assert s["status"] == "done" and rh.group_gone(pgid)
        if restart:
            assert rh.count(marks, "start") == 2 and s["submission_ids"] == [f"{run_id}-weights", f"{run_id}-weights-r1"]
            assert "stopping it first (--restart-running)" in second.err
        else:
            assert rh.count(marks, "start") == 1 and s["submission_ids"] == [f"{run_id}-weights"]
            assert s["exit_code"] == 0
            log = (tmp_path / "runs" / run_id / "steps" / "weights" / "log").read_text()
            assert "after the hold" in log and "  | after the hold" in second.err
    finally:
        rh.stop_leftovers(tmp_path, first, *([second] if second else []))


def test_restart_running_without_resume_is_a_usage_error(capsys, tmp_path):
    code, out, err = v4(capsys, "run", "--preset", "smoke", "--hw", "cpu", "--set", f"V4_WORK={tmp_path}",
                        "--restart-running", "--dry-run")
    assert code == 2 and "--restart-running" in err and "--resume" in err
    code, out, err = v4(capsys, "run", "--help")
    assert code == 0 and "--restart-running" in out
