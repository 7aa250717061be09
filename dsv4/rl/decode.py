"""Incremental decoding of the DSV4 reference model: a KV cache for every attention kind, one token a step.

`dsv4.model.Transformer.forward` processes a whole sequence; this module runs the same modules one position
at a time for a batch, keeping per layer what later positions read:
* the sliding window: the last `window_size` raw latent rows, in a ring (slot = position % window);
* compressed entries (ratio 4 and the heavily compressed layers): every complete entry so far, plus the
  compressor's projected rows of the block being filled (and, for ratio 4, of the block before it, whose
  first channel half the overlapping window reads);
* the lightning indexer (ratio 4): its own compressed keys, pooled the same way.

Every sample of a batch sits at the same position at every step: a prompt is fed token by token through the
same step as the response (no separate prefill), and a sample starts sampling once its prompt is consumed.
That keeps block completion and the ring slot uniform across the batch (no per-sample branches, nothing
that stalls a GPU), at the cost of prefill speed on long prompts. Per position the arithmetic is the full
forward's, through the same functions (`compress`, `Compressor.finish`, `rope_tail`, `sparse_attn`, the
expert and hyper-connection modules), so cached decoding equals a full recompute up to summation order
(tests/rl/test_decode.py).

A step never synchronises with the host and its shapes do not depend on the position, so one CUDA graph of
it replays for every position (`GraphedStep`):
* the position is a 0-dim int64 tensor on the device; ring slots, block indices and masks are computed from
  it on the device, and cache rows are written with `index_copy_` at device indices;
* the compressors pool a block every step; when no block ends at this position the entry goes to a spare
  "trash" row past the real ones, which no index ever names (a masked write instead of a Python `if`);
* the MoE runs only the experts the batch chose, through grouped GEMMs over the assignments sorted by expert, with
  the experts' row counts from a scatter rather than `unique`/`bincount` on the host (`moe`, `ExpertStack`): at
  decode batch sizes the step is bound by reading weights, and one token reads 6 of Flash's 256 experts a layer.
  A batch that reads nearly every expert anyway runs them all, weighted by the routing (zero where not chosen),
  as two batched GEMMs, which use more of the bandwidth than a grouped GEMM of a dozen rows a group;

On a GPU the engine's step is faster than these functions run op by op, without other math:
* `Prepared` holds forms of the weights the step reads instead of the parameters: the fp32 head as two bf16
  halves (two tensor-core GEMMs on the exact bf16 input, fp32-grade: dsv4/kernels/split_gemm.py) and each
  layer's routed experts stacked for the grouped GEMMs (the experts' parameters made views of the stack where no
  QAT point changes them); the engine refreshes them in place after every update;
* the step's pure-torch parts are three kinds of regions around the attention kernel (`before_attention`,
  `after_attention`, `head_input`), which `GraphedStep` runs through torch.compile: inductor fuses the norms,
  rotations, routing and the MoE's elementwise work, and the Sinkhorn iterations run as one kernel
  (dsv4/kernels/triton_sinkhorn.py); at a few rows a step the hyper-connections take training's GPU forms (`GPU_HC`:
  the fp32 mixes GEMM split along K into one batched GEMM, C^T R as fused multiply-adds; `hc_forms` says where).
  Fused intermediates stay in fp32 where eager rounds them to bf16, so the
  compiled step differs from the eager one at bf16 level (tests/rl/test_engine_gpu.py holds both to the
  full forward's bounds).

The KV layout of one layer is one buffer [B, W + N + 1, D]: ring rows 0..W-1, compressed entries W..W+N-1,
the trash row last, so the sparse-attention kernel reads window and compressed rows through one index list,
as in training.

Every row a step reads was written earlier in the same sequence (slot s of the ring once position s has
passed, entry i once its block has ended, pool rows of the blocks being pooled), so a cache needs no reset
between sequences, and running a step twice at the same position with the same tokens leaves the cache as
once: `GraphedStep` relies on both (its warm-up steps are real steps; the engine reuses a graphed cache).
"""
from __future__ import annotations

import logging
import os
import threading
import warnings
from typing import Callable, NamedTuple

import torch

