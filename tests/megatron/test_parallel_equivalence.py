"""Every parallel layout of the DSV4 megatron model computes what one process computes.

Real gloo process groups (torch.multiprocessing), the real megatron-core DDP, optimizer and
pipeline schedules, the tiny model with every path on (hash and score routing, CSA with indexer,
HCA, MTP with loss 0.3, indexer KL loss 0.1). Each layout runs one optimizer step and one more
forward on the same global batch of 2 sequences; loss, gradient norm, every reduced gradient
(reassembled from the ranks' shards into the official tensors) and the loss after the update are
compared with world size 1. Figures are printed (run with -s to see them).
"""
from __future__ import annotations

import json
import math

import pytest
import torch

import mt_harness as H

# fp32 throughout: differences come only from summation order (TP partial sums, DP all-reduce)
LOSS_ATOL = 1e-5
GRAD_ATOL, GRAD_RTOL = 1e-6, 1e-3     # |g - g1| <= ATOL + RTOL * max|g1|, per tensor
NORM_RTOL = 1e-5

WORLD2 = [H.Spec("tp2", tp=2), H.Spec("ep2", ep=2), H.Spec("pp2", pp=2),
          H.Spec("tp2_ep2_etp1", tp=2, ep=2), H.Spec("tp2_etp2", tp=2, etp=2)]
WORLD4 = [H.Spec("tp2_pp2_ep2", tp=2, pp=2, ep=2), H.Spec("tp2_pp2_distopt", tp=2, pp=2, distributed_optimizer=True)]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    d = tmp_path_factory.mktemp("layouts")
    base = H.run([H.Spec("w1")], 1, d)["w1"]
    out = H.run(WORLD2, 2, d)
    out.update(H.run(WORLD4, 4, d))
    return base, out, H.reference_result(d)


def _check_finite(r):
    assert r["finite"] and math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) \
        and math.isfinite(r["loss_after_update"])
    assert all(torch.isfinite(g).all() for g in r["grads"].values())


@pytest.mark.parametrize("name", [s.name for s in WORLD2 + WORLD4])
def test_layout_matches_one_process(results, name):
    base, out, _ = results
    _check_finite(base)
    r = out[name]
    _check_finite(r)
    if r["grads"]:
        figures = H.compare(r, base)
        for key, g1 in base["grads"].items():
            g = r["grads"][key]
            bound = GRAD_ATOL + GRAD_RTOL * g1.abs().max().item()
            assert (g - g1).abs().max().item() <= bound, f"{name}: gradient of {key} differs"
    else:   # the distributed optimizer keeps only a shard of each gradient: losses and norm only
        figures = {"loss_abs": abs(r["loss"] - base["loss"]),
                   "grad_norm_rel": abs(r["grad_norm"] - base["grad_norm"]) / base["grad_norm"],
                   "after_update_abs": abs(r["loss_after_update"] - base["loss_after_update"])}
    print(f"\n{name}: {json.dumps(figures)}")
    assert figures["loss_abs"] <= LOSS_ATOL
    assert figures["grad_norm_rel"] <= NORM_RTOL
    assert figures["after_update_abs"] <= LOSS_ATOL


def test_world1_stage_is_the_reference_model(results):
    """TP = PP = EP = 1: same parameters, same loss and the same gradients, bit for bit (LM loss; the
    MTP and indexer terms are checked through the layouts above)."""
    r = results[2]
    assert r["finite"]
    assert r["param_mismatch"] == []
    assert r["loss"][0] == r["loss"][1]
    assert r["n_grads"] > 100 and r["grad_mismatch"] == []
