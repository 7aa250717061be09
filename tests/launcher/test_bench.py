"""`v4 bench kernels`. Off the GPU: what it refuses, that each upstream figure and goal stays with its own pass, the
median / min-max and clock of each row, and each TileLang row's speedup over the torch and FlashMLA rows of its shape
and pass. On a GPU: that a timed run counts the GPU's time only, and the clock it reads; that FlashMLA is timed on our
inputs (batch flattened) only when its output matches ours."""
import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from launcher.commands.bench import SHAPE_SETS, Row, table, with_speedups

ROOT = Path(__file__).resolve().parents[2]


def test_upstream_figures_belong_to_their_pass():
    flash = SHAPE_SETS["flash"][0]
    assert "320" in flash.note("fwd") and flash.note("bwd") == ""      # no forward figure beside a backward row
    for sh in SHAPE_SETS["flash"] + SHAPE_SETS["upstream"]:
        assert {op for op, _ in sh.upstream} <= set(sh.ops), sh.name
    assert str(flash) == "v4-flash: B1 S4096 N5120 H64 D512 top-k 640 (fwd, bwd)"


def test_rows_carry_the_spread_of_their_runs():
    row = Row.timed("v4-flash", "fwd", "tilelang", ([0.90, 0.80, 0.85, 0.83], 1755.2), flops=4 * 10**9, note="x")
    assert (row.ms, row.ms_min, row.ms_max) == (0.85, 0.80, 0.90)     # the upper median of an even count
    assert math.isfinite(row.tflops) and row.tflops == pytest.approx(4 / 0.85)
    assert row.clock_mhz == 1755.2
    oom = Row("v4-flash", "bwd", "torch", None, None, "out of memory")
    lines = table([row, oom]).splitlines()
    assert "min-max" in lines[0] and lines[0].split()[10] == "MHz"
    assert "0.850" in lines[1] and "0.800-0.900" in lines[1] and "4.7" in lines[1]
    assert lines[1].split()[8] == "1755"
    assert lines[2].split()[3:9] == ["-", "-", "-", "-", "-", "-"] and lines[2].endswith("out of memory")


def test_goals_are_judged_per_pass():
    flash = SHAPE_SETS["flash"][0]
    assert flash.row_note("fwd", 549.9) == "upstream V4 illustration: 320; goal (H200) 550: NOT met"
    assert flash.row_note("fwd", 550.0).endswith("goal (H200) 550: met")
    assert flash.row_note("bwd", 251.0) == "goal (H200) 250: met"
    v32 = SHAPE_SETS["upstream"][1]
    assert v32.row_note("fwd", 1.0) == v32.note("fwd")          # no goal at the upstream shapes


def test_speedup_is_over_the_torch_and_flashmla_rows_of_the_same_shape_and_pass():
    rows = [Row("a", "fwd", "tilelang", 0.5, 1.0), Row("a", "bwd", "tilelang", 2.0, 1.0),
            Row("a", "fwd", "torch", 10.0, 0.1), Row("a", "bwd", "torch", None, None, "out of memory"),
            Row("b", "fwd", "tilelang", 1.0, 1.0), Row("a", "fwd", "flashmla", 0.55, 1.0),
            Row("b", "fwd", "flashmla", None, None, "output differs")]
    with_speedups(rows)
    assert [r.vs_torch for r in rows] == [20.0, None, None, None, None, None, None]
    assert [r.vs_flashmla for r in rows] == [pytest.approx(1.1), None, None, None, None, None, None]
    lines = table(rows).splitlines()
    assert "vs torch" in lines[0] and "vs FlashMLA" in lines[0]
    assert lines[1].split()[6:8] == ["20.0x", "1.100x"]
    assert lines[2].split()[6:8] == ["-", "-"] and lines[5].split()[6:8] == ["-", "-"]


