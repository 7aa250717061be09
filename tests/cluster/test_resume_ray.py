"""Ctrl-C, then `--resume`, on a real local Ray (issue 42): the launcher is the real CLI in a process of its own
(tests/launcher/one_step_v4.py: the plan cut to one job step running holding_job.py), interrupted with SIGINT
while its Ray job runs. The resume follows that job (or takes its result, or with --restart-running stops it
first): the Jobs API never holds two live jobs for the step, and the run passes."""
from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import free_port
from launcher import cluster, jobs
from launcher.config import Selection, resolve

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "launcher"))
from resume_harness import Launcher, count, events, holding_setup, never_overlapped, step_status, wait_for  # noqa: E402


@pytest.fixture(scope="module")
def ray_cfg(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("resume-ray")
    local = Path(f"/tmp/v4res-{tmp.name[-6:]}")          # short: Ray's AF_UNIX socket paths live below it
    sets = (f"V4_RAY_PORT={free_port()}", f"V4_DASHBOARD_PORT={free_port()}", f"V4_DIST_PORT={free_port()}",
            f"V4_LOCAL_DIR={local}", "V4_RAY_NUM_CPUS=2")
    cfg = resolve(Selection(cluster="local", hw="cpu", sets=sets))
    assert cluster.up(cfg).healthy
    yield cfg
    cluster.down(cfg)
    subprocess.run(["rm", "-rf", str(local)])


def step_jobs(cfg, run_id: str) -> dict[str, str]:
    """submission id -> status of every job the Jobs API holds for the run's weights step."""
    return {j.submission_id: j.status.value for j in jobs.client(cfg).list_jobs()
            if (j.submission_id or "").startswith(f"{run_id}-weights")}


def interrupted(tmp_path, cfg, saved: bool = False):
    """A one-step run whose launcher got SIGINT while its Ray job ran: (marks, entry, args, the launcher)."""
    sets = [x for s in cfg.selection.sets for x in ("--set", s)]
    marks, entry, args = holding_setup(tmp_path, *sets)
    if saved:
        (marks / "saved").touch()
    first = Launcher(tmp_path, "first", args, entry)
    try:
        wait_for(lambda: count(marks, "start") or first.ended(), 120,
                 "the job to start")
        first.proc.send_signal(signal.SIGINT)                          # as Ctrl-C
        assert first.wait() == 130, first.err
    finally:
        first.kill()
    run_id = first.run_id
    assert step_status(tmp_path, run_id)["status"] == "interrupted"
    assert step_jobs(cfg, run_id) == {f"{run_id}-weights": "RUNNING"}
    return marks, entry, first


def release_and_end(cfg, run_id: str, marks: Path) -> None:
    (marks / "hold").unlink(missing_ok=True)
    wait_for(lambda: all(s in jobs.TERMINAL for s in step_jobs(cfg, run_id).values()), 60, "the jobs to end")


def test_resume_after_ctrl_c_follows_the_ray_job(ray_cfg, tmp_path):
    marks, entry, first = interrupted(tmp_path, ray_cfg)
    run_id, sid = first.run_id, f"{first.run_id}-weights"
    # the exit-130 message says what --resume will do, and how to restart or stop instead
    assert f"its Ray job {sid} keeps running" in first.err
    assert "--resume follows it to its end and starts no second job" in first.err
    assert f"--resume {run_id} --restart-running" in first.err and f"v4 runs stop {run_id}" in first.err
    second = Launcher(tmp_path, "second", first.printed("follow it:"), entry)
    try:
        wait_for(lambda: second.said("following it") or second.ended(), 90, "the resume to act")
        (marks / "hold").unlink()
        assert second.wait() == 0, second.err
        assert step_jobs(ray_cfg, run_id) == {sid: "SUCCEEDED"}                # one job, and it is the run's result
        assert never_overlapped(marks) and count(marks, "start") == 1, events(marks)
        s = step_status(tmp_path, run_id)
        assert s["status"] == "done" and s["submission_ids"] == [sid]
        assert "after the hold" in (tmp_path / "runs" / run_id / "steps" / "weights" / "log").read_text()
    finally:
        second.kill()
        release_and_end(ray_cfg, run_id, marks)


def test_a_ray_job_that_succeeded_meanwhile_counts_as_done(ray_cfg, tmp_path):
    marks, entry, first = interrupted(tmp_path, ray_cfg)
    run_id, sid = first.run_id, f"{first.run_id}-weights"
    release_and_end(ray_cfg, run_id, marks)
    assert step_jobs(ray_cfg, run_id) == {sid: "SUCCEEDED"}
    second = Launcher(tmp_path, "second", first.printed("follow it:"), entry)
    try:
        assert second.wait() == 0, second.err
        assert "is SUCCEEDED: taking its result" in second.err
        assert step_jobs(ray_cfg, run_id) == {sid: "SUCCEEDED"}
        assert step_status(tmp_path, run_id)["status"] == "done"
    finally:
        second.kill()


def test_restart_running_stops_the_ray_job_before_the_new_one(ray_cfg, tmp_path):
    marks, entry, first = interrupted(tmp_path, ray_cfg, saved=True)
    run_id, sid = first.run_id, f"{first.run_id}-weights"
    second = Launcher(tmp_path, "second", first.printed("restart it:"), entry)
    try:
        wait_for(lambda: count(marks, "start") == 2 or second.ended(), 120,
                 "the step's second job")
        (marks / "hold").unlink()
        assert second.wait() == 0, second.err
        assert step_jobs(ray_cfg, run_id) == {sid: "STOPPED", f"{sid}-r1": "SUCCEEDED"}
        assert never_overlapped(marks), events(marks)
        s = step_status(tmp_path, run_id)
        assert s["status"] == "done" and s["submission_ids"] == [sid, f"{sid}-r1"]
    finally:
        second.kill()
        release_and_end(ray_cfg, run_id, marks)


def test_the_printed_stop_command_stops_the_interrupted_job_and_a_resume_runs_anew(ray_cfg, tmp_path):
    marks, entry, first = interrupted(tmp_path, ray_cfg, saved=True)
    run_id, sid = first.run_id, f"{first.run_id}-weights"
    stop = Launcher(tmp_path, "stop", first.printed("stop it:"), entry)
    assert stop.wait() == 0 and sid in stop.err, stop.err
    wait_for(lambda: step_jobs(ray_cfg, run_id) == {sid: "STOPPED"}, 60, "the job to stop")
    assert step_status(tmp_path, run_id)["status"] == "stopped"
    (marks / "hold").unlink()
    second = Launcher(tmp_path, "second", first.printed("follow it:"), entry)
    try:
        assert second.wait() == 0, second.err
        assert step_jobs(ray_cfg, run_id) == {sid: "STOPPED", f"{sid}-r1": "SUCCEEDED"}
        assert never_overlapped(marks), events(marks)
    finally:
        second.kill()
        release_and_end(ray_cfg, run_id, marks)
