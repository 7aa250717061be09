"""The staged NaN bisect end to end on CPU: `v4 run --preset smoke` with a fault planted under a condition stops
with exit 16 and keeps its capture; `v4 nan bisect RUN` replays the step from it and names the switch that cures
it. The faults are planted (dsv4/megatron/nanwatch.py PlantSpec) because a real one cannot be summoned on demand;
what finds them (the replay job, the forensics hooks, the ladder) is the real code on real megatron-core runs.
The TileLang-only fault needs a GPU (tests/pipeline/test_nan_bisect_gpu.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dsv4.megatron.nanwatch import PlantSpec

ROOT = Path(__file__).resolve().parents[2]


def v4(work: Path, *args, timeout=600):
    cmd = [sys.executable, "-m", "launcher", *args, "--hw", "cpu", "--set", f"V4_WORK={work}"]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=dict(os.environ))


def planted_run(work: Path, plant: str, *sets: str) -> Path:
    """A smoke run that dies of `plant` at step 3 -> its directory."""
    args = ["run", "--preset", "smoke", "--force", "--json", "--set", "V4_EXECUTOR=local",
            "--set", f"PRESET_PLANT_NAN={plant}"]
    for s in sets:
        args += ["--set", s]
    r = v4(work, *args)
    assert r.returncode == 16, r.stderr[-3000:]
    assert "v4 nan bisect stageA-" in r.stderr                # the failure names the next command
    failure = json.loads(r.stdout)                             # and --json says so on stdout
    assert failure["status"] == "failed" and failure["exit_code"] == 16 and failure["steps"]["train"] == "failed"
    run = Path(failure["run_dir"])
    cap = json.loads((run / "steps/train/nan_capture.json").read_text())
    assert cap["step"] == 3 and Path(cap["checkpoint"]).name == "iter_0000002"
    return run


def bisect(work: Path, run: Path, *flags: str):
    r = v4(work, "nan", "bisect", run.name, "--json", *flags)
    report = json.loads(r.stdout) if r.stdout.strip() else None
    return r, report


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("nan")


def test_plant_spec_conditions():
    p = PlantSpec.parse("layers.1.attn:3:backward@impl=tilelang,tp>1")
    assert (p.module, p.step, p.phase, p.when) == ("layers.1.attn", 3, "backward", ("impl=tilelang", "tp>1"))
    facts = {"impl": "tilelang", "fp8": False, "bf16": True, "recompute": False, "tp": 2, "ep": 1, "pp": 1, "world": 2}
    assert p.holds(facts) and not p.holds({**facts, "tp": 1}) and not p.holds({**facts, "impl": "torch"})
    assert PlantSpec.parse("embed:1@token=77").token == 77
    for bad in ("layers.1.attn", "layers.1.attn:x", "layers.1.attn:3:sideways", "layers.1.attn:3@gpu"):
        with pytest.raises(ValueError, match="MODULE:STEP"):
            PlantSpec.parse(bad)


def test_layout_1_is_left_out_when_one_gpu_cannot_hold_the_model():
    from launcher.config import Selection, resolve
    from launcher.nanbisect import candidates
    cfg = dict(resolve(Selection(preset="smoke", hw="h200", sets=("PRESET_MODEL_OVERRIDES=n_routed_experts=8",
                                                                   "V4_NUM_GPUS_PER_NODE=2", "PRESET_EP=2"))).values,
               WORLD_SIZE=2)
    left: dict = {}
    assert "layout_1" in candidates(cfg, {}, {"rows_by_dp_rank": {"0": ["a"]}}, left) and not left
    cfg["PRESET_MODEL_OVERRIDES"] = []                             # all 256 experts: ~570 GB of state
    assert "layout_1" not in candidates(cfg, {}, {"rows_by_dp_rank": {"0": ["a"]}}, left)
    assert "one device cannot hold the model's" in left["layout_1"] and "no forward fault" in left["layout_1"]
    # a forward fault in layer 1 of 4: layers 0..1 of the 256-expert model still outgrow an H200; with 2 TB they fit
    fwd = {"forward": {"module": "layers.1.attn"}}
    left, plan = {}, {}
    assert "layout_1" not in candidates(cfg, fwd, {"rows_by_dp_rank": {"0": ["a"]}}, left, None, plan)
    assert "nor its layers 0..1" in left["layout_1"] and not plan
    left = {}
    assert "layout_1" in candidates(cfg, fwd, {"rows_by_dp_rank": {"0": ["a"]}}, left, 400.0, plan) and not left
    assert plan == {"cut_layers": 2}


@pytest.mark.slow
def test_the_ladder_names_fp32_for_a_bf16_fault(captured):
    work, run = captured
    r, report = bisect(work, run)
    assert r.returncode == 0, r.stderr[-3000:]
    check_report(run, report, BF16_FAULT, "fp32")


@pytest.mark.slow
def test_the_ladder_names_layout_1_for_a_fault_under_tp2(work):
    plant = "layers.2.ffn.shared_experts.w2:3:backward@tp>1"
    run = planted_run(work, plant, "V4_NUM_GPUS_PER_NODE=2", "PRESET_TP=2", "PRESET_EP=1")
    r, report = bisect(work, run)
    assert r.returncode == 0, r.stderr[-3000:]
    check_report(run, report, plant, "layout_1")


def check_report(run: Path, report: dict, plant: str, culprit: str) -> None:
    """The verdict names `culprit` alone, the forensics the planted module, every rung replayed the captured data."""
    assert report["reproduced"] and report["culprit"] == [culprit], report["verdict"]
    assert f"culprit: {culprit}" in report["verdict"]
    module = plant.split(":")[0]
    phase = "backward" if ":backward" in plant else "forward"
    ev = report["forensics"][phase]
    assert ev["module"] == module and ev["micro_batch"] == 0
    if phase == "forward":
        assert ev["kind"] == "output" and ev["output"]["nan"] > 0
        assert all(d["bad"] == 0 for d in ev["inputs"])        # the module made the NaN: its inputs were finite
    rungs = {g["name"]: g for g in report["rungs"]}
    assert rungs["reproduce"]["finite"] is False and rungs[culprit]["finite"] is True
    assert all(g["result"]["data_matches_capture"] for g in rungs.values())
    assert (run / "nan-bisect" / "report.md").read_text().startswith(f"# NaN bisect of {run.name}, step 3")


@pytest.mark.slow
def test_the_one_process_rung_cuts_the_model_that_outgrows_a_device(work):
    """A forward fault in layer 1 under TP2; the device is said to hold 0.023 GB, less than the tiny model's
    0.033 GB of state but more than its layers 0..1's 0.020: the one-process rung keeps those two layers, and
    that cures it."""
    run = planted_run(work, "layers.1.attn:3@tp>1", "V4_NUM_GPUS_PER_NODE=2", "PRESET_TP=2", "PRESET_EP=1")
    r = v4(work, "nan", "bisect", run.name, "--json", "--device-memory-gb", "0.023")
    report = json.loads(r.stdout)
    assert r.returncode == 0, r.stderr[-3000:]
    assert report["culprit"] == ["layout_1"] and report["cut_layers"] == 2, report["verdict"]
    assert "cut to layers 0..1" in report["verdict"]
    rungs = {g["name"]: g for g in report["rungs"]}
    assert rungs["layout_1"]["finite"] is True and rungs["layout_1"]["result"]["model"]["n_layers"] == 2
    assert rungs["reproduce"]["result"]["model"]["n_layers"] == 4
    assert rungs["layout_1"]["result"]["data_matches_capture"]


@pytest.mark.slow
def test_a_poisoned_sample_is_named_and_reproduces_alone(work):
    """The fault fires only on rows holding one token: the ladder finds the row, removing it cures, alone it fails.
    The token comes from the step's batch, which any smoke run of this module rebuilds (the same data and seed): an
    earlier test's run, or one made here."""
    earlier = sorted((work / "runs").glob("stageA-*/steps/train/nan_capture.json")) if (work / "runs").is_dir() else []
    clean = earlier[0].parents[2] if earlier else planted_run(work, "layers.1.attn:3@fp8",
                                                             "PRESET_MODEL_OVERRIDES=fp8_gemm_inputs=1")
    token, row = _token_in_one_row(clean)
    run = planted_run(work, f"layers.1.attn:3@token={token}")
    r, report = bisect(work, run)
    assert r.returncode == 0, r.stderr[-3000:]
    assert report["culprit"] == ["sample"] and report["sample"]["global_row"] == row
    assert report["sample"]["alone_reproduces"] is True
    assert f"the sample at row {row} of step 3" in report["verdict"]