def test_flashmla_gets_our_batches_as_one_with_offset_rows():
    from launcher.commands.bench import _flashmla_args
    q, kv = torch.randn(2, 3, 4, 8), torch.randn(2, 5, 8)
    idx = torch.tensor([[[0, 4, -1], [1, 5, 2], [1, 5, 2]],
                        [[0, 4, -1], [3, 3, 7], [3, 3, 7]]], dtype=torch.int32)      # [B=2, S=3, K=3], N = 5
    fq, fkv, fidx = _flashmla_args(q, kv, idx)
    assert fq.shape == (6, 4, 8) and fkv.shape == (10, 1, 8) and fidx.shape == (6, 1, 3)
    assert torch.equal(fkv[5:, 0], kv[1]) and torch.equal(fq[3:], q[1])
    # batch 1's rows move by N = 5; -1 and indices outside [0, N) stay empty slots (-1), never another batch's row
    assert fidx[:, 0].tolist() == [[0, 4, -1], [1, -1, 2], [1, -1, 2], [5, 9, -1], [8, 8, -1], [8, 8, -1]]
    assert fidx.dtype == torch.int32


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_refuses_without_a_gpu():
    p = subprocess.run([sys.executable, "-m", "launcher", "bench", "kernels"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "needs a CUDA GPU" in p.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_timed_runs_time_the_gpu_and_read_its_clock():
    """A spin of a known cycle count takes what the clock says it should, and the host's time between queued calls
    is not counted (the bench's runs are queued back to back)."""
    import time

    from launcher.commands.bench import _timed_runs
    cycles = 6_000_000                                  # ~3 ms at H200 clocks

    def call():
        time.sleep(0.0015)                              # 1.5 ms of host work a call: not GPU time
        torch.cuda._sleep(cycles)
    times, mhz = _timed_runs(call, warmup=1, iters=5)
    assert all(math.isfinite(t) and t > 0 for t in times) and math.isfinite(mhz)
    assert 300 <= mhz <= 3000, f"implausible SM clock {mhz:.0f} MHz"
    expected_ms = cycles / (mhz * 1e3)
    # a run is its spin (the clock may move a little between runs), not spin + the 1.5 ms of host time
    assert max(times) < expected_ms * 1.25 + 0.2, (times, expected_ms)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_flashmla_is_timed_on_our_inputs_only_when_it_agrees():
    """With a FlashMLA build importable: its row at B2 (batch flattened) is timed and within tolerance of ours. Always:
    an 'upstream' that returns something else is not timed (a fake stands in for a wrong FlashMLA: the check under
    test is ours)."""
    from launcher.commands.bench import AttnShape, bench_attention, flashmla
    sh = AttnShape("t", 2, 64, 512, 64, 512, 128, ("fwd",))

    def wrong(q, kv, idx, scale, d_v, sink):
        return torch.zeros_like(q), None, None
    rows = bench_attention(sh, ("fwd",), False, 1, 2, upstream=(wrong, "fake"))
    bad = [r for r in rows if r.impl == "flashmla"]
    assert len(bad) == 1 and bad[0].ms is None and "differs from ours" in bad[0].note, bad
    fn, where = flashmla()
    if fn is None:
        pytest.skip(f"FlashMLA is not importable here ({where})")
    rows = bench_attention(sh, ("fwd",), False, 1, 3, upstream=(fn, where))
    fm = [r for r in rows if r.impl == "flashmla"]
    assert len(fm) == 1 and fm[0].ms is not None and math.isfinite(fm[0].tflops), fm
    assert "within" in fm[0].note and where in fm[0].note


# --- `v4 bench step`'s fit check: the cost model before anything is built ------------------------------------------

H200_GIB = 139.80      # what torch reports of an H200


def _rank(rank_of: str, layers: int | None = None):
    from launcher.commands.bench import build_rank
    return build_rank("flash", {"attn_impl": "tilelang"}, rank_of, "mixed", layers, train=True, seq_len=4096)[0]


def test_the_bench_predicts_the_model_it_builds():
    """One source: the slice the cost model is given (RankShape.slice_overrides as model overrides) is the model the
    bench builds (RankShape.model_config), and the validation rows of the two OOMs are the bench's shapes."""
    from launcher import costmodel as cm
    from launcher.commands.bench import step_shape
    cases = {c.command: c for c in cm.validation_cases() if c.bench}
    for rank_of, layers, cmd in (("EP=8 PP=8 FIRST=4 LAST=3", 4,
                                  'v4 bench step --rank-of "EP=8 PP=8 FIRST=4 LAST=3" --layers 4 --steps 3'),
                                 ("TP=8 PP=8 EP=8 FIRST=4 LAST=3", None,
                                  'v4 bench step --rank-of "TP=8 PP=8 EP=8 FIRST=4 LAST=3" --steps 3')):
        rank = _rank(rank_of, layers)
        b = step_shape("flash", {"attn_impl": "tilelang"}, rank, 4096, 8, 1, "none")
        assert cm.model_shape(b.model, b.overrides, 4096).cfg == rank.model_config()
        assert (b.tp, b.mtp) == (rank.layout.tp, True)
        # the rows ran the trainer's isfinite check (7 bytes an element; today's allocates nothing), stacked the
        # experts at every micro-batch (today once a step), quantised in cache-sized chunks (today 2^24 on a GPU) and
        # ran the eager head loss (today the fused one)
        old = replace(b, grad_check_bytes=cm.ISFINITE_CHECK_BYTES, expert_stack="micro_batch", quant_chunk="cpu_sized",
                      head_loss="eager")
        assert old == cm.BenchShape.from_case(cases[cmd])


def _pretend_h200(monkeypatch):
    from types import SimpleNamespace
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda *a: SimpleNamespace(total_memory=int(H200_GIB * 2 ** 30)))


@pytest.mark.parametrize("args,fits,peak", [
    (["--rank-of", "EP=8 PP=8 FIRST=4 LAST=3", "--layers", "4", "--model-overrides", "head_loss=eager"], "--layers 3",
     "130.2"),
    (["--rank-of", "EP=8 PP=8 FIRST=4 LAST=3", "--layers", "3", "--micro-batch", "2", "--model-overrides",
      "head_loss=eager"], "--layers 2", "129.9"),
    (["--rank-of", "EP=8 PP=8 FIRST=4 LAST=3", "--layers", "5"], "--layers 4", "147.1"),
])
def test_bench_step_refuses_what_the_model_says_does_not_fit(monkeypatch, capsys, args, fits, peak):
    """The EP8 rank shape that ran out of memory on one H200 after 246 s of building and compiling (with the eager
    head loss, as it ran), the same slice at micro-batch 2, and with today's fused head loss a layer more, are
    refused before anything is built (exit 2), with the predicted peak by part and the largest --layers that fits. (The TP8 one that ran out, of its gradient check, fits since the check allocates
    nothing: test_costmodel holds the old check to its OOM.)"""
    import time

    from dsv4.megatron import stepprof
    from launcher.cli import main
    _pretend_h200(monkeypatch)
    monkeypatch.setattr(stepprof, "bench_step", lambda *a, **kw: pytest.fail("built a shape the model refuses"))
    t0 = time.monotonic()
    with pytest.raises(SystemExit) as e:
        main(["bench", "step", *args, "--steps", "3"])
    assert e.value.code == 2 and time.monotonic() - t0 < 60
    err = capsys.readouterr().err
    assert f"peaks at {peak} GiB" in err and "127.1 GiB this H200 leaves usable" in err
    for part in ("weights", "gradients", "Adam state", "workspace"):
        assert part in err, part
    assert f"what the model says fits: {fits}" in err and "--skip-fit-check" in err


def test_bench_step_builds_anyway_when_told_and_fits_the_measured_shape(monkeypatch, capsys):
    """--skip-fit-check goes on to build; the 32-expert shape measured at 104.2 GiB (cccd6ba, the fused head loss)
    is not refused at all, and its prediction (within +-10 %) is printed before the build."""
    from dsv4.megatron import stepprof
    from launcher.cli import main
    _pretend_h200(monkeypatch)

    def built(*a, **kw):
        raise RuntimeError("built")
    monkeypatch.setattr(stepprof, "bench_step", built)
    with pytest.raises(RuntimeError, match="built"):
        main(["bench", "step", "--rank-of", "EP=8 PP=8 FIRST=4 LAST=3", "--layers", "5", "--skip-fit-check"])
    assert "--skip-fit-check: building anyway" in capsys.readouterr().err
    with pytest.raises(RuntimeError, match="built"):
        main(["bench", "step", "--model-overrides", "n_routed_experts=32"])
    err = capsys.readouterr().err
    peak = float(err.split("predicted peak ")[1].split(" GiB")[0])
    assert abs(peak / 104.2 - 1) <= 0.10 and "refuse" not in err


def test_bench_step_checks_every_compare_variant(monkeypatch, capsys):
    """The variants of --compare run in one process: a switch that keeps more (head_loss=eager keeps the fp32
    log-softmax where fused keeps a bf16 softmax) is checked too. 33 experts at two sequences a micro-batch: the fused
    base fits (124.4 GiB), the eager variant does not (127.5 of 127.1)."""
    from dsv4.megatron import stepprof
    from launcher.cli import main
    _pretend_h200(monkeypatch)
    monkeypatch.setattr(stepprof, "bench_step", lambda *a, **kw: pytest.fail("built a variant the model refuses"))
    with pytest.raises(SystemExit) as e:
        main(["bench", "step", "--model-overrides", "n_routed_experts=33 head_loss=fused", "--micro-batch", "2",
              "--compare", "head_loss=fused;head_loss=eager"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "(variant head_loss=eager) peaks at 127.5 GiB" in err and "what the model says fits: " in err


def test_a_step_record_carries_its_plan_for_the_calibration(tmp_path):
    """`--record` on a GPU stores the cost model's inputs and prediction with the measured row; `v4 plan calibration`
    turns it into a case and compares today's prediction with what was measured."""
    import json

    from dsv4.config import ModelConfig
    from dsv4.megatron.stepprof import StepRow
    from launcher import costmodel as cm
    from launcher.commands.bench import step_plan, step_records
    overrides = {"n_routed_experts": "32", "attn_impl": "tilelang"}
    plan = step_plan("4layer", overrides, None, 4096, 8, 1, "none", "NVIDIA H200", H200_GIB)
    cfg = ModelConfig.preset("4layer").with_overrides(**overrides)
    rows = [StepRow("defaults", 1.337, 24503, 257.6, 0.261, 12.28, 108.2)]
    (rec,) = step_records("e32", rows, "4layer", overrides, cfg, 4096, 8, 1, 989.0, None, None, [plan])
    assert rec["plan"]["predicted"]["peak_gib"] == round(plan.prediction.peak_gib, 2)
    assert rec["plan"]["gpu_memory_gib"] == H200_GIB and rec["plan"]["bench"]
    path = tmp_path / "train_step.jsonl"
    path.write_text(json.dumps({**rec, "date": "2026-12-04", "device": "NVIDIA H200", "command": "v4 bench step"})
                    + "\n")
    got = {r["quantity"]: r for r in cm.validation_table(records=str(path)) if r["name"] == "e32 (bench record)"}
    assert got["peak GiB"]["ok"] and got["s/step"]["ok"], got


def test_a_record_names_the_commit_v4_bench_commit_gives_over_gits(tmp_path, monkeypatch):
    """A GPU host's copy of the tree may carry a git of an older commit: the commit said is the one given."""
    import json
    import subprocess

    from launcher.commands.bench import append_records
    monkeypatch.setenv("V4_BENCH_COMMIT", "abc1234")
    path = append_records(tmp_path, "t.jsonl", "cpu", [{"benchmark": "x"}], lambda _: None)
    monkeypatch.delenv("V4_BENCH_COMMIT")
    append_records(tmp_path, "t.jsonl", "cpu", [{"benchmark": "y"}], lambda _: None)
    given, from_git = (json.loads(line) for line in path.read_text().splitlines())
    assert (given["commit"], given["dirty"]) == ("abc1234", None)
    from pathlib import Path
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parents[2], capture_output=True,
                          text=True).stdout.strip()
    if head:                                     # a checkout with git (CI's clean clone is one)
        assert from_git["commit"] == head[:7] and isinstance(from_git["dirty"], bool)
