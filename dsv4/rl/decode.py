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
MoE and hyper-connection modules), so cached decoding equals a full recompute up to summation order
(tests/rl/test_decode.py).

The KV layout of one layer is one buffer [B, W + N, D]: ring rows 0..W-1, compressed entries from row W,
so the sparse-attention kernel reads window and compressed rows through one index list, as in training.
"""
from __future__ import annotations

import torch

from dsv4.kernels import reference as kref
from dsv4.kernels import sparse_attn
from dsv4.model import (Attention, Compressor, Transformer, _kv_fp8_qat, compress, grouped_output, hadamard,
                        hc_post, rms_norm, rope_cos_sin, rope_tail)
from dsv4 import quant


class PoolState:
    """A compressor's projected rows (kv and gate, fp32) of the current block and, for ratio 4, the block
    before it: a ring of `2*ratio` (ratio 4) or `ratio` rows."""

    def __init__(self, comp: Compressor, batch: int, device):
        self.ratio = comp.ratio
        self.rows = 2 * comp.ratio if comp.ratio == 4 else comp.ratio
        width = comp.wkv.weight.shape[0]
        self.a = torch.zeros(batch, self.rows, width, device=device)
        self.g = torch.zeros(batch, self.rows, width, device=device)

    def push(self, comp: Compressor, x: torch.Tensor, pos: int) -> None:
        xf = x.float()
        self.a[:, pos % self.rows] = comp.wkv(xf)[:, 0]
        self.g[:, pos % self.rows] = comp.wgate(xf)[:, 0]

    def pool(self, comp: Compressor, pos: int, freqs: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The entry of the block that ends at `pos` ((pos + 1) % ratio == 0) -> [B, 1, d]."""
        r, k = self.ratio, (pos + 1) // self.ratio - 1
        cur = torch.arange(r, device=self.a.device) + (k * r) % self.rows
        if r == 4:  # the overlapping window also reads the previous block; block 0 has none
            prev = torch.arange(r, device=self.a.device) + ((k - 1) * r) % self.rows
            a, g = self.a[:, torch.cat([prev, cur])], self.g[:, torch.cat([prev, cur])]
            if k == 0:  # what compress() fills in for the block before the first (0 for kv, -inf for the gate)
                a[:, :r], g[:, :r] = 0.0, float("-inf")
        else:
            a, g = self.a[:, cur], self.g[:, cur]
        c = compress(a, g, comp.ape, r, comp.head_dim)[:, -1:]
        return comp.finish(c, torch.tensor([k * r], device=a.device), freqs, dtype)

    def select(self, keep: torch.Tensor) -> None:
        self.a, self.g = self.a[keep], self.g[keep]


class LayerCache:
    """What one attention layer keeps between steps (see the module docstring for the layout)."""

    def __init__(self, attn: Attention, batch: int, max_len: int, device, dtype):
        cfg = attn.cfg
        self.ratio = attn.ratio
        self.window = min(cfg.window_size, max_len)
        self.n_entries = max_len // self.ratio if self.ratio else 0
        self.kv = torch.zeros(batch, self.window + self.n_entries, cfg.head_dim, device=device, dtype=dtype)
        self.win_pos = torch.full((self.window,), -1, dtype=torch.long, device=device)
        self.pool = PoolState(attn.compressor, batch, device) if self.ratio else None
        if self.ratio == 4:
            self.index_pool = PoolState(attn.indexer.compressor, batch, device)
            self.index_keys = torch.zeros(batch, self.n_entries, cfg.index_head_dim, device=device, dtype=dtype)

    def select(self, keep: torch.Tensor) -> None:
        """Keep only the samples `keep` (indices into the batch), e.g. when others have finished."""
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
        self.max_len = max_len
        self.layers = [LayerCache(layer.attn, batch, max_len, p.device, act) for layer in model.layers]

    def select(self, keep: torch.Tensor) -> None:
        for lc in self.layers:
            lc.select(keep)

    def nbytes(self) -> int:
        def size(t):
            return t.numel() * t.element_size()
        total = 0
        for lc in self.layers:
            total += size(lc.kv)
            if lc.pool is not None:
                total += size(lc.pool.a) + size(lc.pool.g)
            if lc.ratio == 4:
                total += size(lc.index_pool.a) + size(lc.index_pool.g) + size(lc.index_keys)
        return total