@pytest.mark.slow
def test_a_fault_no_switch_cures_one_that_does_not_replay_and_a_run_without_a_capture(work):
    run = planted_run(work, "layers.1.attn:3")
    r, report = bisect(work, run)
    assert r.returncode == 1 and report["reproduced"] and not report["culprit"]
    assert "no switch cures it" in report["verdict"]
    # the same capture without the fault: the replay is finite, and the report says it could not reproduce
    cfg_path = run / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["values"]["PRESET_PLANT_NAN"] = ""
    cfg_path.write_text(json.dumps(cfg))
    r, report = bisect(work, run)
    assert r.returncode == 1 and not report["reproduced"] and report["verdict"].startswith("not reproduced")
    # and without its capture there is nothing to replay: a usage error
    (run / "steps/train/nan_capture.json").unlink()
    r, _ = bisect(work, run)
    assert r.returncode == 2 and "nan_capture.json not found" in r.stderr


def _token_in_one_row(run: Path) -> tuple[int, int]:
    """A token that occurs in exactly one row of the captured step (the step's batch as the replay rebuilds it)."""
    from jobs.common import RunContext
    from jobs.train_sft import DATA_SEED_OFFSET, SFTData, tokenizer_dirs
    cfg = RunContext.load(run).cfg
    data = SFTData(str(RunContext.load(run).paths.sft_data), tokenizer_dirs(cfg), cfg["PRESET_SEQ_LEN"],
                   cfg["PRESET_SEED"] + DATA_SEED_OFFSET)
    batch = next(data.step_batches(cfg["PRESET_GLOBAL_BATCH_SIZE"])(0, 1, 2))
    ids = batch["tokens"][:, :-1]
    for t in ids.flatten().unique().tolist():
        rows = (ids == t).any(-1).nonzero().flatten().tolist()
        if len(rows) == 1:
            return int(t), rows[0]
    pytest.skip("no token occurs in exactly one row of step 3")


