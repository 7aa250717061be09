"""The staged NaN bisect on a GPU: a NaN planted only in the TileLang attention path of the 4-layer smoke model
(8 routed experts, 1024-token rows to keep it short) stops `v4 run` with exit 16; `v4 nan bisect` names the
TileLang kernels (the torch reference cures the step) and hands over to the kernel bisector at the step's
attention shape, whose report it includes."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

SETS = ("V4_EXECUTOR=local", "PRESET_MODEL_OVERRIDES=n_routed_experts=8", "PRESET_SEQ_LEN=1024",
        "PRESET_GLOBAL_BATCH_SIZE=2", "PRESET_NUM_STEPS=2", "PRESET_SAVE_INTERVAL=2",
        "PRESET_PLANT_NAN=layers.2.attn:2@impl=tilelang")


def v4(work: Path, *args, timeout=900):
    cmd = [sys.executable, "-m", "launcher", *args, "--hw", "h200", "--set", f"V4_WORK={work}"]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=dict(os.environ))
    print(f"$ v4 {' '.join(args)}  ({time.perf_counter() - t0:.0f} s, exit {r.returncode})\n{r.stderr[-2500:]}{r.stdout[-1500:]}")
    return r


def test_a_tilelang_only_nan_ends_in_the_kernel_report(tmp_path):
    work = Path(os.environ.get("V4_TEST_WORK", tmp_path))
    args = ["run", "--preset", "smoke", "--force"]
    if torch.cuda.is_initialized():
        # GPU tests before this one ran in this process: its CUDA context (a few hundred MiB once they gave their
        # cache back) is GPU memory held by another process, which the preflight's gpu_memory check refuses
        args += ["--skip-check", "gpu_memory"]
    for s in SETS:
        args += ["--set", s]
    r = v4(work, *args)
    assert r.returncode == 16, r.stderr[-3000:]
    run = max((work / "runs").glob("stageA-*"), key=lambda p: p.stat().st_mtime)
    r = v4(work, "nan", "bisect", run.name, "--json", "--set", "V4_EXECUTOR=local")
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(r.stdout)
    assert report["culprit"] == ["attn_torch"] and report["forensics"]["forward"]["module"] == "layers.2.attn"
    assert report["kernel"]["ran"] and report["kernel"]["kernel"] == "sparse_attn_fwd"
    assert Path(report["kernel"]["report_md"]).is_file()
    print((run / "nan-bisect" / "report.md").read_text())
