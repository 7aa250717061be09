"""A hung training step restarted without a person: `v4 run --preset smoke` on CPU with two gloo ranks under the local
executor, rank 1 planted to sleep before the loss all-reduce of step 2 in the step's first job only
(PRESET_PLANT_HANG=1:2@once). The watchdog stops that job (launcher/watchdog.py); the recovery (launcher/recovery.py)
keeps its stacks, records the restart and runs the step again from its last checkpoint within PRESET_MAX_RESTARTS;
the run passes, each step in metrics.jsonl once, and `v4 runs show` tells the restart. Without the restart the same
run ends with exit 124 (tests/pipeline/test_hang_pipeline.py)."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def v4(*args, timeout=900):
    return subprocess.run([sys.executable, "-m", "launcher", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def test_a_hung_step_is_restarted_from_its_checkpoint(tmp_path):
    flags = ("--hw", "cpu", "--set", f"V4_WORK={tmp_path}", "--set", "V4_EXECUTOR=local")
    t0 = time.monotonic()
    r = v4("run", "--preset", "smoke", *flags, "--set", "V4_NUM_GPUS_PER_NODE=2",
           "--set", "PRESET_PLANT_HANG=1:3@once", "--set", "PRESET_HANG_TIMEOUT=12", "--set", "PRESET_SAVE_INTERVAL=2",
           "--set", "PRESET_MAX_RESTARTS=1", "--set", "PRESET_STEPS=weights prepare_data dequantize convert train")
    elapsed = time.monotonic() - t0
    assert r.returncode == 0, r.stderr[-5000:]
    run = next((tmp_path / "runs").glob("stageA-*"))
    assert "rank 1 did not arrive" in r.stderr
    assert "[recovery] restart 1 (1 of PRESET_MAX_RESTARTS=1 for the run): hung: rank 1 did not arrive" in r.stderr
    assert "[recovery] train resumes from the checkpoint of step 2; no step lost" in r.stderr
    rec = json.loads((run / "run.json").read_text())["recovery"]
    [restart] = rec["restarts"]
    assert restart["cause"] == "hung" and restart["from_step"] == 2 and restart["steps_lost"] == 0
    assert restart["job"] == f"{run.name}-train" and restart["next_job"] == f"{run.name}-train-r1"
    assert restart["noticed_after_s"] >= 12 and rec["left_out"] == []
    # the first job's stacks are kept beside the restart; the second job wrote none (it did not hang)
    kept = Path(restart["stacks"])
    assert kept == run / "restarts" / "1" / "hang" and "planted_hang" in (kept / "rank1.txt").read_text()
    assert not (run / "hang").exists()
    status = json.loads((run / "steps" / "train" / "status.json").read_text())
    assert status["status"] == "done" and status["submission_ids"] == [f"{run.name}-train", f"{run.name}-train-r1"]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in rows] == list(range(1, 7))
    assert [x.get("restarts") for x in rows] == [None, None, 1, 1, 1, 1]       # steps 3-6 ran in the second job
    assert json.loads((run / "summary.json").read_text())["restarts"] == 1
    show = v4("runs", "show", run.name, *flags).stdout
    assert "restarts: 1 of PRESET_MAX_RESTARTS=1 for the run (0 left), 0 step(s) trained twice" in show
    assert "train  hung: rank 1 did not arrive" in show and f"stacks {kept}" in show, show
    print(f"hang -> restart: the run passed in {elapsed:.0f} s; the restart took {restart['restart_s']} s from the "
          f"verdict to the new job ({restart['noticed_after_s']:.1f} s without a heartbeat)")
