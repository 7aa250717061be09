"""`v4 bench kernels`. Off the GPU: what it refuses, that each upstream figure and goal stays with its own pass, the
median / min-max and clock of each row, and each TileLang row's speedup over the torch row of its shape and pass.
On a GPU: that a timed run counts the GPU's time only, and the clock it reads."""
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
    assert "min-max" in lines[0] and lines[0].split()[8] == "MHz"
    assert "0.850" in lines[1] and "0.800-0.900" in lines[1] and "4.7" in lines[1]
    assert lines[1].split()[7] == "1755"
    assert lines[2].split()[3:8] == ["-", "-", "-", "-", "-"] and lines[2].endswith("out of memory")


def test_goals_are_judged_per_pass():
    flash = SHAPE_SETS["flash"][0]
    assert flash.row_note("fwd", 549.9) == "upstream V4 illustration: 320; goal (H200) 550: NOT met"
    assert flash.row_note("fwd", 550.0).endswith("goal (H200) 550: met")
    assert flash.row_note("bwd", 251.0) == "goal (H200) 250: met"
    v32 = SHAPE_SETS["upstream"][1]
    assert v32.row_note("fwd", 1.0) == v32.note("fwd")          # no goal at the upstream shapes


def test_speedup_is_over_the_torch_row_of_the_same_shape_and_pass():
    rows = [Row("a", "fwd", "tilelang", 0.5, 1.0), Row("a", "bwd", "tilelang", 2.0, 1.0),
            Row("a", "fwd", "torch", 10.0, 0.1), Row("a", "bwd", "torch", None, None, "out of memory"),
            Row("b", "fwd", "tilelang", 1.0, 1.0)]
    with_speedups(rows)
    assert [r.vs_torch for r in rows] == [20.0, None, None, None, None]
    lines = table(rows).splitlines()
    assert "vs torch" in lines[0]
    assert lines[1].split()[6] == "20.0x" and lines[2].split()[6] == "-" and lines[5].split()[6] == "-"


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
