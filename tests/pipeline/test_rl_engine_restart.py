"""A rollout engine killed mid-run, end to end: `v4 run --preset rl_smoke` on CPU as a Ray job on the local Ray cluster
the pipeline tests share (conftest.py), the engine a `v4 rl serve` process beside rank 0 (V4_ROLLOUT_ENGINE=server).
Once step 2's row is in metrics.jsonl the test SIGKILLs the server. The job must start it again, push it the current
weights, roll the lost step out again and finish, learning as before, and the run's registry tell the restart
(`v4 runs show`). (Without a restart the kill fails the job naming the lost engine: tests/rl/test_engine_restart.py,
in seconds.)"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow

SAMPLES = 16 * 8        # rl_smoke's prompts x group size: one step's rollout
RUN = ("--preset", "rl_smoke", "--set", "V4_EXECUTOR=ray", "--set", "V4_ROLLOUT_ENGINE=server",
       # five steps (the restart in the third) and two-step gate windows
       "--set", "PRESET_NUM_STEPS=5", "--set", "PRESET_RL_GATE_WINDOW=2", "--set", "PRESET_RL_REWARD_RISE=0.15",
       "--set", "PRESET_RL_SYNC=disk",
       "--set", "PRESET_JOB_TIMEOUT=600", "--json")


def rows(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip().endswith("}")]


def run_and_kill(work: Path, flags, *extra) -> tuple[subprocess.CompletedProcess, Path, int]:
    """Start the run, SIGKILL its rollout server as soon as step 2's row is written; -> (result, run dir, killed pid)."""
    before = set((work / "runs").glob("stageRL-*")) if (work / "runs").is_dir() else set()
    # files, not pipes: nobody reads a pipe while the test polls, and a full one would stop the launcher
    stdout, stderr = (open(work / f"launcher.{name}", "w+") for name in ("out", "err"))
    proc = subprocess.Popen([sys.executable, "-m", "launcher", "run", *RUN, *extra, "--hw", "cpu", *flags, "--force"],
                            cwd=ROOT, stdout=stdout, stderr=stderr, text=True)
    killed, run = 0, None
    try:
        deadline = time.monotonic() + 600
        while not killed and proc.poll() is None and time.monotonic() < deadline:
            new = set((work / "runs").glob("stageRL-*")) - before if (work / "runs").is_dir() else set()
            run = next(iter(new), None)
            if run is not None and any(r["step"] == 2 for r in rows(run)):
                info = json.loads((run / "steps" / "train" / "rollout_server.json").read_text())
                os.kill(info["pid"], signal.SIGKILL)
                killed = info["pid"]
            time.sleep(0.01)
        proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
        out, err = (f.seek(0) or f.read() for f in (stdout, stderr))
        stdout.close()
        stderr.close()
    assert killed, f"the run never wrote step 2's row: {err[-3000:]}"
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), run, killed


def test_a_killed_rollout_server_is_restarted_and_the_run_goes_on(ray_work):
    work, flags = ray_work
    r, run, killed = run_and_kill(work, flags)
    assert r.returncode == 0, r.stderr[-4000:]
    summary = json.loads(r.stdout)
    assert all(g["passed"] for g in json.loads((run / "gates.json").read_text())), r.stderr[-2000:]
    got = rows(run)
    assert [m["step"] for m in got] == [1, 2, 3, 4, 5]
    restarts = [json.loads(line) for line in (run / "steps/train/rollout_restarts.jsonl").read_text().splitlines()]
    assert len(restarts) == 1 and restarts[0]["step"] == 3, restarts
    rec = restarts[0]
    assert "cannot reach the engine" in rec["cause"] and rec["seconds"] > 0 and rec["attempt"] == 0
    print(f"\nengine lost during step 3's {rec['phase']}; back with the current weights in {rec['seconds']:.2f} s; "
          f"step 3 took {got[2]['step_time_s']:.2f} s, the others {[round(m['step_time_s'], 2) for m in got]}")
    print("\n".join(line for line in r.stderr.splitlines() if " done in " in line or "healthy" in line))
    by_step = {m["step"]: m for m in got}
    assert by_step[3]["rollout_restarts"] == 1
    # a loss during the rollout regenerates the whole step; one during the sync loses no sample
    assert by_step[3]["rollout_regenerated_samples"] == (SAMPLES if rec["phase"] == "rollout" else 0)
    assert all(by_step[s]["rollout_restarts"] == 0 and by_step[s]["rollout_regenerated_samples"] == 0
               for s in (1, 2, 4, 5))
    server = json.loads((run / "steps/train/rollout_server.json").read_text())
    assert server["starts"] == 2 and server["pid"] != killed
    for m in got:
        # the new engine holds the trainer's weights: its rollouts score as the trainer scores them
        assert m["weights_synced"] is True and m["weight_version"] == str(m["step"])
        assert m["logprob_diff_max"] == m["logprob_diff_max"] and m["logprob_diff_max"] <= 1e-4, m
        assert m["loss"] == m["loss"] and m["reward_mean"] == m["reward_mean"]
    first, last = (sum(m["reward_mean"] for m in got[i:i + 2]) / 2 for i in (0, 3))
    assert last >= first + 0.15, [m["reward_mean"] for m in got]
    assert "restarting it" in r.stderr and summary["reward_last"] > summary["reward_first"]
    # the registry tells it beside the trainer's restarts: the summary, `runs show` and its --json
    regenerated = SAMPLES if rec["phase"] == "rollout" else 0
    assert (summary["restarts"], summary["engine_restarts"], summary["samples_regenerated"]) == (0, 1, regenerated)
    assert f"1 rollout engine(s) restarted ({regenerated} sample(s) rolled out again)" in r.stderr
    show = subprocess.run([sys.executable, "-m", "launcher", "runs", "show", run.name, "--hw", "cpu", *flags], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert (f"restarts: 1 of PRESET_MAX_RESTARTS=2 for the run (1 left), 0 step(s) trained twice, 1 of the rollout "
            f"engine ({regenerated} sample(s) rolled out again)") in show.stdout, show.stdout + show.stderr
    assert f"train step 3  rollout engine lost during {rec['phase']}: " in show.stdout, show.stdout
    assert f"back in {rec['seconds']:.1f} s with the current weights" in show.stdout
    assert f"; job {run.name}-train" in show.stdout
    shown = json.loads(subprocess.run([sys.executable, "-m", "launcher", "runs", "show", run.name, "--json", "--hw",
                                       "cpu", *flags], cwd=ROOT, capture_output=True, text=True, timeout=120).stdout)
    [engine] = shown["recovery"]["engine_restarts"]
    assert (engine["step"], engine["samples"], engine["job"]) == (3, regenerated, f"{run.name}-train")
    assert (shown["recovery"]["restarts_spent"], shown["recovery"]["restarts_left"]) == (1, 1)

