"""Cached decoding (dsv4/rl/decode.py) against a full recompute of the same model.

The sequences are long enough to cross the tiny model's window (8) many times and to complete several blocks
of every compression ratio (4 with the indexer's top-4 among up to 20 entries, and 16), so the ring, the
compressor's partial and overlapping blocks and the indexer's keys are all exercised.
"""
from __future__ import annotations

import pytest
import torch

from dsv4.config import ModelConfig
from dsv4.model import Transformer
from dsv4.rl import decode


def _incremental(model, ids):
    B, S = ids.shape
    cache = decode.DecodeCache(model, B, S)
    logits, routes = zip(*(decode.step(model, cache, ids[:, p], p) for p in range(S)))
    return torch.stack(logits, 1), torch.stack(routes, 1)


def _full(model, ids):
    with torch.no_grad():
        logits = model(ids).logits
    routes = torch.stack([layer.ffn.last_expert_idx.view(ids.shape[0], ids.shape[1], -1) for layer in model.layers], 2)
    return logits, routes


@pytest.mark.parametrize("S", [1, 5, 17, 80])
def test_cached_decoding_equals_full_recompute_fp32(S):
    cfg = ModelConfig.preset("tiny", seed=3)
    model = Transformer(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, S), generator=torch.Generator().manual_seed(S))
    inc, inc_routes = _incremental(model, ids)
    full, full_routes = _full(model, ids)
    assert torch.isfinite(inc).all()
    assert (inc - full).abs().max().item() < 5e-5, "cached logits drift from the full forward"
    # the same experts for every token (order within a top-k is free)
    assert torch.equal(inc_routes.sort(-1).values, full_routes.sort(-1).values)


def test_cached_decoding_with_the_qat_points_on():
    cfg = ModelConfig.preset("tiny", seed=1, qat_kv_fp8=True, qat_indexer_fp4=True)
    model = Transformer(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    inc, _ = _incremental(model, ids)
    full, _ = _full(model, ids)
    assert torch.isfinite(inc).all()
    # FP8/FP4 rounding can flip a value at a quantisation boundary; almost every logit agrees to round-off
    close = ((inc - full).abs() < 1e-3).float().mean().item()
    assert close > 0.99, f"only {close:.3f} of the logits agree"


def test_cached_decoding_bf16_within_bf16_tolerance():
    cfg = ModelConfig.preset("tiny", seed=2, dtype="bf16")
    model = Transformer(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 48), generator=torch.Generator().manual_seed(1))
    inc, _ = _incremental(model, ids)
    full, _ = _full(model, ids)
    assert torch.isfinite(inc).all()
    err = (inc - full).abs().mean().item() / full.abs().mean().item()
    assert err < 2e-2, f"relative error {err:.3g} beyond bf16 noise"


def test_a_sample_dropped_from_the_batch_leaves_the_others_unchanged():
    cfg = ModelConfig.preset("tiny", seed=0)
    model = Transformer(cfg)
    ids = torch.randint(0, cfg.vocab_size, (3, 30), generator=torch.Generator().manual_seed(2))
    cache = decode.DecodeCache(model, 3, 30)
    out = []
    for p in range(30):
        if p == 12:                       # sample 1 finished: keep rows 0 and 2
            cache.select(torch.tensor([0, 2]))
            ids = ids[[0, 2]]
        out.append(decode.step(model, cache, ids[:, p], p)[0])
    full, _ = _full(model, ids)
    assert (out[-1] - full[:, -1]).abs().max().item() < 5e-5