from dsv4 import quant
from dsv4.kernels import reference as kref
from dsv4.kernels import sparse_attn, split_gemm, triton_sinkhorn
from dsv4.model import (MoE, Attention, Block, Compressor, Transformer, _kv_fp8_qat, compress, fp32_linear, gated,
                        grouped_output, hadamard, hc_head, hc_mixes, hc_mixes_split, hc_post, hc_post_unrolled,
                        rms_norm, rope_cos_sin, rope_tail, sinkhorn)


class PoolState:
    """A compressor's projected rows (kv and gate, fp32) of the current block and, for ratio 4, the block
    before it: a ring of `2*ratio` (ratio 4) or `ratio` rows."""

    def __init__(self, comp: Compressor, batch: int, device):
        self.ratio = comp.ratio
        self.rows = 2 * comp.ratio if comp.ratio == 4 else comp.ratio
        width = comp.wkv.weight.shape[0]
        self.a = torch.zeros(batch, self.rows, width, device=device)
        self.g = torch.zeros(batch, self.rows, width, device=device)
        self.offsets = torch.arange(self.ratio, device=device)
        # ratio 4: the slots of the previous block, which block 0 does not have
        self.prev_slots = (torch.arange(2 * self.ratio, device=device) < self.ratio).view(1, -1, 1)

    def push(self, comp: Compressor, x: torch.Tensor, pos: torch.Tensor) -> None:
        xf = x.float()
        slot = (pos % self.rows).view(1)
        self.a.index_copy_(1, slot, comp.wkv(xf))
        self.g.index_copy_(1, slot, comp.wgate(xf))

    def pool(self, comp: Compressor, pos: torch.Tensor, freqs: torch.Tensor, dtype: torch.dtype):
        """-> (entry [B, 1, d], k): the entry of block k = (pos + 1) // ratio - 1, the block that ends at `pos`
        when (pos + 1) % ratio == 0. At other positions the block is not complete (or k is -1) and the entry
        is garbage for the caller to discard: pooling every step keeps the step free of host branches."""
        r = self.ratio
        k = (pos + 1) // r - 1
        cur = self.offsets + (k * r) % self.rows
        if r == 4:  # the overlapping window also reads the previous block
            sel = torch.cat([self.offsets + ((k - 1) * r) % self.rows, cur])
            a, g = self.a.index_select(1, sel), self.g.index_select(1, sel)
            # block 0 has no previous block: what compress() fills in for it (0 for kv, -inf for the gate); in
            # place, a and g being index_select's own copies
            first = self.prev_slots & (k == 0)
            a.masked_fill_(first, 0.0)
            g.masked_fill_(first, float("-inf"))
        else:
            a, g = self.a.index_select(1, cur), self.g.index_select(1, cur)
        c = compress(a, g, comp.ape, r, comp.head_dim)[:, -1:]
        return comp.finish(c, (k * r).view(1), freqs, dtype), k

    def select(self, keep: torch.Tensor) -> None:
        self.a, self.g = self.a[keep], self.g[keep]


class LayerCache:
    """What one attention layer keeps between steps (see the module docstring for the layout)."""

    def __init__(self, attn: Attention, batch: int, max_len: int, device, dtype):
        cfg = attn.cfg
        self.ratio = attn.ratio
        self.window = min(cfg.window_size, max_len)
        self.n_entries = max_len // self.ratio if self.ratio else 0
        trash = 1 if self.ratio else 0
        self.kv = torch.zeros(batch, self.window + self.n_entries + trash, cfg.head_dim, device=device, dtype=dtype)
        self.slots = torch.arange(self.window, device=device)
        self.pool = None
        if self.ratio:
            self.pool = PoolState(attn.compressor, batch, device)
            self.entries = torch.arange(self.n_entries, device=device)
        if self.ratio == 4:
            self.index_pool = PoolState(attn.indexer.compressor, batch, device)
            self.index_keys = torch.zeros(batch, self.n_entries + 1, cfg.index_head_dim, device=device, dtype=dtype)

    def select(self, keep: torch.Tensor) -> None:
        """Keep only the samples `keep` (indices into the batch), e.g. when others have finished. Not on a cache
        a `GraphedStep` has captured: the graph holds the old buffers."""
        self.kv = self.kv[keep]
        if self.pool is not None:
            self.pool.select(keep)
        if self.ratio == 4:
            self.index_pool.select(keep)
            self.index_keys = self.index_keys[keep]


