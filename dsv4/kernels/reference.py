"""Pure-torch references for the DeepSeek-V4 attention kernels (ground truth for kernel tests).

Conventions shared by every function here:
* `q` [B, S, H, D]; `kv` [B, N, D] is one latent head used as both K and V (MQA);
* `topk_idxs` [B, S, K] int32 rows into `kv`, -1 = empty slot;
* `attn_sink` [H] fp32 is a logit in the SCALED score space, added to the softmax denominator only;
* the stabiliser is M = max(max_j s_j, sink), so a row whose slots are all -1 yields o = 0 (finite) with
  finite gradients instead of exp(-inf - -inf) = NaN;
* LSE is natural-log and INCLUDES the sink (the MILES convention; FlashMLA's excludes it).
"""
from __future__ import annotations

import torch


def _acc(x: torch.Tensor) -> torch.dtype:
    """Accumulation dtype: fp32, or fp64 when the inputs are fp64 (exact-ish gradient checks)."""
    return torch.promote_types(x.dtype, torch.float32)


def _stabiliser(scores: torch.Tensor, attn_sink: torch.Tensor) -> torch.Tensor:
    # The max only keeps exp() in range; its gradient cancels mathematically, so it is detached.
    m = torch.maximum(scores.amax(-1), attn_sink.to(scores.dtype).view(1, 1, -1)).detach()
    return torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # a -inf sink on an empty row


def _gather_scores(q, kv, topk_idxs, softmax_scale):
    B, S, H, D = q.shape
    K = topk_idxs.shape[-1]
    valid = topk_idxs >= 0                                                      # [B,S,K]
    rows = topk_idxs.clamp(min=0).long().reshape(B, S * K, 1).expand(-1, -1, D)
    kv_sel = torch.gather(kv, 1, rows).view(B, S, K, D)
    # masked load: whatever sits in the row we clamped to (even NaN/Inf) must not reach the output
    kv_sel = torch.where(valid.unsqueeze(-1), kv_sel, torch.zeros((), dtype=kv.dtype, device=kv.device))
    s = torch.einsum("bshd,bskd->bshk", q.to(_acc(q)), kv_sel.to(_acc(q))) * softmax_scale
    s = s.masked_fill(~valid.unsqueeze(2), float("-inf"))
    return s, kv_sel


def sparse_attn_gather_lse(q, kv, attn_sink, topk_idxs, softmax_scale):
    """Gather reference: returns (o [B,S,H,D] in q.dtype, lse [B,S,H] fp32, natural log, sink included).
    Duplicate indices are counted once per occurrence (like gather-based kernels)."""
    s, kv_sel = _gather_scores(q, kv, topk_idxs, softmax_scale)
    m = _stabiliser(s, attn_sink)
    p = torch.exp(s - m.unsqueeze(-1))                                          # masked slots -> 0
    denom = p.sum(-1) + torch.exp(attn_sink.to(s.dtype).view(1, 1, -1) - m)
    o = torch.einsum("bshk,bskd->bshd", p / denom.unsqueeze(-1), kv_sel.to(s.dtype))
    return o.to(q.dtype), m + torch.log(denom)


def sparse_attn_gather(q, kv, attn_sink, topk_idxs, softmax_scale):
    """o[b,t,h] = sum_j exp(s_j - M) kv[idx_j] / (sum_j exp(s_j - M) + exp(sink_h - M)), s_j = scale q.kv[idx_j]."""
    return sparse_attn_gather_lse(q, kv, attn_sink, topk_idxs, softmax_scale)[0]


def sparse_attn_dense_lse(q, kv, attn_sink, topk_idxs, softmax_scale):
    """Second reference: dense scores against every kv row, masked to the index set, softmax with a sink
    column that is dropped before the value sum. Duplicate indices count once here."""
    B, S, H, D = q.shape
    N = kv.shape[1]
    s = torch.einsum("bshd,bnd->bshn", q.to(_acc(q)), kv.to(_acc(q))) * softmax_scale
    sel = torch.zeros(B, S, N + 1, dtype=torch.bool, device=q.device)
    sel.scatter_(-1, torch.where(topk_idxs >= 0, topk_idxs.long(), N), True)   # -1 -> a spill column
    s = s.masked_fill(~sel[..., :N].unsqueeze(2), float("-inf"))
    sink = attn_sink.to(s.dtype).view(1, 1, H, 1).expand(B, S, H, 1)
    logits = torch.cat([s, sink], dim=-1)
    m = _stabiliser(logits, attn_sink)
    e = torch.exp(logits - m.unsqueeze(-1))
    denom = e.sum(-1)
    o = torch.einsum("bshn,bnd->bshd", e[..., :N] / denom.unsqueeze(-1), kv.to(s.dtype))
    return o.to(q.dtype), m + torch.log(denom)


def sparse_attn_dense(q, kv, attn_sink, topk_idxs, softmax_scale):
    return sparse_attn_dense_lse(q, kv, attn_sink, topk_idxs, softmax_scale)[0]


def indexer_logits_ref(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, ratio: int) -> torch.Tensor:
    """Lightning-indexer scores I[b,t,c] = sum_h relu(q[b,t,h].k[b,c]) * weights[b,t,h], fp32, with -inf where
    compressed entry c is not complete for query t (c >= (t+1) // ratio). `weights` already include the
    Hi^-0.5 * Di^-0.5 factors."""
    S, N = q.shape[1], k.shape[1]
    logits = indexer_scores(q, k, weights)
    return logits.masked_fill(~causal_compressed_mask(S, N, ratio, q.device), float("-inf"))


def indexer_scores(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The indexer's scores [B,S,N] without the causal mask (callers that know each query's position, such as
    the rollout engine's decode step, mask them themselves)."""
    scores = torch.einsum("bshd,bnd->bshn", q.to(_acc(q)), k.to(_acc(q))).relu()
    return (scores * weights.to(scores.dtype).unsqueeze(-1)).sum(2)


def causal_compressed_mask(S: int, N: int, ratio: int, device=None) -> torch.Tensor:
    """[S, N] bool: compressed entry c (covering tokens < (c+1)*ratio) is visible to query t."""
    t = torch.arange(S, device=device).unsqueeze(1)
    return torch.arange(N, device=device).unsqueeze(0) < (t + 1) // ratio


def indexer_topk(logits: torch.Tensor, topk: int) -> torch.Tensor:
    """[B,S,N] scores (-inf = not allowed) -> [B,S,min(topk,N)] int32 entry ids, -1 where fewer entries exist.
    Order among the chosen entries (and among ties) is implementation-defined: compare sets."""
    k = min(topk, logits.shape[-1])
    if k == 0:
        return torch.empty(*logits.shape[:-1], 0, dtype=torch.int32, device=logits.device)
    vals, idx = logits.topk(k, dim=-1)
    return torch.where(torch.isfinite(vals), idx, -1).to(torch.int32)
