"""Kernel dispatchers the model calls.

Each op has a pure-torch reference (`impl="torch"`, dsv4/kernels/reference.py) and a TileLang kernel
(`impl="tilelang"`). TileLang is imported only when asked for, so importing this module (and the model)
costs no compiler start-up and works where TileLang is not installed.

Conventions shared by both implementations (see docs/kernels.md):
- `topk_idxs == -1` marks a padded slot: it contributes nothing, and its KV row is never read.
- `attn_sink[h]` is a logit in the scaled-score space; it enters the softmax denominator only.
- A row with no valid index returns 0 (the sink alone takes all the probability mass).
"""
from __future__ import annotations

IMPLS = ("torch", "tilelang")


def _check_impl(impl: str, op: str) -> None:
    if impl not in IMPLS:
        raise ValueError(f"{op}: unknown impl {impl!r}; choose one of {IMPLS} (config key for the attention impl)")


def sparse_attn(q, kv, attn_sink, topk_idxs, softmax_scale: float, impl: str = "torch"):
    """Sparse MQA attention with sink. q[B,S,H,D], kv[B,N,D], attn_sink[H] fp32, topk_idxs[B,S,K] int32
    -> o[B,S,H,D] in q's dtype. Differentiable in q, kv and attn_sink under both impls."""
    _check_impl(impl, "sparse_attn")
    if impl == "tilelang":
        from .tilelang_sparse_attn import sparse_attn as tl_sparse_attn
        return tl_sparse_attn(q, kv, attn_sink, topk_idxs, softmax_scale)
    from .reference import sparse_attn_gather
    return sparse_attn_gather(q, kv, attn_sink, topk_idxs, softmax_scale)


def indexer_logits(q, k, weights, ratio: int, impl: str = "torch"):
    """Lightning-indexer scores I[b,t,c] = sum_h relu(q[b,t,h]·k[b,c]) * weights[b,t,h], fp32 [B,S,N],
    -inf where entry c is not yet complete for query t (c >= (t+1)//ratio)."""
    _check_impl(impl, "indexer_logits")
    if impl == "tilelang":
        from .tilelang_indexer import indexer_logits as tl_indexer_logits
        return tl_indexer_logits(q, k, weights, ratio)
    from .reference import indexer_logits_ref
    return indexer_logits_ref(q, k, weights, ratio)


def indexer_topk(q, k, weights, ratio: int, topk: int, impl: str = "torch"):
    """Top-k entries of the indexer scores, [B,S,min(topk,N)] int32, -1 where fewer than topk are valid."""
    import torch
    logits = indexer_logits(q, k, weights, ratio, impl)
    vals, idx = logits.topk(min(topk, logits.shape[-1]), dim=-1)
    return torch.where(torch.isfinite(vals), idx, -1).int()


def act_quant(x, block_size: int = 128, scale_fmt: str | None = None, impl: str = "torch"):
    """Blockwise FP8 e4m3 quantization along the last dim -> (q float8_e4m3fn, scales fp32 [..., D/block])."""
    _check_impl(impl, "act_quant")
    if impl == "tilelang":
        from .tilelang_act_quant import act_quant as tl_act_quant
        return tl_act_quant(x, block_size, scale_fmt)
    return act_quant_torch(x, block_size, scale_fmt)


FP8_MAX = 448.0


def act_quant_torch(x, block_size: int = 128, scale_fmt: str | None = None):
    """Reference for act_quant: amax per block clamped to 1e-4; scale = amax/448, or the next power of two
    at or above it for ue8m0; q = e4m3(clamp(x/scale)) with round-to-nearest-even."""
    import torch
    if x.shape[-1] % block_size:
        raise ValueError(f"act_quant: last dim {x.shape[-1]} is not a multiple of block_size {block_size}")
    if scale_fmt not in (None, "ue8m0"):
        raise ValueError(f"act_quant: scale_fmt must be None or 'ue8m0', got {scale_fmt!r}")
    xb = x.float().unflatten(-1, (-1, block_size))
    s = xb.abs().amax(-1).clamp_min(1e-4) / FP8_MAX
    if scale_fmt == "ue8m0":
        s = torch.exp2(torch.ceil(torch.log2(s)))
    q = (xb / s.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.flatten(-2), s
