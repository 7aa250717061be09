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

import pytest

import mt_harness as H

@pytest.fixture(scope="module")
def results(tmp_path_factory):
    d = tmp_path_factory.mktemp("layouts")
    base = H.run([H.Spec("w1")], 1, d)["w1"]
    out = H.run(H.WORLD2, 2, d)
    out.update(H.run(H.WORLD4, 4, d))
    return base, out, H.reference_result(d)


@pytest.mark.parametrize("name", [s.name for s in H.WORLD2 + H.WORLD4])
def test_layout_matches_one_process(results, name):
    base, out, _ = results
    figures = H.assert_matches(out[name], base, name)
    print(f"\n{name}: {json.dumps(figures)}")


def test_world1_stage_is_the_reference_model(results):
    """TP = PP = EP = 1: same parameters, same loss and the same gradients, bit for bit (LM loss; the
    MTP and indexer terms are checked through the layouts above)."""
    r = results[2]
    assert r["finite"]
    assert r["param_mismatch"] == []
    assert r["loss"][0] == r["loss"][1]
    assert r["n_grads"] > 100 and r["grad_mismatch"] == []
