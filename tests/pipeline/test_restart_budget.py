"""PRESET_MAX_RESTARTS is the run's, not the launch's (launcher/recovery.py, docs/resilience.md): `v4 run --preset
smoke` on CPU, one rank under the local executor, planted to hang in step 2 of every job of the train step
(PRESET_PLANT_HANG=0:2), one restart allowed. The first launch restarts the step once, hangs again and stops (exit
124). `--resume` used to start the budget afresh and restart it again; now the resumed run says at once that the
budget is spent, runs the step once, and on its hang refuses the restart naming the budget, what spent it and the
`--set` that raises it -- the registry still holds the one restart."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def test_a_resume_does_not_restart_past_the_runs_budget(tmp_path):
    flags = ("--preset", "smoke", "--hw", "cpu", "--set", f"V4_WORK={tmp_path}", "--set", "V4_EXECUTOR=local",
             "--set", "PRESET_PLANT_HANG=0:2", "--set", "PRESET_HANG_TIMEOUT=10", "--set", "PRESET_MAX_RESTARTS=1",
             "--set", "PRESET_GATES=finite_loss",
             "--set", "PRESET_STEPS=weights prepare_data dequantize convert train")
    v4 = lambda *args: subprocess.run([sys.executable, "-m", "launcher", *args], cwd=ROOT, capture_output=True,
                                      text=True, timeout=600)
    t0 = time.monotonic()
    first = v4("run", *flags)
    t1 = time.monotonic()
    assert first.returncode == 124, first.stderr[-4000:]
    run = next((tmp_path / "runs").glob("stageA-*"))
    assert "[recovery] restart 1 (1 of PRESET_MAX_RESTARTS=1 for the run): hung: " in first.stderr
    spent = (f"no restart left: PRESET_MAX_RESTARTS=1 (cli --set PRESET_MAX_RESTARTS) is spent: run {run.name} has "
             "restarted 1 time(s) (1 hung")
    assert spent + "); to allow more, resume it with --set PRESET_MAX_RESTARTS=2 (or more)" in first.stderr

    again = v4("run", *flags, "--resume", run.name)
    t2 = time.monotonic()
    assert again.returncode == 124, again.stderr[-4000:]
    # said before anything runs, and again where the restart is refused
    said = (f"resume: PRESET_MAX_RESTARTS=1 (cli --set PRESET_MAX_RESTARTS) is spent, so a lost node, a hung step or "
            f"a lost rollout engine now ends the run: run {run.name} has restarted 1 time(s) (1 hung; all before this "
            "launch)")
    assert said in again.stderr and again.stderr.index(said) < again.stderr.index("[preflight]"), again.stderr[:2000]
    assert "[recovery] restart" not in again.stderr
    assert spent + "; all before this launch); to allow more, resume it with --set PRESET_MAX_RESTARTS=2" \
        in again.stderr
    assert len(json.loads((run / "run.json").read_text())["recovery"]["restarts"]) == 1
    status = json.loads((run / "steps" / "train" / "status.json").read_text())
    # the first launch's two jobs, the resume's one: no fourth
    assert status["submission_ids"] == [f"{run.name}-train", f"{run.name}-train-r1", f"{run.name}-train-r2"]
    show = v4("runs", "show", run.name, "--hw", "cpu", "--set", f"V4_WORK={tmp_path}").stdout
    assert "restarts: 1 of PRESET_MAX_RESTARTS=1 for the run (0 left)" in show, show
    print(f"\nfirst launch (one restart, then spent) {t1 - t0:.0f} s; the resume, refused at its hang, {t2 - t1:.0f} s")
