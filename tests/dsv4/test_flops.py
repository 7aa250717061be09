"""Model FLOPs per token (dsv4/flops.py) against a count by hand for the tiny model, written from its numbers."""
from __future__ import annotations

import math

import pytest

from dsv4.config import ModelConfig
from dsv4.flops import attended, forward_flops_per_token, train_flops_per_token

TINY = ModelConfig.preset("tiny")     # dim 128, 4 layers (ratios 0, 4, 16, 4), H 4 x D 128, window 8, 8 experts, k 2


def test_attended_slots_by_hand():
    # S = 8, window 8: a query at t sees t + 1 window rows
    assert attended(TINY, 0, 8) == (sum(range(1, 9)) / 8, 0.0)
    # ratio 4, top-k 4: t = 0..7 -> complete blocks 0,0,0,1,1,1,1,2 (sum 6), all under top-k, all indexed
    slots, keys = attended(TINY, 1, 8)
    assert slots == pytest.approx((36 + 6) / 8) and keys == pytest.approx(6 / 8)
    # ratio 16 at S = 32: blocks (t + 1) // 16 -> 16 positions see one, one sees two; window 8 caps at t >= 7
    slots, keys = attended(TINY, 2, 32)
    assert slots == pytest.approx((sum(min(8, t + 1) for t in range(32)) + 16 * 1 + 1 * 2) / 32) and keys == 0


def test_forward_flops_by_hand():
    d, H, D, ql, g, ol, inter, E, k, V = 128, 4, 128, 64, 2, 64, 64, 8, 2, 512
    S = 128
    proj = 2 * (d * ql + ql * H * D + d * D + (H * D // g) * g * ol + g * ol * d)     # wq_a wq_b wkv wo_a wo_b
    comp = lambda ratio, hd: 2 * 2 * (2 if ratio == 4 else 1) * hd * d               # wkv and wgate
    hand = {
        "attention projections": 4 * proj,
        "compressors": comp(4, D) + comp(16, D) + comp(4, D),
        "indexer": 2 * (2 * (ql * 4 * 64 + d * 4) + comp(4, 64)),                   # two ratio-4 layers
        "router": 4 * 2 * E * d,
        "routed experts": 4 * k * 3 * 2 * d * inter,
        "shared expert": 4 * 3 * 2 * d * inter,
        "hyper-connections": 4 * 2 * 2 * (2 + 4) * 4 * 4 * d + 2 * 4 * 4 * d,         # 2 mixes a layer + the head's
        "lm head": 2 * d * V,
    }
    attn = sum(4 * H * D * attended(TINY, i, S)[0] for i in range(4))
    keys = sum(2 * 4 * 64 * attended(TINY, i, S)[1] for i in range(4))
    got = forward_flops_per_token(TINY, S)
    assert all(math.isfinite(v) and v > 0 for v in got.values()), got
    for part, want in hand.items():
        extra = keys if part == "indexer" else 0
        assert got[part] == pytest.approx(want + extra), part
    assert got["sparse attention"] == pytest.approx(attn)
    assert set(got) == set(hand) | {"sparse attention"}


def test_training_is_three_forwards_and_recompute_a_fourth():
    fwd = sum(forward_flops_per_token(TINY, 64).values())
    assert train_flops_per_token(TINY, 64) == (3 * fwd, 3 * fwd)
    assert train_flops_per_token(TINY, 64, recompute=True) == (3 * fwd, 4 * fwd)
    assert sum(forward_flops_per_token(TINY, 64, mtp=True).values()) > fwd


def test_the_4layer_smoke_model_is_about_six_times_its_active_parameters():
    """The issue's estimate for the H200 smoke (4 layers, 8 experts): ~6 x 1.9 B active parameters per token."""
    cfg = ModelConfig.preset("4layer", n_routed_experts=8)
    model, _ = train_flops_per_token(cfg, 4096)
    assert math.isfinite(model)
    assert 0.85 < model / (6 * 1.9e9) < 1.0
