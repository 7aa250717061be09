"""The layouts of test_parallel_equivalence on real GPUs: NCCL process groups, one GPU a rank, CUDA kernels.
Each layout runs one optimizer step and one more forward on the same global batch as one GPU, and loss,
gradient norm, every reduced gradient and the loss after the update are compared, with the same fp32
tolerances as the gloo test. Layouts of world 4 run where 4 GPUs are present. Figures are printed (-s)."""
from __future__ import annotations

import json

import pytest
import torch

import mt_harness as H
from test_parallel_equivalence import GRAD_ATOL, GRAD_RTOL, LOSS_ATOL, NORM_RTOL, WORLD2, WORLD4, _check_finite

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    d = tmp_path_factory.mktemp("nccl_layouts")
    base = H.run([H.Spec("w1")], 1, d, device="cuda")["w1"]
    out = H.run(WORLD2, 2, d, device="cuda")
    if torch.cuda.device_count() >= 4:
        out.update(H.run(WORLD4, 4, d, device="cuda"))
    return base, out


@pytest.mark.parametrize("name", [s.name for s in WORLD2 + WORLD4])
def test_layout_on_nccl_matches_one_gpu(results, name):
    base, out = results
    if name not in out:
        pytest.skip(f"{name} needs 4 GPUs")
    _check_finite(base)
    r = out[name]
    _check_finite(r)
    if r["grads"]:
        figures = H.compare(r, base)
        for key, g1 in base["grads"].items():
            bound = GRAD_ATOL + GRAD_RTOL * g1.abs().max().item()
            assert (r["grads"][key] - g1).abs().max().item() <= bound, f"{name}: gradient of {key} differs"
    else:
        figures = {"loss_abs": abs(r["loss"] - base["loss"]),
                   "grad_norm_rel": abs(r["grad_norm"] - base["grad_norm"]) / base["grad_norm"],
                   "after_update_abs": abs(r["loss_after_update"] - base["loss_after_update"])}
    print(f"\n{name} (NCCL, {torch.cuda.get_device_name()}): {json.dumps(figures)}")
    assert figures["loss_abs"] <= LOSS_ATOL
    assert figures["grad_norm_rel"] <= NORM_RTOL
    assert figures["after_update_abs"] <= LOSS_ATOL