class DecodeCache:
    def __init__(self, model: Transformer, batch: int, max_len: int):
        p = next(model.parameters())
        act = model.embed.weight.dtype
        self.batch, self.max_len, self.device = batch, max_len, p.device
        self.layers = [LayerCache(layer.attn, batch, max_len, p.device, act) for layer in model.layers]

    def select(self, keep: torch.Tensor) -> None:
        for lc in self.layers:
            lc.select(keep)
        self.batch = len(keep)


def attend_pre(attn: Attention, x: torch.Tensor, lc: LayerCache, pos: torch.Tensor):
    """Attention.forward up to the sparse attention, for one new position per sample: extends the layer's cache
    and returns what the kernel reads, (q [B, 1, H, D], idx [B, 1, K] int32 rows of lc.kv, cos, sin).
    x [B, 1, dim], pos 0-dim int64 on x's device."""
    cfg = attn.cfg
    W, N = lc.window, lc.n_entries
    B = x.shape[0]
    cos, sin = rope_cos_sin(attn.freqs, pos.view(1))
    qr = attn.q_norm(attn.wq_a(x))
    q = attn.wq_b(qr).unflatten(-1, (attn.n_heads, attn.head_dim))
    q = rope_tail(rms_norm(q, None, cfg.norm_eps), cos, sin)
    kv = rope_tail(attn.kv_norm(attn.wkv(x)), cos, sin)
    if cfg.qat_kv_fp8:
        kv = _kv_fp8_qat(kv, cfg.rope_head_dim)
    lc.kv.index_copy_(1, (pos % W).view(1), kv)
    # the ring fills slot s at position s, so slot s holds a position of the window iff s <= pos (all, once
    # pos >= W - 1): the ring now holds positions pos-W+1 .. pos
    idx = torch.where(lc.slots <= pos, lc.slots, -1).expand(B, 1, W)
    if lc.ratio:
        r = lc.ratio
        complete = (pos + 1) % r == 0
        n = (pos + 1) // r                      # complete entries visible to this position
        trash = lc.kv.shape[1] - 1
        lc.pool.push(attn.compressor, x, pos)
        entry, k = lc.pool.pool(attn.compressor, pos, attn.freqs, x.dtype)
        lc.kv.index_copy_(1, torch.where(complete, W + k, trash).view(1), entry)
        if r == 4:
            ix = attn.indexer
            lc.index_pool.push(ix.compressor, x, pos)
            key, _ = lc.index_pool.pool(ix.compressor, pos, attn.freqs, x.dtype)
            lc.index_keys.index_copy_(1, torch.where(complete, k, N).view(1), key)
            qi = ix.wq_b(qr).unflatten(-1, (ix.n_heads, ix.head_dim))
            qi = hadamard(rope_tail(qi, cos, sin))
            if cfg.qat_indexer_fp4:
                qi = quant.fp4_act_qdq(qi, 32)
            w = ix.weights_proj(x).float() * (ix.head_dim ** -0.5 * ix.n_heads ** -0.5)
            scores = kref.indexer_scores(qi, lc.index_keys[:, :N], w)         # [B, 1, N]
            sel = kref.indexer_topk(scores.masked_fill(lc.entries >= n, float("-inf")), cfg.index_topk)
            idx_c = torch.where(sel >= 0, sel + W, -1)
        else:
            idx_c = torch.where(lc.entries < n, lc.entries + W, -1).expand(B, 1, -1)
        idx = torch.cat([idx, idx_c], dim=-1)
    return q, idx.int().contiguous(), cos, sin


