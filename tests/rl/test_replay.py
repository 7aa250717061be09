"""Routing replay: with the router perturbed between rollout and training, native routing changes and the
trainer's logprobs leave the rollout's; replaying the recorded experts brings them back, and the router still
gets a gradient."""
from __future__ import annotations

import copy

import torch

from dsv4.rl.api import GenerateRequest, SamplingParams
from dsv4.rl.engine import EmbeddedEngine, scaled_logprobs
from dsv4.rl.replay import replayed_routes, route_agreement, routes_tensor


def _rollout():
    eng = EmbeddedEngine.from_preset("tiny", seed=11)
    reqs = [GenerateRequest(list(range(30 + i, 42 + 2 * i)), SamplingParams(max_new_tokens=10, sampling_seed=i),
                            return_logprob=True, return_routed_experts=True)
            for i in range(3)]
    return eng, reqs, eng.generate(reqs)


def _batch(reqs, results):
    seqs = [r.input_ids + res.output_ids for r, res in zip(reqs, results)]
    S = max(map(len, seqs))
    ids = torch.zeros(len(seqs), S, dtype=torch.long)
    for b, s in enumerate(seqs):
        ids[b, :len(s)] = torch.tensor(s)
    return ids, seqs


def _logprob_gap(model, reqs, results, ids):
    logits = model(ids).logits
    gaps = []
    for b, (r, res) in enumerate(zip(reqs, results)):
        p, n = len(r.input_ids), len(res.output_ids)
        lp = scaled_logprobs(logits[b, p - 1:p + n - 1], torch.tensor([1.0]), None)
        lp = lp.gather(-1, torch.tensor(res.output_ids)[:, None])[:, 0]
        gaps.append((lp - torch.tensor(res.logprobs)).abs().max())
    return torch.stack(gaps).max().item(), logits


def test_replay_restores_the_rollout_logprobs_after_the_router_moved():
    eng, reqs, results = _rollout()
    ids, seqs = _batch(reqs, results)
    cfg = eng.cfg
    routes, mask = routes_tensor([(len(s), r.routed_experts_start_len, res.routed_experts)
                                  for s, r, res in zip(seqs, reqs, results)], ids.shape[1], cfg.n_layers,
                                 cfg.n_activated_experts)
    trainer = copy.deepcopy(eng.model)
    with torch.no_grad():
        assert _logprob_gap(trainer, reqs, results, ids)[0] <= 1e-5          # same weights: already equal
        g = torch.Generator().manual_seed(0)
        for layer in trainer.layers:                                          # move the balancing bias
            if layer.ffn.gate.bias is not None:
                layer.ffn.gate.bias.add_(torch.randn(cfg.n_routed_experts, generator=g) * 2.0)
        gap_native, _ = _logprob_gap(trainer, reqs, results, ids)
        native = torch.stack([layer.ffn.last_expert_idx.view(*ids.shape, -1) for layer in trainer.layers], 2)
    assert route_agreement(native, routes, mask) < 0.9, "the perturbation did not change the routing"
    assert gap_native > 1e-2

    with replayed_routes(trainer, routes, mask):
        gap_replay, logits = _logprob_gap(trainer, reqs, results, ids)
        replayed = torch.stack([layer.ffn.last_expert_idx.view(*ids.shape, -1) for layer in trainer.layers], 2)
        logits[mask].logsumexp(-1).sum().backward()
    assert torch.isfinite(logits).all()
    assert gap_replay <= 1e-5, f"replayed logprobs differ from the rollout's by {gap_replay}"
    # score-routed layers follow the record on masked rows; hash layer 0 routes by its table regardless
    assert route_agreement(replayed[..., 1:, :], routes[..., 1:, :], mask) == 1.0
    assert all(layer.ffn.gate.replay is None for layer in trainer.layers)
    grads = [layer.ffn.gate.weight.grad for layer in trainer.layers[1:]]
    assert all(gr is not None and gr.abs().sum() > 0 for gr in grads), "the router lost its gradient under replay"


def test_the_mask_covers_the_routed_rows_only():
    import numpy as np
    r = np.arange(2 * 4 * 2, dtype=np.int32).reshape(4, 2, 2) % 8     # 7 tokens, start 2 -> 4 rows
    routes, mask = routes_tensor([(7, 2, r)], 9, 2, 2)
    assert mask[0].tolist() == [False, False, True, True, True, True, False, False, False]
    assert torch.equal(routes[0, 2:6], torch.from_numpy(r).long())
    import pytest
    with pytest.raises(ValueError, match="sample 0"):
        routes_tensor([(8, 2, r)], 9, 2, 2)