@pytest.mark.slow
def test_rungs_run_as_ray_jobs_under_the_ray_executor(ray_work):
    """The run's own executor: the train step a Ray job on the local Ray cluster (the pipeline tests' shared one,
    conftest.py; a work directory of this test's own), and so is every rung; the fault is one that only FP8 GEMM
    inputs set off, so the FP8 rung is the culprit."""
    work, flags = ray_work
    r = v4(work, "run", "--preset", "smoke", "--force", "--set", "PRESET_PLANT_NAN=layers.1.attn:3@fp8",
           "--set", "PRESET_MODEL_OVERRIDES=fp8_gemm_inputs=1", *flags)
    assert r.returncode == 16, r.stderr[-3000:]
    run = max((work / "runs").glob("stageA-*"), key=lambda p: p.stat().st_mtime)
    r, report = bisect(work, run, *flags)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "rungs as Ray jobs on the cluster" in r.stderr
    check_report(run, report, "layers.1.attn:3@fp8", "fp8_off")
    log = (run / "nan-bisect/rungs/fp8_off/log").read_text()
    assert "nan replay: step 3" in log


@pytest.mark.slow
def test_two_faults_need_two_switches_together(work):
    """One fault under FP8, another under bf16: no switch cures alone, all together do, and delta-debugging drops
    the one that does not matter (the sample) and keeps the two that do."""
    run = planted_run(work, "layers.1.attn:3@fp8;layers.2.ffn:3@bf16",
                      "PRESET_MODEL_OVERRIDES=fp8_gemm_inputs=1 dtype=bf16")
    r, report = bisect(work, run)
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(report["culprit"]) == ["fp32", "fp8_off"] and report["joint"], report["verdict"]
    assert report["verdict"].startswith("culprit: only together: ")
    rungs = {g["name"]: g["finite"] for g in report["rungs"]}
    assert rungs["fp8_off"] is False and rungs["fp32"] is False and rungs["all"] is True
    assert rungs["without_sample"] is True and rungs["without_fp8_off"] is False and rungs["without_fp32"] is False


BF16_FAULT = "layers.1.ffn:3@bf16"


@pytest.fixture(scope="module")
def captured(work):
    """A bf16 fault at step 3: the work directory and the run directory, shared by the tests below (each puts back
    what it edits: the capture, the data file, a checkpoint shard). Its metrics.jsonl is the SFT loop's own, and
    every line of it a row of the schema `v4 runs compare` reads."""
    from launcher import metrics
    run = planted_run(work, BF16_FAULT, "PRESET_MODEL_OVERRIDES=dtype=bf16")
    got = metrics.read(run)
    assert not got.bad and got.steps == [1, 2] and set(got.rows[0]) <= set(metrics.MetricsRow.model_fields)
    return work, run


