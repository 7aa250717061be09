"""`v4 runs compare` and `v4 runs plot` on run directories with real metrics files, and the TensorBoard events a
run writes, read back with TensorBoard's own reader."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jobs.common import RunContext

ROOT = Path(__file__).resolve().parents[2]


def make_run(work: Path, run_id: str, losses, tp: int = 1) -> Path:
    d = work / "runs" / run_id
    d.mkdir(parents=True)
    (d / "run.json").write_text(json.dumps({"id": run_id, "status": "passed"}))
    (d / "config.json").write_text(json.dumps({"values": {"PRESET_TP": tp, "PRESET_SEED": 1234}}))
    rows = [{"step": i + 1, "loss": l, "grad_norm": 2.0 / (i + 1), "lr": 1e-3, "tokens_per_s": 900.0 + i,
             "peak_mem_gb": 0.7} for i, l in enumerate(losses)]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d


def v4(work: Path, *args):
    return subprocess.run([sys.executable, "-m", "launcher", *args, "--set", f"V4_WORK={work}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


LOSS = [6.98, 5.51, 5.46, 4.35, 3.72, 3.39]


def test_compare_says_identical_within_or_diverged_from_step_k(tmp_path):
    make_run(tmp_path, "stageA-a", LOSS)
    make_run(tmp_path, "stageA-b", LOSS)
    make_run(tmp_path, "stageA-c", LOSS[:3] + [4.35 * (1 + 1e-7)] + LOSS[4:], tp=2)
    make_run(tmp_path, "stageA-d", LOSS[:3] + [4.50, 3.80, 3.41])
    r = v4(tmp_path, "runs", "compare", "stageA-a", "stageA-b", "--json")
    out = json.loads(r.stdout)
    assert r.returncode == 0 and out["ok"] and {v["verdict"] for v in out["verdicts"]} == {"identical"}
    r = v4(tmp_path, "runs", "compare", "stageA-a", "stageA-c")
    assert r.returncode == 1 and "step 4: 4.35 vs 4.350000435" in r.stdout and "PRESET_TP=1" in r.stdout
    assert v4(tmp_path, "runs", "compare", "stageA-a", "stageA-c", "--tol", "1e-6").returncode == 0
    r = v4(tmp_path, "runs", "compare", "stageA-a", "stageA-b", "stageA-d", "--json")
    verdicts = {(v["run"], v["metric"]): v for v in json.loads(r.stdout)["verdicts"]}
    assert r.returncode == 1 and verdicts[("stageA-d", "loss")]["first_diverged"] == 4
    assert verdicts[("stageA-d", "grad_norm")]["verdict"] == "identical"
    assert v4(tmp_path, "runs", "compare", "stageA-a").returncode == 2


def test_plot_draws_every_run(tmp_path):
    import matplotlib.image as mpimg
    make_run(tmp_path, "stageA-a", LOSS)
    make_run(tmp_path, "stageA-b", [x * 1.1 for x in LOSS], tp=2)
    png = tmp_path / "cmp.png"
    r = v4(tmp_path, "runs", "plot", "stageA-a", "stageA-b", "-o", str(png))
    assert r.returncode == 0, r.stderr
    img = mpimg.imread(png)[..., :3]                                       # a valid PNG, decoded
    h, w, _ = img.shape
    assert h > 300 and w > 600
    # pixels of matplotlib's first two line colours (C0 blue, C1 orange): both runs are drawn, not a blank canvas
    for rgb in ((0.122, 0.467, 0.706), (1.0, 0.498, 0.055)):
        assert (np.abs(img - np.array(rgb)).max(-1) < 0.05).sum() > 200, rgb
    assert (img.min(-1) < 0.9).mean() > 0.02                               # ink beyond the axes frames


def test_metrics_rows_become_tensorboard_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    (tmp_path / "config.json").write_text(json.dumps({"values": {"V4_SOCKET_IFNAME": ""}}))
    ctx = RunContext.load(tmp_path)
    for step, loss in enumerate(LOSS, 1):
        ctx.write_metrics({"step": step, "loss": loss, "grad_norm": 1.0 / step, "note": "text is skipped"})
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == {"loss", "grad_norm"}
    events = acc.Scalars("loss")
    assert [e.step for e in events] == [1, 2, 3, 4, 5, 6]
    assert [round(e.value, 5) for e in events] == LOSS


def _wandb_history(run_file: Path) -> list[dict]:
    """The history rows of an offline W&B run file, read with W&B's own protobuf classes. The file is a
    LevelDB-style log: a 7-byte header (":W&B", magic 0xBEE1, version), then 32 KiB blocks of records, each a
    7-byte header (crc32, length, type: 1 full, 2 first, 3 middle, 4 last) and its bytes; a block's last 6
    bytes or fewer are padding."""
    import struct

    from wandb.proto import wandb_internal_pb2 as pb
    raw = run_file.read_bytes()
    assert raw[:4] == b":W&B"
    pos, rows, parts = 7, [], b""
    while pos + 7 <= len(raw):
        if 32768 - pos % 32768 < 7:                   # block padding
            pos += 32768 - pos % 32768
            continue
        _, n, kind = struct.unpack_from("<IHB", raw, pos)
        parts += raw[pos + 7:pos + 7 + n]
        pos += 7 + n
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(parts)
            parts = b""
            if rec.WhichOneof("record_type") == "history":
                rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
                            | {"_step": rec.history.step.num})
    return rows


def test_metrics_rows_go_to_wandb_offline(tmp_path):
    """V4_WANDB_PROJECT set, offline mode: each row becomes a W&B history step under RUN/wandb (no network)."""
    run = tmp_path / "stageA-wb"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"values": {
        "V4_SOCKET_IFNAME": "", "V4_WANDB_PROJECT": "v4-test", "V4_WANDB_MODE": "offline", "PRESET_LR": 0.1}}))
    ctx = RunContext.load(run)
    for step, loss in enumerate(LOSS, 1):
        ctx.write_metrics({"step": step, "loss": loss, "note": "text is skipped"})
    import wandb
    ctx._wandb().finish()
    wandb.teardown()          # waits for W&B's service to exit: finish() can return before it has written the file
    (run_file,) = run.glob("wandb/offline-run-*-stageA-wb/run-stageA-wb.wandb")
    rows = _wandb_history(run_file)
    assert [r["_step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert [round(r["loss"], 5) for r in rows] == LOSS and all("note" not in r for r in rows)


def test_benchmark_records_plot_across_commits(tmp_path):
    """The shipped kernel records parse, and a benchmark's TFLOP/s across them makes a non-blank PNG."""
    import matplotlib.image as mpimg
    from launcher import compare
    records = compare.read_records(ROOT / "benchmarks/records/kernels.jsonl")
    assert len(records) > 20 and all({"date", "benchmark", "metrics"} <= set(r) for r in records)
    png = tmp_path / "rec.png"
    r = v4(tmp_path, "runs", "plot", "--records", str(ROOT / "benchmarks/records/kernels.jsonl"),
           "--benchmark", "sparse_attn_fwd_flash", "-o", str(png))
    assert r.returncode == 0, r.stderr
    img = mpimg.imread(png)[..., :3]
    assert (np.abs(img - np.array((0.122, 0.467, 0.706))).max(-1) < 0.05).sum() > 200
    r = v4(tmp_path, "runs", "plot", "--records", str(ROOT / "benchmarks/records/kernels.jsonl"),
           "--benchmark", "nope", "-o", str(png))
    assert r.returncode == 2 and "benchmarks with tflops: " in r.stderr


