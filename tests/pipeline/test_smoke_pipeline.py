"""The main job end to end on the embedded default: local Ray, CPU, the tiny model.

`v4 run --preset smoke` runs every step as a real Ray job (generate an official-layout checkpoint ->
dequantize -> convert to a megatron distributed checkpoint -> SFT with save/reload check), then the
gates. The runs share one work directory, so later runs reuse the artifacts of the first (sentinels)
and only re-train, which is what a user re-running a command gets too.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def v4(work: Path, *args, timeout=900, **popen):
    cmd = [sys.executable, "-m", "launcher", *args, "--hw", "cpu", "--set", f"V4_WORK={work}"]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, **popen)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    work = tmp_path_factory.mktemp("smoke")
    yield work
    r = v4(work, "cluster", "down", timeout=300)
    print(r.stdout, r.stderr)


def run_dirs(work: Path) -> list[Path]:
    return sorted((work / "runs").glob("stageA-*"), key=lambda p: p.stat().st_mtime)


def metrics(run: Path) -> list[dict]:
    return [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines() if l.strip()]


def test_smoke_passes_its_gates(work):
    r = v4(work, "run", "--preset", "smoke", "--json")
    assert r.returncode == 0, r.stderr[-4000:]
    summary = json.loads(r.stdout)
    run = Path(summary["run_dir"])
    gates = {g["name"]: g for g in json.loads((run / "gates.json").read_text())}
    assert set(gates) == {"finite_loss", "loss_decreasing", "reload_equal"}
    assert all(g["passed"] for g in gates.values()), gates
    reload = json.loads((run / "steps/train/reload_check.json").read_text())
    assert reload["loss_continued"] == reload["loss_reloaded"]
    rows = metrics(run)
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert all(x == x and abs(x) != float("inf") for r in rows for x in (r["loss"], r["grad_norm"]))
    assert "PASSED" in r.stderr and "next:" in r.stderr
    # the stage is recorded, so dryrun's stage-order check would accept this cluster/hw
    stages = json.loads((work / "runs/stages.json").read_text())
    assert stages["local/cpu"]["smoke"]["run_id"] == summary["run_id"]
    # the train step (a Ray job here) leaves its curves and TensorBoard events in the run
    assert (run / "plots/metrics.png").stat().st_size > 10_000 and list((run / "tb").glob("events.out.tfevents.*"))


def test_cp_smoke_runs_two_context_parallel_ranks_after_the_smoke(work):
    """cp_smoke requires the smoke stage (passed above): on CPU the tiny model over CP 2 as two gloo ranks (two
    Ray actors sharing the CPU Ray has left beside the step's driver), with the reload check."""
    r = v4(work, "run", "--preset", "cp_smoke", "--json")
    assert r.returncode == 0, r.stderr[-4000:]
    run = Path(json.loads(r.stdout)["run_dir"])
    config = json.loads((run / "config.json").read_text())["values"]
    assert config["PRESET_CP"] == 2 and config["WORLD_SIZE"] == 2
    gates = json.loads((run / "gates.json").read_text())
    assert [g["name"] for g in gates] == ["finite_loss"] and all(g["passed"] for g in gates)
    rows = metrics(run)
    assert [r["step"] for r in rows] == list(range(1, 6)) and all(r["world"] == 2 for r in rows)
    assert all(x == x and abs(x) != float("inf") for r in rows for x in (r["loss"], r["grad_norm"]))
    reload = json.loads((run / "steps/train/reload_check.json").read_text())
    assert reload["loss_continued"] == reload["loss_reloaded"]
    assert "CP=2" in r.stderr


def test_planted_nan_stops_with_16_naming_the_module(work):
    r = v4(work, "run", "--preset", "smoke", "--set", "PRESET_PLANT_NAN=layers.1.attn:2")
    assert r.returncode == 16, r.stderr[-4000:]
    assert "layers.1.attn" in r.stderr and "step 2" in r.stderr
    nf = json.loads((run_dirs(work)[-1] / "steps/train/nonfinite.json").read_text())
    assert nf["module"].startswith("layers.1.attn") and nf["step"] == 2


def test_resume_after_the_train_step_is_killed_midway(work):
    proc = subprocess.Popen([sys.executable, "-m", "launcher", "run", "--preset", "smoke", "--hw", "cpu",
                             "--set", f"V4_WORK={work}", "--set", "PRESET_NUM_STEPS=8",
                             "--set", "PRESET_SAVE_INTERVAL=2"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    before = set(run_dirs(work))
    deadline = time.time() + 600
    run = None
    # stopped once step 3 is in: a step takes under a second here, and the stop (a `v4 runs stop`, then Ray's) takes
    # a few, in which the job goes on; step 5 left the 8-step run finishing before it on a loaded machine
    while time.time() < deadline:
        new = [d for d in run_dirs(work) if d not in before]
        if new and (new[-1] / "metrics.jsonl").is_file() and len(metrics(new[-1])) >= 3:
            run = new[-1]
            break
        time.sleep(0.2)
    assert run is not None, "train step never reached step 3"
    stop = v4(work, "runs", "stop", run.name, timeout=120)   # stops the Ray job of the running step
    assert stop.returncode == 0, stop.stderr
    out, err = proc.communicate(timeout=300)
    assert proc.returncode != 0, err[-3000:]
    killed_at = len(metrics(run))
    assert killed_at < 8, "the run ended before the stop"
    r = v4(work, "run", "--preset", "smoke", "--resume", run.name,
           "--set", "PRESET_NUM_STEPS=8", "--set", "PRESET_SAVE_INTERVAL=2")
    assert r.returncode == 0, r.stderr[-4000:]
    steps = [m["step"] for m in metrics(run)]
    assert steps == list(range(1, 9)), steps                 # each step once: rows the resume ran again superseded
    # resumed from the last checkpoint (an even step), not from step 1: the resumed job's first step, where the rows
    # of the first job past its checkpoint were superseded (none when it was stopped right after a save)
    again = [json.loads(x) for x in (run / "metrics.superseded.jsonl").read_text().splitlines()] \
        if (run / "metrics.superseded.jsonl").is_file() else []
    resumed = again[0]["resumed_at_step"] if again else killed_at + 1
    assert [x.get("step") for x in again] == list(range(resumed, killed_at + 1)), (again, killed_at)
    assert resumed > 1 and resumed % 2 == 1, (resumed, killed_at)