def attend_post(attn: Attention, o: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Attention.forward after the sparse attention: o [B, 1, H, D] -> [B, 1, dim]."""
    o = rope_tail(o, cos, sin, inverse=True)
    return attn.wo_b(grouped_output(o, attn.wo_a.qat_weight_value(), attn.cfg.o_groups))


def _expert_gemm(a: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, expert: torch.Tensor,
                 grouped: bool) -> torch.Tensor:
    """a [M, K] (rows grouped by expert, `offs` each expert's end) times each row's expert's w [E, K, N] -> [M, N] in
    a's dtype. `grouped`: one grouped GEMM (torch._grouped_mm: CUTLASS on Hopper in bf16, a loop over the groups on a
    CPU), which reads the weights of experts that have rows and no others; else (CUDA in another dtype or before
    Hopper, where the grouped kernel would read the offsets back to the host) a gather of each row's expert and a
    batched GEMM, also reading only the chosen experts. Kept out of torch.compile's graphs: the decode regions
    fuse the elementwise work around it, the GEMMs are library calls either way."""
    if grouped:
        return torch._grouped_mm(a, w, offs=offs)
    return torch.bmm(a.unsqueeze(1), w.index_select(0, expert)).squeeze(1)


_expert_gemm = torch.compiler.disable(_expert_gemm)


class ExpertStack:
    """A layer's routed experts as two stacked weights for grouped GEMMs over the experts a batch chose: w13
    [E, 2*inter, dim] (w1 over w3) and w2 [E, dim, inter].

    Where no expert weight has a QAT point (the weight is what its GEMM reads), the experts' parameters become views
    of the stack (`share`): no second copy of the layer's routed experts (12.9 GB a layer at Flash's 256), and an
    in-place update of a parameter is the stack's at once. Otherwise the stack is a copy through each weight's QAT
    point, refreshed in place after the experts change (`refresh`)."""

    def __init__(self, ffn: MoE, share: bool = True):
        self.ffn = ffn
        e0 = ffn.experts[0]
        inter, dim = e0.w1.weight.shape
        E, dt, dev = len(ffn.experts), e0.w1.weight.dtype, e0.w1.weight.device
        self.w13 = torch.empty(E, 2 * inter, dim, dtype=dt, device=dev)
        self.w2 = torch.empty(E, dim, inter, dtype=dt, device=dev)
        self.share = share and all(lin.qat_weight is None for ex in ffn.experts for lin in (ex.w1, ex.w2, ex.w3))
        self.grouped = dev.type == "cpu" or (dt == torch.bfloat16 and torch.cuda.get_device_capability(dev)[0] >= 9)
        self.dense_from = dense_from(E, ffn.gate.cfg.n_activated_experts)
        self.refresh()

    def _views(self, e: int):
        inter = self.w2.shape[-1]
        return self.w13[e, :inter], self.w13[e, inter:], self.w2[e]

    def shared(self) -> bool:
        """Whether every expert's parameters are (still) views of the stack: a parameter given new storage
        (`p.data = ...`) is not."""
        return self.share and all(lin.weight.data_ptr() == v.data_ptr() for e, ex in enumerate(self.ffn.experts)
                                  for lin, v in zip((ex.w1, ex.w3, ex.w2), self._views(e)))

    @torch.no_grad()
    def refresh(self) -> None:
        if self.shared():
            return
        for e, ex in enumerate(self.ffn.experts):
            for lin, view in zip((ex.w1, ex.w3, ex.w2), self._views(e)):
                view.copy_(lin.qat_weight_value())
                if self.share:
                    lin.weight.data = view

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor, limit: float) -> torch.Tensor:
        """sum_j weights[:, j] * expert_{idx[:, j]}(x), fp32 [T, dim], with Expert.forward's roundings (GEMM outputs
        in x's dtype, the activation scaled then cast before w2): `grouped` over the chosen experts, or `dense`
        over every expert where a batch this large reads nearly all of them anyway (`dense_from`)."""
        if x.shape[0] >= self.dense_from:
            return self.dense(x, weights, idx, limit)
        return self.grouped_sum(x, weights, idx, limit)

    def dense(self, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor, limit: float) -> torch.Tensor:
        """Every expert on every row, its activation scaled by the row's routing weight for it (0 where not chosen):
        two batched GEMMs over the stack, the sum over experts a reduction in fp32. A row routed twice to one
        expert gets the two weights summed, which w2's linearity makes MoE.forward's two passes up to round-off."""
        dense = torch.zeros(x.shape[0], self.w2.shape[0], dtype=weights.dtype, device=x.device)
        dense.scatter_add_(1, idx, weights)
        h = torch.matmul(x, self.w13.transpose(1, 2)).float()              # [E, T, 2*inter]
        g, u = h.chunk(2, dim=-1)
        a = gated(g, u, dense.t().unsqueeze(-1), limit, x.dtype)
        return torch.matmul(a, self.w2.transpose(1, 2)).float().sum(0)

    def grouped_sum(self, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor, limit: float) -> torch.Tensor:
        """The chosen experts only. The T*k assignments are sorted by expert (stable:
        tokens ascending within an expert, as MoE.forward's `where` lists them), two GEMMs run over the chosen
        experts only (`_expert_gemm`), and each row's k terms are added in ascending expert order, as MoE.forward's
        loop over experts adds them. A row routed twice to one expert passes through it twice, as there. No host
        synchronisation: the counts per expert come from a scatter, not a `bincount` (which sizes its output on
        the host)."""
        T, k = idx.shape
        E = self.w2.shape[0]
        flat = idx.reshape(-1)
        expert, order = torch.sort(flat, stable=True)
        counts = torch.zeros(E, dtype=torch.long, device=x.device).scatter_add_(0, flat, torch.ones_like(flat))
        offs = counts.cumsum(0).to(torch.int32)
        rows = x.index_select(0, order // k)
        h = _expert_gemm(rows, self.w13.transpose(1, 2), offs, expert, self.grouped)       # [T*k, 2*inter]
        g, u = h.chunk(2, dim=-1)
        a = gated(g, u, weights.reshape(-1).index_select(0, order).unsqueeze(-1), limit, x.dtype)
        out = _expert_gemm(a, self.w2.transpose(1, 2), offs, expert, self.grouped)         # [T*k, dim]
        # where each (row, slot) landed in the sorted order, then each row's slots by ascending expert
        where = torch.empty_like(order).scatter_(0, order, torch.arange(T * k, device=x.device))
        by_expert = torch.sort(idx, dim=1, stable=True).indices
        terms = out.index_select(0, where.view(T, k).gather(1, by_expert).reshape(-1)).view(T, k, -1).float()
        y = terms[:, 0]
        for j in range(1, k):
            y = y + terms[:, j]
        return y


DENSE_SHARE = 0.9     # the expected share of a layer's experts a batch reads, from which all of them are run


def dense_from(experts: int, k: int) -> int:
    """The smallest batch whose top-k routing reads, in expectation, DENSE_SHARE of the experts (1 - (1 - k/E)^T):
    from there on the grouped GEMMs read nearly every expert anyway, at a dozen rows a group, and two batched GEMMs
    over all of them run at more of the bandwidth (H200, 4-layer model, 32 experts, torch attention: batch 16 3.83
    ms against 4.56 grouped, batch 64 4.52 against 5.25; batch 1 3.26 against 2.44). 2 for the smoke's 8 experts
    at top-6, 12 for 32, 98 for Flash's 256."""
    import math
    if k >= experts:
        return 1
    return max(1, math.ceil(math.log(1 - DENSE_SHARE) / math.log(1 - k / experts)))


def moe(ffn: MoE, x: torch.Tensor, input_ids: torch.Tensor,
        stack: ExpertStack | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """MoE.forward without host synchronisation -> (output like x, experts [T, k] the router chose).

    The routed experts run only on the rows that chose them, through grouped GEMMs over the chosen experts
    (`ExpertStack`): a step reads the weights of the experts its batch routes to, which at decode batch sizes
    is what bounds it (6 of 256 experts a layer for one token at Flash's routing). Each row's sum over its experts
    is MoE.forward's, in the same order, up to the GEMMs' round-off on another grouping of rows. A batch that
    reads nearly every expert anyway (`dense_from`: 12 tokens at 32 experts, 98 at 256) runs them all, weighted
    by the routing, zero where not chosen. `stack`: the engine's prepared stack of the layer's experts; without
    one, the experts are stacked for this call (a copy of every expert's weights: for tests and CPU callers that
    hold no prepared weights)."""
    shape = x.shape
    x = x.reshape(-1, shape[-1])
    weights, idx = ffn.gate(x, input_ids.reshape(-1))
    if stack is None:
        stack = ExpertStack(ffn, share=False)
    y = stack(x, weights, idx, ffn.experts[0].swiglu_limit)
    y = y + ffn.shared_experts(x).float()
    return y.to(x.dtype).view(shape), idx


def as_position(pos: int | torch.Tensor, device) -> torch.Tensor:
    """A position as the 0-dim int64 device tensor `step` takes. From a Python int by a fill kernel (no
    host-to-device copy, which would synchronise)."""
    if isinstance(pos, torch.Tensor):
        return pos.reshape(()).to(device=device, dtype=torch.long)
    return torch.full((), pos, dtype=torch.long, device=device)


# The step in three kinds of pure-torch regions around the attention kernel, so that on a GPU each region can
# be compiled (`compiled_regions`): the hyper-connections' Sinkhorn iterations, the norms and rotations and the
# MoE's elementwise work are hundreds of tiny kernels a layer, which inductor fuses into a few.
def _sinkhorn_for(X: torch.Tensor, hc: int):
    """The fused Sinkhorn kernel where it runs (CUDA), else the reference."""
    return triton_sinkhorn.sinkhorn if triton_sinkhorn.available(X, hc) else sinkhorn


class HCForms(NamedTuple):
    mixes: Callable
    post: Callable


REFERENCE_HC = HCForms(hc_mixes, hc_post)
# as training's compiled hyper-connections (dsv4/megatron/layers.py FUSABLE_HC): the mixes GEMM [B, hc*dim] @
# [hc*dim, 24] in fp32 split along K into one batched GEMM (unsplit, a decode batch's few rows leave cuBLAS a block or
# two walking all 16,384 of K), C^T R as multiply-adds that inductor fuses into the output's kernel
GPU_HC = HCForms(hc_mixes_split, hc_post_unrolled)


# rows a step (batch x tokens) up to which a CUDA step takes GPU_HC. On the H200 at 32 experts, 4 layers: batch 1
# took 2.11 ms a step with GPU_HC (cccd6ba) and 2.17 with the reference forms (ad6970e); batch 64 took 4.40 with
# GPU_HC, whose split mixes GEMM ran as cuBLAS's fp32 SIMT kernel (0.31 ms a step in 10 launches), and 3.93 with the
# reference's (benchmarks/records/rollout.jsonl). Between the two the crossover is not measured.
HC_SPLIT_ROWS = 16


def hc_forms(X: torch.Tensor) -> HCForms:
    """GPU_HC on CUDA at up to HC_SPLIT_ROWS rows; the reference's otherwise (the CPU tests hold the two equal)."""
    return GPU_HC if X.is_cuda and X.shape[0] * X.shape[1] <= HC_SPLIT_ROWS else REFERENCE_HC


def before_attention(layer: Block, X: torch.Tensor, lc: LayerCache, pos: torch.Tensor):
    hc = hc_forms(X)
    x, post, comb = layer._hc_pre(X, "attn", _sinkhorn_for(X, layer.cfg.hc_mult), hc.mixes)
    q, idx, cos, sin = attend_pre(layer.attn, layer.attn_norm(x), lc, pos)
    return q, idx, cos, sin, post, comb


def after_attention(layer: Block, o, X, post, comb, cos, sin, tok, stack: "ExpertStack | None" = None):
    hc = hc_forms(X)
    X = hc.post(attend_post(layer.attn, o, cos, sin), X, post, comb)
    x, post, comb = layer._hc_pre(X, "ffn", _sinkhorn_for(X, layer.cfg.hc_mult), hc.mixes)
    y, chosen = moe(layer.ffn, layer.ffn_norm(x), tok, stack)
    return hc.post(y, X, post, comb), chosen


def head_input(model: Transformer, X: torch.Tensor) -> torch.Tensor:
    """The streams contracted and normed: the head GEMM's input [B, 1, dim] (the norm's dtype: bf16 values are exact
    and the split GEMM skips their lo half)."""
    y = hc_head(X, model.hc_head_fn, model.hc_head_scale, model.hc_head_base, model.cfg.hc_eps, model.cfg.norm_eps,
                hc_forms(X).mixes)
    return model.norm(y)


class Regions(NamedTuple):
    before: Callable
    after: Callable
    head: Callable


EAGER = Regions(before_attention, after_attention, head_input)
_compiled: Regions | None = None


def compiled_regions() -> Regions:
    """The regions through torch.compile (inductor), compiled at their first call per layer kind and shape.
    Dynamo inlines the layer modules with their parameters as inputs, so layers of the same kind (compression
    ratio, hash routing) share one compiled graph."""
    global _compiled
    if _compiled is None:
        import torch._dynamo
        dyn = torch._dynamo.config
        # one graph per layer kind per (rows, capacity) the engine decodes with: more than the default limit
        for key in ("recompile_limit", "cache_size_limit"):
            if hasattr(dyn, key):
                setattr(dyn, key, max(getattr(dyn, key), 64))
        _compiled = Regions(*(torch.compile(f, dynamic=False) for f in EAGER))
    return _compiled


class Prepared:
    """Forms of the model's weights that the decode step reads in place of the parameters: each layer's stacked
    routed experts and, on CUDA, the head's bf16 halves (cfg.fp32_gemm bf16x3 or bf16x3_fwd; a CPU runs the head's
    fp32 GEMM). Built once per engine and shared by its decoders; `refresh()` after the weights change in place
    rewrites them in place, so captured graphs see the new values. Costs a second copy of the head, and of the
    routed experts only where a QAT point changes them (otherwise the experts' parameters are views of the stacks,
    see ExpertStack)."""

    def __init__(self, model: Transformer):
        split = model.cfg.fp32_gemm != "fp32" and model.head.weight.is_cuda
        self.head = split_gemm.SplitWeight(model.head.weight) if split else None
        self.experts = [ExpertStack(layer.ffn) for layer in model.layers]

    @classmethod
    def of(cls, model: Transformer) -> "Prepared":
        """The engine's prepared weights (on a CPU too: the decode MoE reads the stacked experts)."""
        return cls(model)

    def refresh(self) -> None:
        if self.head is not None:
            self.head.refresh()
        for st in self.experts:
            st.refresh()


@torch.no_grad()
def step(model: Transformer, cache: DecodeCache, ids: torch.Tensor, pos: int | torch.Tensor,
         prepared: Prepared | None = None, regions: Regions = EAGER):
    """Feed token `ids` [B] at position `pos` (a 0-dim int64 device tensor, or an int) -> (logits [B, V] fp32
    for position pos + 1, routes [B, n_layers, k] int64: the experts each layer chose for these tokens).
    No host synchronisation, and the same kernels on the same shapes at every position. `prepared`: the
    engine's `Prepared` weights, else the parameters themselves (the experts stacked for each call); `regions`: EAGER
    or compiled_regions()."""
    cfg = model.cfg
    pos = as_position(pos, ids.device)
    tok = ids.reshape(-1, 1)
    X = model.embed(tok).unsqueeze(2).repeat(1, 1, cfg.hc_mult, 1)
    stacks = prepared.experts if prepared is not None else [None] * len(model.layers)
    routes = []
    for layer, lc, stack in zip(model.layers, cache.layers, stacks):
        q, idx, cos, sin, post, comb = regions.before(layer, X, lc, pos)
        o = sparse_attn(q, lc.kv, layer.attn.attn_sink, idx, layer.attn.softmax_scale, impl=cfg.attn_impl)
        X, chosen = regions.after(layer, o, X, post, comb, cos, sin, tok, stack)
        routes.append(chosen)
    y = regions.head(model, X)
    head = prepared.head if prepared is not None else None
    logits = head.linear(y) if head is not None else fp32_linear(y, model.head.weight, cfg)
    return logits[:, 0], torch.stack(routes, dim=1)


# =============================================================================================== CUDA graphs
class GraphedStep:
    """`step` on one cache, captured in a CUDA graph at its first call and replayed at every later one.

    Call it as `decoder(ids, pos)` -> (logits, routes), like `step`. With a graph the inputs are copied into
    static buffers and the outputs are the graph's own tensors, overwritten by the next call: consume or copy
    them first (work queued on the same stream is ordered before the next replay, so that needs no sync).

    The capture happens at the first call, at that call's position and tokens: two eager warm-up steps
    (which compile and load kernels, TileLang's and inductor's included, and settle cuBLAS's workspaces outside
    the capture), then the capture, then the replay that produces the outputs. All three write the same cache
    rows with the same values (see the module docstring), so the sequence is as if the step ran once.

    `compiled` (default: with the graph, unless DSV4_DECODE_COMPILE=0) runs the step's regions through
    torch.compile; where compiling fails the capture is retried without it, with a warning, and no later
    instance compiles. `prepared`: the engine's `Prepared` weights, shared by its decoders.

    Falls back to the eager step on a CPU, with `graph=False`, and, with a warning, when a capture fails (e.g.
    a QAT point that builds a table on the host at each call); after one failure no later instance tries.
    The graph holds the addresses of the model's parameters and of the cache: updating weights in place
    (`copy_`) is seen by the next replay, replacing a parameter's storage (`p.data = ...`) or `cache.select`
    is not."""

    _capture_lock = threading.Lock()         # one capture at a time in the process
    capture_failed: str | None = None        # why the last capture failed (then graphs stay off)
    compile_failed: str | None = None        # why compiling the regions failed (then regions stay eager)

    def __init__(self, model: Transformer, cache: DecodeCache, graph: bool = True, compiled: bool | None = None,
                 prepared: Prepared | None = None):
        self.model, self.cache, self.prepared = model, cache, prepared
        dev = cache.device
        self.ids = torch.zeros(cache.batch, dtype=torch.long, device=dev)
        self.pos = torch.zeros((), dtype=torch.long, device=dev)
        self.use_graph = graph and dev.type == "cuda" and GraphedStep.capture_failed is None
        if compiled is None:
            compiled = self.use_graph and os.environ.get("DSV4_DECODE_COMPILE", "1") != "0"
        self.compiled = compiled and GraphedStep.compile_failed is None
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def graphed(self) -> bool:
        return self.graph is not None

    @property
    def regions(self) -> Regions:
        return compiled_regions() if self.compiled else EAGER

    def __call__(self, ids: torch.Tensor, pos: int | torch.Tensor):
        self.ids.copy_(ids)
        if isinstance(pos, torch.Tensor):
            self.pos.copy_(pos.reshape(()))
        else:
            self.pos.fill_(pos)                # a kernel argument: no host-to-device copy
        if self.use_graph and self.graph is None:
            self._capture()
        if self.graph is not None:
            self.graph.replay()
            return self.out
        return step(self.model, self.cache, self.ids, self.pos, self.prepared, self.regions)

    def _capture(self) -> None:
        try:
            self._try_capture()
        except Exception as e:  # noqa: BLE001 - compiling failed, or the capture: retry without compiling, then eager
            if self.compiled:
                GraphedStep.compile_failed = f"{type(e).__name__}: {e}"
                self.compiled = False
                logging.getLogger(__name__).warning("compiling the decode step failed", exc_info=True)
                warnings.warn(f"compiling the decode step failed ({GraphedStep.compile_failed}); capturing it "
                              "uncompiled", RuntimeWarning, stacklevel=3)
                self._capture()
                return
            GraphedStep.capture_failed = f"{type(e).__name__}: {e}"
            self.use_graph, self.graph, self.out = False, None, None
            logging.getLogger(__name__).warning("CUDA graph capture failed", exc_info=True)   # the traceback
            warnings.warn(f"CUDA graph capture of the decode step failed ({GraphedStep.capture_failed}); "
                          "decoding eagerly from now on", RuntimeWarning, stacklevel=3)

    def _try_capture(self) -> None:
        dev = self.cache.device
        args = (self.model, self.cache, self.ids, self.pos, self.prepared, self.regions)
        with GraphedStep._capture_lock, torch.cuda.device(dev):
            side = torch.cuda.Stream(dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                for _ in range(2):
                    step(*args)
            torch.cuda.current_stream(dev).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            # thread_local: other threads (a trainer) may keep using CUDA while this one captures
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                out = step(*args)
        self.graph, self.out = graph, out
