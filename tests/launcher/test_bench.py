"""`v4 bench kernels`. Off the GPU: what it refuses, that each upstream figure and goal stays with its own pass, the
median / min-max and clock of each row, and each TileLang row's speedup over the torch and FlashMLA rows of its shape
and pass. On a GPU: that a timed run counts the GPU's time only, and the clock it reads; that FlashMLA is timed on our
inputs (batch flattened) only when its output matches ours."""
import math
import subprocess
import sys
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
