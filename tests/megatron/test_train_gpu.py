"""The training jobs on a GPU: convert (CPU, gloo) then SFT on CUDA with NCCL, bf16 and the TileLang
sparse attention, through the reload check. Skipped without CUDA."""
from __future__ import annotations

import json
import math

import pytest
import torch

from test_jobs import job, make_run, metrics, models  # noqa: F401  (models is a fixture)

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("attn", ["tilelang", "torch"])
def test_sft_on_cuda(models, tmp_path, attn):   # noqa: F811
    run = make_run(tmp_path / "run", models, HW_DEVICE="cuda", HW_DIST_BACKEND="nccl", ATTN_IMPL=attn,
                   PRESET_SEQ_LEN=256, PRESET_GLOBAL_BATCH_SIZE=4,
                   CKPT_TORCH_DIST=str(tmp_path / "torch_dist"))
    conv = job("convert_ckpt", run)
    assert conv.returncode == 0, conv.stderr[-3000:]
    p = job("train_sft", run, timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    print(p.stderr[-2500:])
    rows = metrics(run)
    assert sorted(rows) == [1, 2, 3]
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in rows.values())
    assert rows[3]["loss"] < rows[1]["loss"] and rows[1]["peak_mem_gb"] > 0
    check = json.loads((run / "steps" / "train" / "reload_check.json").read_text())
    print(json.dumps(check))
    assert math.isfinite(check["loss_continued"]) and check["loss_continued"] == check["loss_reloaded"]
