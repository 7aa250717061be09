"""`v4 bench kernels` off the GPU: what it refuses, and that each upstream figure stays with its own pass."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from launcher.commands.bench import SHAPE_SETS

ROOT = Path(__file__).resolve().parents[2]


def test_upstream_figures_belong_to_their_pass():
    flash = SHAPE_SETS["flash"][0]
    assert "320" in flash.note("fwd") and flash.note("bwd") == ""      # no forward figure beside a backward row
    for sh in SHAPE_SETS["flash"] + SHAPE_SETS["upstream"]:
        assert {op for op, _ in sh.upstream} <= set(sh.ops), sh.name
    assert str(flash) == "v4-flash: B1 S4096 N5120 H64 D512 top-k 640 (fwd, bwd)"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_refuses_without_a_gpu():
    p = subprocess.run([sys.executable, "-m", "launcher", "bench", "kernels"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "needs a CUDA GPU" in p.stderr