def _bad_lines(run: Path) -> None:
    """What a killed job, a disk error and a hand edit leave: a cut line, bytes that are not UTF-8, a row whose
    step is a string, and one whose loss is."""
    with open(run / "metrics.jsonl", "ab") as f:
        f.write(b'{"step": 7, "loss": 3.1\n\xff\xfe{"step": 8}\n'
                b'{"step": "9", "loss": 1.0}\n{"step": 9, "loss": "low"}\n')


def test_compare_fails_where_a_run_lacks_steps_unless_steps_names_them(tmp_path):
    make_run(tmp_path, "stageA-a", LOSS)
    make_run(tmp_path, "stageA-one", LOSS[:1])
    r = v4(tmp_path, "runs", "compare", "stageA-a", "stageA-one")
    assert r.returncode == 1 and "verdict: DIFFERENT over steps 1-6" in r.stderr, r.stderr
    assert "stageA-one has no row for steps 2-6 (it has 1 step: 1; compared: 1-6)" in r.stderr
    # the same with the shorter run as the reference, and as JSON for scripts
    r = v4(tmp_path, "runs", "compare", "stageA-one", "stageA-a", "--json")
    out = json.loads(r.stdout)
    assert r.returncode == 1 and not out["ok"] and out["steps"] == "1-6" and out["n_steps"] == 6
    assert [(p["kind"], p["run"]) for p in out["problems"]] == [("missing_steps", "stageA-one")]
    # asked for: the steps both have, or a range both cover
    for steps in ("1", "common"):
        r = v4(tmp_path, "runs", "compare", "stageA-a", "stageA-one", "--steps", steps)
        assert r.returncode == 0 and "verdict: same over steps 1" in r.stderr, r.stderr
    r = v4(tmp_path, "runs", "compare", "stageA-a", "stageA-one", "--steps", "1-3")
    assert r.returncode == 1 and "stageA-one has no row for steps 2-3" in r.stderr
    assert v4(tmp_path, "runs", "compare", "stageA-a", "stageA-one", "--steps", "3-1").returncode == 2
    # the step table
    r = v4(tmp_path, "runs", "compare", "stageA-a", "stageA-one", "--table")
    assert r.returncode == 1 and "5.51" in r.stdout