def attend(attn: Attention, x: torch.Tensor, lc: LayerCache, pos: int) -> torch.Tensor:
    """Attention.forward for one new position per sample, reading and extending the layer's cache.
    x [B, 1, dim] -> [B, 1, dim]."""
    cfg = attn.cfg
    W = lc.window
    cos, sin = rope_cos_sin(attn.freqs, torch.tensor([pos], device=x.device))
    qr = attn.q_norm(attn.wq_a(x))
    q = attn.wq_b(qr).unflatten(-1, (attn.n_heads, attn.head_dim))
    q = rope_tail(rms_norm(q, None, cfg.norm_eps), cos, sin)
    kv = rope_tail(attn.kv_norm(attn.wkv(x)), cos, sin)
    if cfg.qat_kv_fp8:
        kv = _kv_fp8_qat(kv, cfg.rope_head_dim)
    lc.kv[:, pos % W] = kv[:, 0]
    lc.win_pos[pos % W] = pos                   # the ring now holds positions pos-W+1 .. pos: the window
    B = x.shape[0]
    idx = torch.where(lc.win_pos >= 0, torch.arange(W, device=x.device), -1).expand(B, 1, W)
    if lc.ratio:
        r = lc.ratio
        complete = (pos + 1) % r == 0
        lc.pool.push(attn.compressor, x, pos)
        if complete:
            lc.kv[:, W + (pos + 1) // r - 1] = lc.pool.pool(attn.compressor, pos, attn.freqs, x.dtype)[:, 0]
        n = (pos + 1) // r                      # complete entries visible to this position
        if r == 4:
            ix = attn.indexer
            lc.index_pool.push(ix.compressor, x, pos)
            if complete:
                lc.index_keys[:, n - 1] = lc.index_pool.pool(ix.compressor, pos, attn.freqs, x.dtype)[:, 0]
            qi = ix.wq_b(qr).unflatten(-1, (ix.n_heads, ix.head_dim))
            qi = hadamard(rope_tail(qi, cos, sin))
            if cfg.qat_indexer_fp4:
                qi = quant.fp4_act_qdq(qi, 32)
            w = ix.weights_proj(x).float() * (ix.head_dim ** -0.5 * ix.n_heads ** -0.5)
            scores = kref.indexer_scores(qi, lc.index_keys, w)                 # [B, 1, N]
            visible = torch.arange(lc.n_entries, device=x.device) < n
            sel = kref.indexer_topk(scores.masked_fill(~visible, float("-inf")), cfg.index_topk)
            idx_c = torch.where(sel >= 0, sel + W, -1)
        else:
            i = torch.arange(lc.n_entries, device=x.device)
            idx_c = torch.where(i < n, i + W, -1).expand(B, 1, -1)
        idx = torch.cat([idx, idx_c], dim=-1)
    o = sparse_attn(q, lc.kv, attn.attn_sink, idx.int().contiguous(), attn.softmax_scale, impl=cfg.attn_impl)
    o = rope_tail(o, cos, sin, inverse=True)
    return attn.wo_b(grouped_output(o, attn.wo_a.weight, cfg.o_groups))


@torch.no_grad()
def step(model: Transformer, cache: DecodeCache, ids: torch.Tensor, pos: int):
    """Feed token `ids` [B] at position `pos` -> (logits [B, V] fp32 for position pos + 1,
    routes [B, n_layers, k] int: the experts each layer chose for these tokens)."""
    cfg = model.cfg
    tok = ids.view(-1, 1)
    X = model.embed(tok).unsqueeze(2).repeat(1, 1, cfg.hc_mult, 1)
    routes = []
    for layer, lc in zip(model.layers, cache.layers):
        x, post, comb = layer._hc_pre(X, "attn")
        X = hc_post(attend(layer.attn, layer.attn_norm(x), lc, pos), X, post, comb)
        x, post, comb = layer._hc_pre(X, "ffn")
        X = hc_post(layer.ffn(layer.ffn_norm(x), tok), X, post, comb)
        routes.append(layer.ffn.last_expert_idx)
    logits = model.head_logits(X, model.hc_head_fn, model.hc_head_scale, model.hc_head_base, model.norm)
    return logits[:, 0], torch.stack(routes, dim=1)
