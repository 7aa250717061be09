"""Context parallelism (CP > 1) computes what one process computes.

The CP layouts of mt_harness (CP2 alone at two lengths, CP2 x TP2, CP2 x PP2, CP2 x EP2 with DP2, CP4) run in
real gloo process groups with the real megatron-core DDP, optimizer and schedules on the tiny model with every
path on (CSA with indexer and its KL loss, HCA, MTP, hash routing), one optimizer step and one more forward on
the same global batch as world size 1 at the same length. Loss, gradient norm, every reduced gradient and the
loss after the update are held to the tolerances of the layout table (mt_harness). Figures are printed (-s).

The geometry tests below check the pieces the equivalence depends on, without processes.
"""
from __future__ import annotations

import json

import pytest
import torch

import mt_harness as H
from dsv4.megatron import cp_attention as cpa
from dsv4.megatron.parallel import CPSplit, Layout


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    d = tmp_path_factory.mktemp("cp_layouts")
    base = H.run(H.CP_BASE, 1, d)
    out = H.run(H.CP_WORLD2, 2, d)
    out.update(H.run(H.CP_WORLD4, 4, d))
    return base, out


@pytest.mark.parametrize("spec", H.CP_WORLD2 + H.CP_WORLD4, ids=lambda s: s.name)
def test_cp_layout_matches_one_process(results, spec):
    base, out = results
    figures = H.assert_matches(out[spec.name], base[f"w1_s{spec.seq_len}"], spec.name)
    print(f"\n{spec.name}: {json.dumps(figures)}")


# ---------------------------------------------------------------------------------------------- geometry
@pytest.mark.parametrize("cp,S", [(2, 72), (2, 24), (4, 72), (3, 30)])
def test_split_covers_the_sequence_once_and_balances_it(cp, S):
    parts = [CPSplit(cp, r, S) for r in range(cp)]
    pos = torch.cat([p.positions() for p in parts])
    assert torch.equal(pos.sort().values, torch.arange(S))
    # causal work of a query at t is t+1 keys: each rank gets the same total
    work = {int((p.positions() + 1).sum()) for p in parts}
    assert len(work) == 1
    for ratio in (4, 16):
        assert sum(cpa.entries_per_chunk(parts[0], ratio)) == S // ratio


def test_entries_of_a_chunk_are_the_reference_compressor_rows():
    """chunk_entries on extended rows equals the whole-sequence Compressor at every chunk edge (overlap and
    plain ratios, chunks not a multiple of the ratio), so gathering them rebuilds the reference entries."""
    from dsv4 import model as ref
    from dsv4.config import ModelConfig
    torch.manual_seed(0)
    cfg = ModelConfig.preset("tiny")
    for ratio in (4, 16):
        comp = ref.Compressor(cfg, ratio, cfg.head_dim)
        for p in comp.parameters():
            p.data.copy_(torch.randn(p.shape) * 0.3)
        freqs = ref.layer_rope_freqs(cfg, 1)
        S, cp = 72, 2
        x = torch.randn(2, S, cfg.dim)
        want = comp(x, freqs)
        got = []
        for c in range(2 * cp):
            split = CPSplit(cp, c if c < cp else 2 * cp - 1 - c, S)
            g, L = c * split.L, split.L
            start = max(0, g - cpa.halo_reach(cfg.window_size, ratio))
            got.append(cpa.chunk_entries(comp, x[:, start:g + L], start, g, L, freqs, x.dtype))
        got = torch.cat(got, dim=1)
        assert got.shape == want.shape and torch.isfinite(got).all()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_window_rows_are_the_reference_window():
    """Mapped back to global positions, each chunk's window rows are window_topk_idxs's."""
    from dsv4 import model as ref
    S, W, cp = 24, 8, 2
    want = ref.window_topk_idxs(S, W)
    for r in range(cp):
        split = CPSplit(cp, r, S)
        for g in split.starts:
            start = max(0, g - (W - 1))
            idx = cpa.window_idxs(g, split.L, S, W, start, 100, None)
            glob = torch.where(idx >= 0, idx - 100 + start, -1)
            assert torch.equal(glob.int(), want[g:g + split.L])


def test_indexer_kernel_split_masks_like_the_reference(monkeypatch):
    """The TileLang path scores a chunk in two parts (entries before the chunk unmasked, head by head; the
    rest through the kernel, which masks by row within the call). The kernel's own contract is its torch
    reference (tests/kernels check the two agree); here it stands in so the split runs on a CPU."""
    import dsv4.kernels as K
    from dsv4.kernels import reference as kref
    monkeypatch.setattr(K, "indexer_logits", lambda q, k, w, ratio, impl="torch": kref.indexer_logits_ref(q, k, w, ratio))
    torch.manual_seed(1)
    S, cp = 64, 2
    q, k, w = torch.randn(1, S, 4, 16), torch.randn(1, S // 4, 16), torch.rand(1, S, 4)
    want = kref.indexer_logits_ref(q, k, w, 4)
    for r in range(cp):
        split = CPSplit(cp, r, S)
        pos = split.positions()
        got = cpa.indexer_logits(q[:, pos], k, w[:, pos], split, "tilelang")
        torch.testing.assert_close(got, want[:, pos], rtol=1e-5, atol=1e-5)
        assert torch.equal(torch.isinf(got), torch.isinf(want[:, pos]))


def test_layout_checks_cp():
    from dsv4.config import ModelConfig
    cfg = ModelConfig.preset("tiny")
    Layout(cp=2, tp=2).validate(cfg, 4, 72)
    with pytest.raises(ValueError, match="2\\*CP"):
        Layout(cp=2).validate(cfg, 2, 70)
    with pytest.raises(ValueError, match="TP\\*PP\\*CP"):
        Layout(cp=2, tp=2).validate(cfg, 2, 72)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("cp,S", [(2, 2048), (4, 2048), (2, 2040)])    # 2040: chunks of 510, not multiples of 4
def test_indexer_split_with_the_tilelang_kernel(cp, S):
    """The same split with the real TileLang indexer kernel (bf16 inputs) at V4's indexer shape, against the
    fp32 reference of the whole sequence: the same entries masked, the scores within the kernel's own
    tolerance (tests/kernels/test_tilelang_gpu.py), the same top-k but for near-ties."""
    pytest.importorskip("tilelang")
    from dsv4.kernels import reference as kref
    g = torch.Generator().manual_seed(4)
    Hi, Di = 64, 128
    q = torch.randn(1, S, Hi, Di, generator=g).cuda().bfloat16()
    k = torch.randn(1, S // 4, Di, generator=g).cuda().bfloat16()
    w = (torch.randn(1, S, Hi, generator=g) * (Hi * Di) ** -0.5).cuda()
    want = kref.indexer_logits_ref(q.float(), k.float(), w, 4)
    for r in range(cp):
        split = CPSplit(cp, r, S)
        pos = split.positions("cuda")
        got = cpa.indexer_logits(q[:, pos], k, w[:, pos], split, "tilelang")
        ref_rows = want[:, pos]
        visible = torch.isfinite(ref_rows)
        assert torch.equal(torch.isfinite(got), visible)
        err = (got[visible].double() - ref_rows[visible].double()).norm().item()
        assert err <= 1e-4 * ref_rows[visible].double().norm().item() + 1e-6
        top = kref.indexer_topk(got, 16).sort(-1).values
        top_ref = kref.indexer_topk(ref_rows, 16).sort(-1).values
        assert (top == top_ref).float().mean() > 0.99
