"""A hung training step end to end: `v4 run --preset smoke` on CPU with two gloo ranks, rank 1 planted to sleep before
the loss all-reduce of step 2 (PRESET_PLANT_HANG) while rank 0 waits inside it. The hang watchdog
(launcher/watchdog.py) must take both ranks' stacks into RUN/hang, name rank 1, stop the job and exit 124 -- under the
local executor and as a Ray job on the local Ray cluster the pipeline tests share (conftest.py). Without the watchdog
the same run would wait for PRESET_JOB_TIMEOUT (600 s here) and say nothing of a rank."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow

HANG = ("--set", "V4_NUM_GPUS_PER_NODE=2", "--set", "PRESET_PLANT_HANG=1:2", "--set", "PRESET_HANG_TIMEOUT=12",
        "--set", "PRESET_JOB_TIMEOUT=600", "--set", "PRESET_GATES=finite_loss", "--set", "PRESET_MAX_RESTARTS=0",
        "--set", "PRESET_STEPS=weights prepare_data dequantize convert train")


def v4(flags, *args, timeout=900):
    return subprocess.run([sys.executable, "-m", "launcher", *args, "--hw", "cpu", *flags], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not Path(f"/proc/{pid}/stat").read_text().split(") ")[-1].startswith("Z")


@pytest.mark.parametrize("executor", ["local", "ray"])
def test_a_planted_hang_is_dumped_named_and_stopped(ray_work, executor):
    work, flags = ray_work         # one work directory: the ray run reuses the local run's converted checkpoint
    t0 = time.monotonic()
    r = v4(flags, "run", "--preset", "smoke", "--set", f"V4_EXECUTOR={executor}", *HANG)
    elapsed = time.monotonic() - t0
    assert r.returncode == 124, r.stderr[-4000:]
    run = max((work / "runs").glob("stageA-*"), key=lambda p: p.stat().st_mtime)
    assert "rank 1 did not arrive" in r.stderr and f"{run}/hang/" in r.stderr, r.stderr[-3000:]
    assert "no restart left: PRESET_MAX_RESTARTS=0" in r.stderr      # restarted: test_restart_pipeline.py
    hang = json.loads((run / "hang" / "hang.json").read_text())
    assert hang["behind"] == [1] and hang["missing"] == []
    last = {x["rank"]: (x["step"], x["phase"]) for x in hang["ranks"]}
    assert last == {0: (2, "reduce_losses"), 1: (2, "step")}
    sleeping = (run / "hang" / "rank1.txt").read_text()
    assert "planted_hang" in sleeping and "_reduce_losses" in sleeping, sleeping
    waiting = (run / "hang" / "rank0.txt").read_text()
    assert "all_reduce" in waiting and "planted_hang" not in waiting, waiting
    status = json.loads((run / "steps" / "train" / "status.json").read_text())
    assert status["status"] == "failed" and status["job_status"] == "HUNG" and status["exit_code"] == 124
    assert status["hang"]["behind"] == [1]
    # stopped: neither rank outlives the job (Ray ends a stopped job's actors within seconds)
    pids = [x["pid"] for x in hang["ranks"]]
    deadline = time.monotonic() + 60
    while any(map(pid_alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not any(map(pid_alive, pids)), pids
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert [x["step"] for x in rows] == [1]
    print(f"{executor}: hang declared {hang['stalled_s']} s after the last heartbeat (timeout "
          f"{hang['timeout_s']:g}), stacks in {hang['dump_s']} s; whole run {elapsed:.0f} s")
