"""node_scripts/nccl_bw.py run as preflight runs it (`python - ARGS` with the script on stdin), in real
processes: with gloo on the CPU (this machine has no GPU: NCCL itself runs on the GPU host), and the
failure path, where NCCL cannot start and the script must report it rather than hang."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from launcher.node_scripts import source


def measure(**args) -> dict:
    p = subprocess.run([sys.executable, "-", json.dumps(args)], input=source("nccl_bw"), capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_allreduce_over_gloo_processes():
    r = measure(gpus=2, bytes=4 << 20, iters=3, backend="gloo", timeout=60)
    assert r["error"] == "" and r["gpus"] == 2 and r["bytes"] == 4 << 20
    assert math.isfinite(r["seconds"]) and math.isfinite(r["busbw_gbps"])
    assert r["seconds"] > 0 and r["busbw_gbps"] > 0


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="NCCL can start here: this test needs it to fail")
def test_nccl_without_gpus_reports_the_error():
    r = measure(gpus=2, bytes=1 << 20, iters=1, backend="nccl", timeout=60)
    assert r["error"] and r["busbw_gbps"] is None