def test_compare_fails_on_malformed_lines_and_names_each(tmp_path):
    a, b = make_run(tmp_path, "stageA-a", LOSS), make_run(tmp_path, "stageA-b", LOSS)
    _bad_lines(b)
    r = v4(tmp_path, "runs", "compare", "stageA-a", "stageA-b", "--json")
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    (p,) = json.loads(r.stdout)["problems"]
    assert p["kind"] == "malformed_lines" and p["run"] == "stageA-b" and "4 malformed lines" in p["detail"]
    for line, why in ((7, "not JSON"), (8, "not UTF-8 (byte 0xff at column 1)"),
                      (9, "step: input should be a valid integer (got '9')")):
        assert f"{b}/metrics.jsonl:{line}: {why}" in p["detail"], p["detail"]
    from launcher import metrics
    assert str(metrics.read(b).bad[3]) == f"{b}/metrics.jsonl:10: loss: input should be a valid number (got 'low')"
    assert metrics.read(b).steps == [1, 2, 3, 4, 5, 6] and not metrics.read(a).bad
    # --steps names what to compare, each step of it read in both: the lines are said, not failed on
    r = v4(tmp_path, "runs", "compare", "stageA-a", "stageA-b", "--steps", "1-6")
    assert r.returncode == 0 and "note: 4 malformed lines in stageA-b" in r.stderr, r.stderr
    r = v4(tmp_path, "runs", "plot", "stageA-a", "stageA-b", "-o", str(tmp_path / "p.png"))
    assert r.returncode == 0 and f"{b}/metrics.jsonl:8: not UTF-8" in r.stderr, r.stderr


def test_compare_fails_across_modes(tmp_path):
    make_run(tmp_path, "stageA-a", LOSS)
    rl = make_run(tmp_path, "rl-a", LOSS)
    (rl / "config.json").write_text(json.dumps({"values": {"PRESET_MODE": "rl"}}))
    r = v4(tmp_path, "runs", "compare", "stageA-a", "rl-a")
    assert r.returncode == 1 and "rl-a is an RL run, the reference stageA-a an SFT run" in r.stderr, r.stderr


@pytest.mark.parametrize("args, says", [
    (("--tol", "nan"), "a relative tolerance is a finite number >= 0"),
    (("--tol", "inf"), "a relative tolerance is a finite number >= 0"),
    (("--tol", "-1e-6"), "a relative tolerance is a finite number >= 0"),
    (("--metrics", "loss,grad_nrom"), "no run has a metric 'grad_nrom'; did you mean grad_norm?"),
    (("--metrics", ","), "names no metric"),
])
def test_compare_and_plot_usage_errors(tmp_path, args, says):
    make_run(tmp_path, "stageA-a", LOSS)
    make_run(tmp_path, "stageA-b", LOSS)
    r = v4(tmp_path, "runs", "compare", "stageA-a", "stageA-b", *args)
    assert r.returncode == 2 and says in r.stderr, r.stderr
    if args[0] == "--metrics":
        r = v4(tmp_path, "runs", "plot", "stageA-a", "-o", str(tmp_path / "p.png"), *args)
        assert r.returncode == 2 and says in r.stderr and not (tmp_path / "p.png").exists(), r.stderr


def test_plot_writes_only_where_told_and_creates_no_directory(tmp_path):
    make_run(tmp_path, "stageA-a", LOSS)
    (tmp_path / "a-file").write_text("kept\n")
    cases = [(tmp_path / "no" / "such" / "p.png", f"the directory {tmp_path}/no/such does not exist"),
             (tmp_path / "a-file" / "p.png", f"{tmp_path}/a-file is a file, not a directory"),
             (tmp_path / "a-file", "the file exists and is not a PNG"),
             (Path("/proc/v4-plot-test.png"), "cannot write /proc/v4-plot-test.png")]
    for out, says in cases:
        r = v4(tmp_path, "runs", "plot", "stageA-a", "-o", str(out))
        assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr, (out, r.stderr)
    assert not (tmp_path / "no").exists() and (tmp_path / "a-file").read_text() == "kept\n"
    assert not list(tmp_path.glob("**/*.tmp.png"))
    # an earlier plot is replaced
    png = tmp_path / "p.png"
    assert v4(tmp_path, "runs", "plot", "stageA-a", "-o", str(png)).returncode == 0
    assert v4(tmp_path, "runs", "plot", "stageA-a", "-o", str(png)).returncode == 0 and png.stat().st_size > 1000
