"""`v4 bench kernels` off the GPU: what it refuses, that each upstream figure stays with its own pass, and
the median / min-max of each row."""
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from launcher.commands.bench import SHAPE_SETS, Row, table

ROOT = Path(__file__).resolve().parents[2]


def test_upstream_figures_belong_to_their_pass():
    flash = SHAPE_SETS["flash"][0]
    assert "320" in flash.note("fwd") and flash.note("bwd") == ""      # no forward figure beside a backward row
    for sh in SHAPE_SETS["flash"] + SHAPE_SETS["upstream"]:
        assert {op for op, _ in sh.upstream} <= set(sh.ops), sh.name
    assert str(flash) == "v4-flash: B1 S4096 N5120 H64 D512 top-k 640 (fwd, bwd)"


def test_rows_carry_the_spread_of_their_runs():
    row = Row.timed("v4-flash", "fwd", "tilelang", [0.90, 0.80, 0.85, 0.83], flops=4 * 10**9, note="x")
    assert (row.ms, row.ms_min, row.ms_max) == (0.85, 0.80, 0.90)     # the upper median of an even count
    assert math.isfinite(row.tflops) and row.tflops == pytest.approx(4 / 0.85)
    oom = Row("v4-flash", "bwd", "torch", None, None, "out of memory")
    lines = table([row, oom]).splitlines()
    assert "min-max" in lines[0]
    assert "0.850" in lines[1] and "0.800-0.900" in lines[1] and "4.7" in lines[1]
    assert lines[2].split()[3:6] == ["-", "-", "-"] and lines[2].endswith("out of memory")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_refuses_without_a_gpu():
    p = subprocess.run([sys.executable, "-m", "launcher", "bench", "kernels"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "needs a CUDA GPU" in p.stderr