def _reports(run: Path, pattern: str = "*") -> dict[str, bytes]:
    """The files matching `pattern` an earlier bisect of `run` left (none where there was none), with their bytes."""
    return {str(p.relative_to(run)): p.read_bytes() for p in (run / "nan-bisect").rglob(pattern) if p.is_file()}


@pytest.mark.slow
def test_a_capture_that_is_not_one_is_a_usage_error(captured):
    work, run = captured
    cap = run / "steps/train/nan_capture.json"
    good = cap.read_bytes()
    before = _reports(run)
    try:
        for text, says in ((good[:100], "is not a JSON capture ("),
                           (b"\xff" + good, "is not a JSON capture ('utf-8' codec can't decode byte 0xff"),
                           (json.dumps({**json.loads(good), "step": "3", "micro_batch_size": 0}).encode(),
                            "is not a valid capture: step: input should be a valid integer; micro_batch_size: input "
                            "should be greater than or equal to 1"),
                           (json.dumps({**json.loads(good), "rows_by_dp_rank": {"1": ["a"]}}).encode(),
                            "is not a valid capture: rows_by_dp_rank's keys must be the data-parallel "
                            "ranks 0..0, got 1")):
            cap.write_bytes(text)
            r, report = bisect(work, run)
            assert r.returncode == 2 and report is None and "Traceback" not in r.stderr, r.stderr
            assert f"error: {cap} {says}" in r.stderr, r.stderr
            assert _reports(run) == before                           # refused before any rung
    finally:
        cap.write_bytes(good)


@pytest.mark.slow
def test_changed_data_is_refused_unless_allowed_and_then_reported(captured):
    work, run = captured
    data = Path(json.loads((run / "config.json").read_text())["values"]["V4_SFT_DATA"])
    good = data.read_text()
    before = _reports(run, "report.*")
    try:
        data.write_text(good.replace('"content": "What', '"content": "So what'))      # every row of step 3
        r, report = bisect(work, run)
        assert r.returncode == 2 and report["verdict"].startswith("refused: "), r.stderr[-3000:]
        assert report["data_changed_rows"] == list(range(8)) and not report["culprit"]
        assert ("error: 8 of step 3's 8 rows, rows 0-7 (by data-parallel rank, rank 0: 0-7), are not the rows the "
                f"run trained on (their hashes differ from the capture's): {data} changed since the run") in r.stderr
        assert "--allow-changed-data" in r.stderr
        assert _reports(run, "report.*") == before         # the reproduce rung ran; the earlier report stays
        r = v4(work, "nan", "bisect", run.name, "--json", "--allow-changed-data")
        report = json.loads(r.stdout)
        assert r.returncode == 0 and report["culprit"] == ["fp32"] and report["allowed_changed_data"], r.stderr
        assert "(on changed data: 8 of step 3's 8 rows" in report["verdict"]
        md = (run / "nan-bisect/report.md").read_text()
        assert "## The data changed since the capture" in md and "rows [0, 1, 2, 3, 4, 5, 6, 7]" in md
        assert "went on with `--allow-changed-data`" in md
    finally:
        data.write_text(good)


@pytest.mark.slow
def test_a_truncated_checkpoint_keeps_the_earlier_report(captured):
    from launcher import nanbisect
    work, run = captured
    out = run / "nan-bisect"
    earlier = nanbisect.Report(run.name, 3, True, "culprit: fp32: bf16 precision (replayed in fp32)", ["fp32"],
                               replayed=True, exit_code=0)
    _, md = nanbisect.write_report(earlier, out)
    before = md.read_bytes()
    cap = json.loads((run / "steps/train/nan_capture.json").read_text())
    (shard,) = Path(cap["checkpoint"]).glob("*.distcp")
    whole = shard.read_bytes()
    try:
        shard.write_bytes(whole[:1 << 20])               # the model's weights come first: cut into them
        r, report = bisect(work, run)
        assert r.returncode == 1 and not report["replayed"], r.stderr[-3000:]
        assert report["verdict"].startswith("could not replay the step: exit 1: ") and "cannot be read" in \
            report["verdict"]
        assert f"the earlier report is kept: {md}" in r.stderr
        assert md.read_bytes() == before and json.loads((out / "report.json").read_text())["culprit"] == ["fp32"]
    finally:
        shard.write_bytes(whole)
