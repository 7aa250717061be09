"""The layouts of test_parallel_equivalence on real GPUs: NCCL process groups, one GPU a rank, the tiny model
on CUDA (its attention is the torch implementation, as in the gloo test).
Each layout runs one optimizer step and one more forward on the same global batch as one GPU, and loss,
gradient norm, every reduced gradient and the loss after the update are compared, with the same fp32
tolerances as the gloo test. Layouts of world 4 run where 4 GPUs are present. Figures are printed (-s)."""
from __future__ import annotations

import json

import pytest
import torch

import mt_harness as H

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    d = tmp_path_factory.mktemp("nccl_layouts")
    base = H.run([H.Spec("w1")], 1, d, device="cuda")["w1"]
    out = H.run(H.WORLD2, 2, d, device="cuda")
    if torch.cuda.device_count() >= 4:
        out.update(H.run(H.WORLD4, 4, d, device="cuda"))
    return base, out


@pytest.mark.parametrize("name", [s.name for s in H.WORLD2 + H.WORLD4])
def test_layout_on_nccl_matches_one_gpu(results, name):
    base, out = results
    if name not in out:
        pytest.skip(f"{name} needs 4 GPUs")
    figures = H.assert_matches(out[name], base, name)
    print(f"\n{name} (NCCL, {torch.cuda.get_device_name()}): {json.dumps(figures)}")


@pytest.fixture(scope="module")
def cp_results(tmp_path_factory):
    d = tmp_path_factory.mktemp("nccl_cp_layouts")
    base = H.run(H.CP_BASE, 1, d, device="cuda")
    out = H.run(H.CP_WORLD2, 2, d, device="cuda")
    if torch.cuda.device_count() >= 4:
        out.update(H.run(H.CP_WORLD4, 4, d, device="cuda"))
    return base, out


@pytest.mark.parametrize("spec", H.CP_WORLD2 + H.CP_WORLD4, ids=lambda s: s.name)
def test_context_parallel_layout_on_nccl_matches_one_gpu(cp_results, spec):
    """test_cp_equivalence's layouts over NCCL: the CP gathers and their reduce-scatter backward on GPUs."""
    base, out = cp_results
    if spec.name not in out:
        pytest.skip(f"{spec.name} needs 4 GPUs")
    figures = H.assert_matches(out[spec.name], base[f"w1_s{spec.seq_len}"], spec.name)
    print(f"\n{spec.name} (NCCL, {torch.cuda.get_device_name()}): {json.dumps(figures)}")
