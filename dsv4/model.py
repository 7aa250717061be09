"""DeepSeek-V4 reference model in plain torch (full-sequence forward; training-friendly).

Semantics follow the official inference model (prefill, start_pos = 0). Everything that differs between
implementations is a ModelConfig flag. The math lives in small functions (hc_pre, sinkhorn, compress,
rope_tail, route, ...) so that tensor-parallel versions of the layers can call the same code with
sharded weights; parameter names are the official ones (attn.wq_a, ffn.experts.{e}.w1, hc_attn_fn, ...).

Departures from the inference code, all for training:
* RoPE and the QAT quant-dequant points are out of place; QAT uses straight-through gradients.
* `attn_sink` starts at zero (the official code allocates it uninitialised); init is deterministic per
  parameter name from `cfg.seed` (see `init_param`), so a checkpoint generator reproduces it tensor by tensor.
* The lightning indexer gets no gradient through top-k. `forward(..., indexer_loss=True)` also returns the
  DeepSeek-V3.2 KL loss (KL of the indexer's softmax over its selected entries against the detached main
  attention summed over heads; the indexer sees detached x and qr, as in Megatron's DSA), which is the
  only gradient the indexer parameters receive.
* `ffn.gate.bias` (aux-loss-free balancing bias) and `ffn.gate.tid2eid` (hash table) are parameters with
  requires_grad=False: the bias only steers selection and is updated by `Gate.update_bias`.
"""
from __future__ import annotations

import math
import zlib
from functools import lru_cache
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from dsv4 import quant
from dsv4.config import ModelConfig
from dsv4.kernels import reference as kref
from dsv4.kernels import split_gemm

try:  # the dispatchers (torch | tilelang) live in dsv4/kernels/__init__.py
    from dsv4.kernels import indexer_logits, sparse_attn
except ImportError:  # dispatcher not present: the torch references only
    def sparse_attn(q, kv, attn_sink, topk_idxs, softmax_scale, impl="torch"):
        if impl != "torch":
            raise RuntimeError(f"attn_impl={impl!r} needs dsv4.kernels.sparse_attn, which is not available")
        return kref.sparse_attn_gather(q, kv, attn_sink, topk_idxs, softmax_scale)

    def indexer_logits(q, k, weights, ratio, impl="torch"):
        if impl != "torch":
            raise RuntimeError(f"attn_impl={impl!r} needs dsv4.kernels.indexer_logits, which is not available")
        return kref.indexer_logits_ref(q, k, weights, ratio)


def torch_dtype(cfg: ModelConfig) -> torch.dtype:
    return torch.bfloat16 if cfg.dtype == "bf16" else torch.float32


# =============================================================================================== math
def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y if weight is None else y * weight.float()).to(x.dtype)


def rope_freqs(rope_dim: int, base: float, factor: float = 1.0, original_seq_len: int = 0,
               beta_fast: int = 32, beta_slow: int = 1) -> torch.Tensor:
    """Per-pair angular frequencies [rope_dim/2]; YaRN-blended when original_seq_len > 0 (no mscale anywhere)."""
    freqs = 1.0 / (base ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))
    if original_seq_len > 0:
        def corr_dim(rot):
            return rope_dim * math.log(original_seq_len / (rot * 2 * math.pi)) / (2 * math.log(base))
        low = max(math.floor(corr_dim(beta_fast)), 0)
        high = min(math.ceil(corr_dim(beta_slow)), rope_dim - 1)
        ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(0, 1)
        smooth = 1 - ramp
        freqs = freqs / factor * (1 - smooth) + freqs * smooth
    return freqs


def layer_rope_freqs(cfg: ModelConfig, layer_id: int) -> torch.Tensor:
    """Compressed layers: compress_rope_theta with YaRN; window-only layers (and MTP): rope_theta, no YaRN."""
    if cfg.layer_ratio(layer_id):
        return rope_freqs(cfg.rope_head_dim, cfg.compress_rope_theta, cfg.rope_factor, cfg.original_seq_len,
                          cfg.beta_fast, cfg.beta_slow)
    return rope_freqs(cfg.rope_head_dim, cfg.rope_theta)


def rope_cos_sin(freqs: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    ang = positions.float().unsqueeze(-1) * freqs.to(positions.device)
    return ang.cos(), ang.sin()


def rope_tail(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the LAST cos.shape[-1]*2 dims of x as interleaved pairs (x[2i], x[2i+1]), out of place.
    x is [B, S, D] or [B, S, H, D]; cos/sin are [S, r/2] (or [B, S, r/2]: a position per sample). inverse=True applies the conjugate rotation."""
    r = cos.shape[-1] * 2
    if x.dim() == 4:
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    if inverse:
        sin = -sin
    pairs = x[..., -r:].float().unflatten(-1, (-1, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    rot = torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)
    return torch.cat([x[..., :-r], rot.to(x.dtype)], dim=-1)


@lru_cache(maxsize=16)
def _hadamard_matrix(n: int, device: torch.device) -> torch.Tensor:
    """Cached per device, and built there: a copy to the GPU would be a host-to-device transfer that a CUDA graph
    capture (the rollout engine's decode step) refuses, also where torch.compile traces through the cache."""
    h = torch.ones(1, 1, device=device)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h * n ** -0.5


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal Walsh-Hadamard rotation of the last dim (a power of two)."""
    return (x.float() @ _hadamard_matrix(x.shape[-1], x.device)).to(x.dtype)


# ---------------------------------------------------------------------------------------------- hyper-connections
def hc_mixes(X: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> torch.Tensor:
    """[B,S,hc,d] streams -> [B,S,M] fp32 mixes: (flat(X) @ fn^T) / rms(flat(X))."""
    xf = X.flatten(2).float()
    return (xf @ fn.float().t()) * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + norm_eps)


def sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """[..., hc, hc] -> doubly stochastic: row softmax (+eps), column normalise, then (iters-1) row/col pairs.
    The last step normalises columns, so every column sums to 1 (each output stream is a convex mix)."""
    c = logits.softmax(-1) + eps
    c = c / (c.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(-1, keepdim=True) + eps)
        c = c / (c.sum(-2, keepdim=True) + eps)
    return c


def hc_split(mix: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc: int, iters: int, eps: float,
             sinkhorn=sinkhorn):
    """Mix layout [pre(hc) | post(hc) | comb(hc*hc, row-major)]; scale = [s_pre, s_post, s_comb]. `sinkhorn`: the
    function that normalises comb (a fused kernel can stand in for the reference)."""
    scale, base = scale.float(), base.float()
    pre = torch.sigmoid(mix[..., :hc] * scale[0] + base[:hc]) + eps
    post = 2 * torch.sigmoid(mix[..., hc:2 * hc] * scale[1] + base[hc:2 * hc])
    comb = (mix[..., 2 * hc:] * scale[2] + base[2 * hc:]).unflatten(-1, (hc, hc))
    return pre, post, sinkhorn(comb, iters, eps)


def hc_pre(X, fn, scale, base, hc: int, iters: int, hc_eps: float, norm_eps: float, sinkhorn=sinkhorn,
           mixes=hc_mixes):
    """-> (x [B,S,d] in X.dtype = sum_j pre_j X_j, post [B,S,hc], comb [B,S,hc,hc]). `sinkhorn`, `mixes`: stand-ins
    for the reference functions (fused or fusable forms of the same math)."""
    pre, post, comb = hc_split(mixes(X, fn, norm_eps), scale, base, hc, iters, hc_eps, sinkhorn)
    x = (pre.unsqueeze(-1) * X.float()).sum(2)
    return x.to(X.dtype), post, comb


def hc_post(f: torch.Tensor, R: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """out[k] = post_k * f + sum_j comb[j, k] * R[j]  (C^T R: the sum runs over comb's FIRST index)."""
    mixed = torch.einsum("bsjk,bsjd->bskd", comb, R.float())
    return (post.unsqueeze(-1) * f.float().unsqueeze(2) + mixed).to(f.dtype)


# forms of hc_mixes and hc_post for the GPU (training's compiled hyper-connections, the decode step): the same math
def hc_mixes_split(X: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> torch.Tensor:
    """hc_mixes with its GEMM split along K = hc*dim into chunks of 1024 (of dim, where dim is not a multiple of
    1024), one batched GEMM plus a sum. The GEMM has only (2+hc)*hc = 24 columns: unsplit, cuBLAS tiles it into as
    many blocks as there are 32-token row tiles and each block walks all of K (a few % of the GPU's bandwidth, ~60 ms
    of the H200 smoke's step)."""
    B, S, hc, d = X.shape
    K, M = hc * d, fn.shape[0]
    s = hc * (d // 1024) if d % 1024 == 0 else hc
    xf = X.flatten(2).float()
    raw = torch.bmm(xf.view(B * S, s, K // s).transpose(0, 1), fn.float().view(M, s, K // s).permute(1, 2, 0))
    return raw.sum(0).view(B, S, M) * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + norm_eps)


def hc_post_unrolled(f: torch.Tensor, R: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """hc_post with C^T R as hc broadcast multiply-adds, which inductor fuses into the output's one kernel (the
    einsum is a batched GEMM of [hc, hc] by [hc, dim] for every token: cuBLAS's small-matrix kernels)."""
    out = post.unsqueeze(-1) * f.float().unsqueeze(2)
    for j in range(R.shape[2]):
        out = out + comb[..., j, :].unsqueeze(-1) * R[..., j, :].float().unsqueeze(2)
    return out.to(f.dtype)


def hc_head(X, fn, scale, base, hc_eps: float, norm_eps: float, mixes=hc_mixes) -> torch.Tensor:
    """Contract the hc streams to one: sum_j (sigmoid(mix_j * scale + base_j) + eps) X_j (weights not normalised)."""
    pre = torch.sigmoid(mixes(X, fn, norm_eps) * scale.float() + base.float()) + hc_eps
    return (pre.unsqueeze(-1) * X.float()).sum(2).to(X.dtype)


# ---------------------------------------------------------------------------------------------- attention pieces
def window_topk_idxs(S: int, window: int, device=None) -> torch.Tensor:
    """[S, min(S, W)] int32: query t sees tokens max(0, t-W+1) .. t (self included), -1 padded."""
    t = torch.arange(S, device=device).unsqueeze(1)
    idx = (t - window + 1).clamp(min=0) + torch.arange(min(S, window), device=device)
    return torch.where(idx > t, -1, idx).int()


def compress_topk_idxs(S: int, ratio: int, offset: int, device=None) -> torch.Tensor:
    """[S, S//ratio] int32 for dense compressed attention: entry i (row offset+i) once its block is complete."""
    n = S // ratio
    i = torch.arange(n, device=device).unsqueeze(0)
    ok = i < (torch.arange(S, device=device).unsqueeze(1) + 1) // ratio
    return torch.where(ok, i + offset, -1).int()


def overlap_windows(t: torch.Tensor, head_dim: int, fill: float) -> torch.Tensor:
    """[B,n,m,2d] -> [B,n,2m,d]: slots 0..m-1 = first channel-half of the PREVIOUS block (fill for block 0),
    slots m..2m-1 = second channel-half of the current block."""
    first = t[..., :head_dim]
    prev = torch.cat([torch.full_like(first[:, :1], fill), first[:, :-1]], dim=1)
    return torch.cat([prev, t[..., head_dim:]], dim=2)


def compress(a: torch.Tensor, g: torch.Tensor, ape: torch.Tensor, ratio: int, head_dim: int) -> torch.Tensor:
    """a, g [B, n*m, coff*d] (kv and gate projections, fp32) -> [B, n, d]: per-channel softmax-gated pooling
    over the m slots of each block (2m overlapping slots when ratio == 4)."""
    B, T, C = a.shape
    a = a.view(B, T // ratio, ratio, C)
    g = g.view(B, T // ratio, ratio, C) + ape.float()
    if ratio == 4:
        a, g = overlap_windows(a, head_dim, 0.0), overlap_windows(g, head_dim, float("-inf"))
    return (a * g.softmax(dim=2)).sum(2)


def grouped_output(o: torch.Tensor, wo_a: torch.Tensor, groups: int) -> torch.Tensor:
    """o [B,S,H,D] -> [B,S,G*R]: heads grouped contiguously, one low-rank projection per group."""
    B, S = o.shape[:2]
    o = o.reshape(B, S, groups, -1)
    w = wo_a.view(groups, -1, o.shape[-1]).to(o.dtype)
    return torch.einsum("bsgd,grd->bsgr", o, w).flatten(2)


def indexer_kl_loss(index_logits: torch.Tensor, cmp_idx: torch.Tensor, q: torch.Tensor, kv_cmp: torch.Tensor,
                    lse: torch.Tensor, softmax_scale: float) -> torch.Tensor:
    """DeepSeek-V3.2 indexer loss over the selected entries S_t:  mean_t KL(p_t || softmax(I_t[S_t])) where
    p_t = L1-normalised sum over heads of the main attention probabilities of those entries (detached,
    exp(score - lse) with the full attention's lse). index_logits [B,S,N] (with grad), cmp_idx [B,S,K] entry ids
    (-1 = none), q [B,S,H,D], kv_cmp [B,N,D], lse [B,S,H]. Rows with no selected entry are skipped."""
    valid = cmp_idx >= 0
    idx = cmp_idx.clamp(min=0).long()
    with torch.no_grad():
        B, S, K = idx.shape
        D = kv_cmp.shape[-1]
        kv_sel = torch.gather(kv_cmp, 1, idx.view(B, S * K, 1).expand(-1, -1, D)).view(B, S, K, D)
        s = torch.einsum("bshd,bskd->bshk", q.float(), kv_sel.float()) * softmax_scale
        p = torch.exp(s - lse.unsqueeze(-1)).sum(2).masked_fill(~valid, 0.0)
        p = p / p.sum(-1, keepdim=True).clamp(min=1e-30)
    sel = torch.gather(index_logits, -1, idx).masked_fill(~valid, -1e30)  # finite fill keeps empty rows NaN-free
    logq = F.log_softmax(sel.float(), dim=-1)
    kl = torch.where(valid, p * (torch.log(p.clamp(min=1e-30)) - logq), torch.zeros_like(logq)).sum(-1)
    rows = valid.any(-1)
    return (kl * rows).sum() / rows.sum().clamp(min=1)


# ---------------------------------------------------------------------------------------------- MoE pieces
def route(logits: torch.Tensor, score_func: str, topk: int, route_scale: float,
          bias: torch.Tensor | None = None, hash_idx: torch.Tensor | None = None,
          replay: tuple[torch.Tensor, torch.Tensor] | None = None):
    """Router: scores from fp32 logits; experts = hash table row, else top-k of (scores + bias) where the
    bias only steers selection; weights = the chosen (unbiased) scores, renormalised unless softmax, x scale.
    `replay` = (experts [T, k], mask [T] bool): rows where the mask is set take the given experts instead of
    their own choice (RL routing replay); the weights are still the router's scores of those experts, so the
    router keeps its gradient."""
    if score_func == "softmax":
        s = logits.softmax(-1)
    elif score_func == "sigmoid":
        s = logits.sigmoid()
    else:
        s = F.softplus(logits).sqrt()
    if hash_idx is not None:
        idx = hash_idx.long()
    else:
        idx = (s.detach() if bias is None else s.detach() + bias.float()).topk(topk, dim=-1).indices
    if replay is not None:
        idx = torch.where(replay[1].unsqueeze(-1), replay[0].to(idx.dtype), idx)
    w = s.gather(-1, idx)
    if score_func != "softmax":
        w = w / w.sum(-1, keepdim=True)
    return w * route_scale, idx


def fp32_linear(x: torch.Tensor, w: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """x @ w^T for an fp32 weight (the head, a compressor's projections) -> fp32, as cfg.fp32_gemm says on CUDA
    (F.linear in fp32 on a CPU). Pass x in its own dtype: bf16 values are exact, so the split GEMM skips their lo
    half."""
    if cfg.fp32_gemm != "fp32":
        return split_gemm.linear(x, w, split_backward=cfg.fp32_gemm == "bf16x3")
    return F.linear(x.float(), w.float())


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """silu(min(gate, L)) * clamp(up, -L, L); limit <= 0 disables the clamp."""
    if limit > 0:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return F.silu(gate) * up


def gated(a: torch.Tensor, b: torch.Tensor, w: torch.Tensor | None, limit: float, dtype: torch.dtype) -> torch.Tensor:
    """An expert's activation from its w1 and w3 outputs: w * swiglu(a, b) in fp32 (w: the routing weight, which
    scales the activation before w2; None for the shared expert), cast to the GEMM dtype of w2."""
    h = swiglu(a.float(), b.float(), limit)
    return (h if w is None else w * h).to(dtype)


# =============================================================================================== modules
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))  # fp32 like the official model

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


class Linear(nn.Module):
    """y = x W^T. `qat_input`/`qat_weight` ("fp8" | "fp4" | None) are set by Transformer from the release
    format of the weight and the config flags: FP8 inputs are 1x128 ue8m0 quant-dequant, FP8 weights 128x128,
    FP4 weights MXFP4 1x32; all straight-through."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))
        self.qat_input: str | None = None
        self.qat_weight: str | None = None

    def qat_weight_value(self) -> torch.Tensor:
        """The weight through its QAT point (what a caller that reads the weight itself, like wo_a's einsum, uses)."""
        if self.qat_weight == "fp8":
            return quant.fp8_weight_qdq(self.weight)
        if self.qat_weight == "fp4":
            return quant.mxfp4_weight_qdq(self.weight)
        return self.weight

    def forward(self, x):
        if self.qat_input == "fp8":
            x = quant.fp8_act_qdq(x, 128)
        return F.linear(x, self.qat_weight_value().to(x.dtype))


class Compressor(nn.Module):
    """Pools each block of `ratio` tokens into one KV entry (overlapping 2*ratio-token windows iff ratio == 4).
    rotate=True is the indexer's key compressor: Hadamard rotation (+ FP4 QAT) instead of the FP8 KV QAT."""

    def __init__(self, cfg: ModelConfig, ratio: int, head_dim: int, rotate: bool = False):
        super().__init__()
        self.cfg, self.ratio, self.head_dim, self.rotate = cfg, ratio, head_dim, rotate
        coff = 2 if ratio == 4 else 1
        self.ape = nn.Parameter(torch.zeros(ratio, coff * head_dim, dtype=torch.float32))
        self.wkv = Linear(cfg.dim, coff * head_dim, torch.float32)    # fp32 weights, fp32 input (official)
        self.wgate = Linear(cfg.dim, coff * head_dim, torch.float32)
        self.norm = RMSNorm(head_dim, cfg.norm_eps)

    def forward(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        B, S, _ = x.shape
        n = S // self.ratio                       # the trailing S % ratio tokens form no entry yet
        xs = x[:, :n * self.ratio]
        c = compress(self.project(xs, self.wkv), self.project(xs, self.wgate), self.ape, self.ratio, self.head_dim)
        return self.finish(c, torch.arange(n, device=x.device) * self.ratio, freqs, x.dtype)

    def project(self, x: torch.Tensor, lin: Linear) -> torch.Tensor:
        """fp32 [..., coff*d] from the activations x in their dtype (the GEMM is fp32: fp32_linear)."""
        return fp32_linear(x, lin.qat_weight_value(), self.cfg)

    def finish(self, c: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor, dtype: torch.dtype):
        """Pooled entries [B, n, d] -> keys: norm, RoPE at each entry's first token (entry i sits at i*ratio),
        then the indexer's rotation or the KV QAT. `positions` is [n] or [B, n]. The rollout engine's KV cache
        calls this on entries it pools one block at a time."""
        c = self.norm(c.to(dtype))
        cos, sin = rope_cos_sin(freqs, positions)
        c = rope_tail(c, cos, sin)
        if self.rotate:
            c = hadamard(c)
            if self.cfg.qat_indexer_fp4:
                c = quant.fp4_act_qdq(c, 32)
        elif self.cfg.qat_kv_fp8:
            c = _kv_fp8_qat(c, self.cfg.rope_head_dim)
        return c


def _kv_fp8_qat(kv: torch.Tensor, rope_dim: int) -> torch.Tensor:
    """FP8 1x64 ue8m0 quant-dequant of the nope dims; the rope dims stay in the activation dtype."""
    return torch.cat([quant.fp8_act_qdq(kv[..., :-rope_dim], 64), kv[..., -rope_dim:]], dim=-1)


class Indexer(nn.Module):
    """Lightning indexer (ratio-4 layers): scores every complete compressed entry for each query and keeps
    the top index_topk."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        dt = torch_dtype(cfg)
        self.n_heads, self.head_dim = cfg.index_n_heads, cfg.index_head_dim
        self.wq_b = Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, dt)
        self.weights_proj = Linear(cfg.dim, self.n_heads, dt)
        self.compressor = Compressor(cfg, 4, self.head_dim, rotate=True)

    def forward(self, x, qr, cos, sin, freqs):
        """-> (entry ids [B,S,k] int32 with -1, logits [B,S,N] fp32). x and qr arrive detached."""
        q = self.wq_b(qr).unflatten(-1, (self.n_heads, self.head_dim))
        q = hadamard(rope_tail(q, cos, sin))
        if self.cfg.qat_indexer_fp4:
            q = quant.fp4_act_qdq(q, 32)
        k = self.compressor(x, freqs)
        w = self.weights_proj(x).float() * (self.head_dim ** -0.5 * self.n_heads ** -0.5)
        logits = indexer_logits(q, k, w, 4, impl=self.cfg.attn_impl)
        return kref.indexer_topk(logits, self.cfg.index_topk), logits


class Attention(nn.Module):
    """Sliding window over the raw latent KV, plus (ratio > 0) compressed entries: all complete ones for
    heavily compressed layers, the indexer's top-k for ratio 4. One 512-dim latent is K and V for all heads."""

    def __init__(self, layer_id: int, cfg: ModelConfig):
        super().__init__()
        self.cfg, self.layer_id = cfg, layer_id
        self.ratio = cfg.layer_ratio(layer_id)
        dt = torch_dtype(cfg)
        H, D = cfg.n_heads, cfg.head_dim
        self.n_heads, self.head_dim, self.softmax_scale = H, D, D ** -0.5
        self.attn_sink = nn.Parameter(torch.zeros(H, dtype=torch.float32))
        self.wq_a = Linear(cfg.dim, cfg.q_lora_rank, dt)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.norm_eps)
        self.wq_b = Linear(cfg.q_lora_rank, H * D, dt)
        self.wkv = Linear(cfg.dim, D, dt)
        self.kv_norm = RMSNorm(D, cfg.norm_eps)
        self.wo_a = Linear(H * D // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank, dt)  # used in an einsum
        self.wo_b = Linear(cfg.o_groups * cfg.o_lora_rank, cfg.dim, dt)
        if self.ratio:
            self.compressor = Compressor(cfg, self.ratio, D)
        if self.ratio == 4:
            self.indexer = Indexer(cfg)
        self.register_buffer("freqs", layer_rope_freqs(cfg, layer_id), persistent=False)
        self.indexer_loss: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, want_indexer_loss: bool = False) -> torch.Tensor:
        B, S, _ = x.shape
        cfg = self.cfg
        r = cfg.rope_head_dim
        cos, sin = rope_cos_sin(self.freqs, torch.arange(S, device=x.device))
        qr = self.q_norm(self.wq_a(x))
        q = self.wq_b(qr).unflatten(-1, (self.n_heads, self.head_dim))
        q = rope_tail(rms_norm(q, None, cfg.norm_eps), cos, sin)       # per-head RMS without weight
        kv = rope_tail(self.kv_norm(self.wkv(x)), cos, sin)
        if cfg.qat_kv_fp8:
            kv = _kv_fp8_qat(kv, r)
        idx = window_topk_idxs(S, cfg.window_size, x.device).expand(B, -1, -1)
        kv_all, cmp_idx, index_logits = kv, None, None
        if self.ratio:
            c = self.compressor(x, self.freqs)                          # [B, S//ratio, D]
            kv_all = torch.cat([kv, c], dim=1)                          # compressed rows follow the S raw rows
            if self.ratio == 4:
                cmp_idx, index_logits = self.indexer(x.detach(), qr.detach(), cos, sin, self.freqs)
                idx_c = torch.where(cmp_idx >= 0, cmp_idx + S, -1)
            else:
                idx_c = compress_topk_idxs(S, self.ratio, S, x.device).expand(B, -1, -1)
            idx = torch.cat([idx, idx_c], dim=-1)
        idx = idx.int().contiguous()
        o = sparse_attn(q, kv_all, self.attn_sink, idx, self.softmax_scale, impl=cfg.attn_impl)
        self.indexer_loss = None
        if want_indexer_loss and index_logits is not None and cmp_idx.shape[-1] > 0:
            with torch.no_grad():
                _, lse = kref.sparse_attn_gather_lse(q, kv_all, self.attn_sink, idx, self.softmax_scale)
            self.indexer_loss = indexer_kl_loss(index_logits, cmp_idx, q.detach(), kv_all[:, S:].detach(),
                                                lse, self.softmax_scale)
        o = rope_tail(o, cos, sin, inverse=True)                        # V carried rope: de-rotate at the query
        return self.wo_b(grouped_output(o, self.wo_a.qat_weight_value(), cfg.o_groups))


class Gate(nn.Module):
    def __init__(self, layer_id: int, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.hash = cfg.is_hash_layer(layer_id)
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.dim, dtype=torch_dtype(cfg)))
        if self.hash:  # a real parameter, not a buffer: weight syncs must carry it
            self.tid2eid = nn.Parameter(torch.zeros(cfg.vocab_size, cfg.n_activated_experts, dtype=torch.int32),
                                        requires_grad=False)
            self.bias = None
        else:
            self.bias = nn.Parameter(torch.zeros(cfg.n_routed_experts, dtype=torch.float32), requires_grad=False)
        self.replay: tuple[torch.Tensor, torch.Tensor] | None = None  # set by dsv4.rl.replay.replayed_routes
        self.replay_agree: torch.Tensor | None = None  # [2]: replayed rows whose own choice was the same, all replayed

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor):
        logits = F.linear(x.float(), self.weight.float())
        hash_idx = self.tid2eid[input_ids] if self.hash else None
        replay = None if self.hash else self.replay
        w, idx = route(logits, self.cfg.score_func, self.cfg.n_activated_experts, self.cfg.route_scale,
                       self.bias, hash_idx, replay)
        if replay is not None:  # how often replay overrode the router (no host sync: read after the step)
            with torch.no_grad():
                own = route(logits, self.cfg.score_func, self.cfg.n_activated_experts, 1.0, self.bias)[1]
                same = (own.sort(-1).values == replay[0].to(own.dtype).sort(-1).values).all(-1) & replay[1]
                self.replay_agree = torch.stack([same.sum(), replay[1].sum()]).float()
        return w, idx

    @torch.no_grad()
    def update_bias(self, tokens_per_expert: torch.Tensor, rate: float = 1e-3) -> None:
        """Aux-loss-free balancing (DeepSeek-V3): raise the bias of under-loaded experts, lower over-loaded."""
        if self.bias is not None:
            load = tokens_per_expert.float()
            self.bias.add_(rate * torch.sign(load.mean() - load))


class Expert(nn.Module):
    def __init__(self, dim: int, inter_dim: int, dtype: torch.dtype, swiglu_limit: float):
        super().__init__()
        self.w1 = Linear(dim, inter_dim, dtype)
        self.w2 = Linear(inter_dim, dim, dtype)
        self.w3 = Linear(dim, inter_dim, dtype)
        self.swiglu_limit = swiglu_limit

    def forward(self, x: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
        return self.w2(gated(self.w1(x), self.w3(x), weights, self.swiglu_limit, x.dtype))


class MoE(nn.Module):
    def __init__(self, layer_id: int, cfg: ModelConfig):
        super().__init__()
        dt = torch_dtype(cfg)
        self.gate = Gate(layer_id, cfg)
        self.experts = nn.ModuleList(Expert(cfg.dim, cfg.moe_inter_dim, dt, cfg.swiglu_limit)
                                     for _ in range(cfg.n_routed_experts))
        self.shared_experts = Expert(cfg.dim, cfg.moe_inter_dim, dt,
                                     cfg.swiglu_limit if cfg.shared_expert_clamp else 0.0)
        self.last_expert_idx: torch.Tensor | None = None  # [T, k] routing of the last call (replay, balancing)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, idx = self.gate(x, input_ids.reshape(-1))
        self.last_expert_idx = idx.detach()
        y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for e in torch.unique(idx).tolist():
            tok, slot = torch.where(idx == e)
            y = y.index_add(0, tok, self.experts[e](x[tok], weights[tok, slot].unsqueeze(-1)).float())
        y = y + self.shared_experts(x).float()
        return y.to(x.dtype).view(shape)


class Block(nn.Module):
    def __init__(self, layer_id: int, cfg: ModelConfig):
        super().__init__()
        self.cfg, self.layer_id = cfg, layer_id
        hc, mix = cfg.hc_mult, (2 + cfg.hc_mult) * cfg.hc_mult
        for sub in ("attn", "ffn"):
            self.register_parameter(f"hc_{sub}_fn", nn.Parameter(torch.empty(mix, hc * cfg.dim)))
            self.register_parameter(f"hc_{sub}_base", nn.Parameter(torch.empty(mix)))
            self.register_parameter(f"hc_{sub}_scale", nn.Parameter(torch.empty(3)))
        self.attn = Attention(layer_id, cfg)
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn = MoE(layer_id, cfg)

    def _hc_pre(self, X, sub, sinkhorn=sinkhorn, mixes=hc_mixes):
        c = self.cfg
        return hc_pre(X, getattr(self, f"hc_{sub}_fn"), getattr(self, f"hc_{sub}_scale"),
                      getattr(self, f"hc_{sub}_base"), c.hc_mult, c.hc_sinkhorn_iters, c.hc_eps, c.norm_eps, sinkhorn,
                      mixes)

    def forward(self, X: torch.Tensor, input_ids: torch.Tensor, want_indexer_loss: bool = False) -> torch.Tensor:
        x, post, comb = self._hc_pre(X, "attn")
        X = hc_post(self.attn(self.attn_norm(x), want_indexer_loss), X, post, comb)
        x, post, comb = self._hc_pre(X, "ffn")
        return hc_post(self.ffn(self.ffn_norm(x), input_ids), X, post, comb)


class MTPBlock(Block):
    """Multi-token prediction: position t combines the main model's streams at t with the embedding of
    token t+1 and predicts token t+2. `embed` and `head` are the main model's (shared)."""

    def __init__(self, layer_id: int, cfg: ModelConfig):
        super().__init__(layer_id, cfg)
        dt = torch_dtype(cfg)
        self.e_proj = Linear(cfg.dim, cfg.dim, dt)
        self.h_proj = Linear(cfg.dim, cfg.dim, dt)
        self.enorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.hnorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.hc_head_fn = nn.Parameter(torch.empty(cfg.hc_mult, cfg.hc_mult * cfg.dim))
        self.hc_head_base = nn.Parameter(torch.empty(cfg.hc_mult))
        self.hc_head_scale = nn.Parameter(torch.empty(1))

    def forward(self, H: torch.Tensor, next_ids: torch.Tensor, embed: nn.Embedding,
                want_indexer_loss: bool = False) -> torch.Tensor:
        e = self.enorm(embed(next_ids))
        X = self.e_proj(e).unsqueeze(2) + self.h_proj(self.hnorm(H))   # hnorm: per stream over d
        return super().forward(X, next_ids, want_indexer_loss)


class ModelOutput(NamedTuple):
    logits: torch.Tensor                 # [B, S, V] fp32; position t predicts token t+1
    mtp_logits: list[torch.Tensor]       # k-th: [B, S-k-1, V]; position t predicts token t+k+2
    indexer_loss: torch.Tensor | None    # mean KL over ratio-4 layers (forward(..., indexer_loss=True))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, init: bool = True):
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        dt = torch_dtype(cfg)
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim, dtype=dt)
        self.layers = nn.ModuleList(Block(i, cfg) for i in range(cfg.n_layers))
        self.mtp = nn.ModuleList(MTPBlock(cfg.n_layers + k, cfg) for k in range(cfg.n_mtp_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.head = Linear(cfg.dim, cfg.vocab_size, torch.float32)
        self.hc_head_fn = nn.Parameter(torch.empty(cfg.hc_mult, cfg.hc_mult * cfg.dim))
        self.hc_head_base = nn.Parameter(torch.empty(cfg.hc_mult))
        self.hc_head_scale = nn.Parameter(torch.empty(1))
        set_qat_points(self, cfg)
        if init:
            self.init_weights(cfg.seed)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        for name, p in self.named_parameters():
            p.copy_(init_param(name, tuple(p.shape), self.cfg, seed))

    def head_logits(self, X, fn, scale, base, norm: RMSNorm) -> torch.Tensor:
        y = hc_head(X, fn, scale, base, self.cfg.hc_eps, self.cfg.norm_eps)
        return fp32_linear(norm(y), self.head.weight, self.cfg)

    def forward(self, input_ids: torch.Tensor, indexer_loss: bool = False) -> ModelOutput:
        cfg = self.cfg
        X = self.embed(input_ids).unsqueeze(2).repeat(1, 1, cfg.hc_mult, 1)   # hc identical streams
        for layer in self.layers:
            X = layer(X, input_ids, indexer_loss)
        logits = self.head_logits(X, self.hc_head_fn, self.hc_head_scale, self.hc_head_base, self.norm)
        mtp_logits, H = [], X
        for k, blk in enumerate(self.mtp):
            if input_ids.shape[1] <= k + 1:
                break
            H = blk(H[:, :-1], input_ids[:, k + 1:], self.embed, indexer_loss)
            mtp_logits.append(self.head_logits(H, blk.hc_head_fn, blk.hc_head_scale, blk.hc_head_base, blk.norm))
        losses = [m.indexer_loss for m in self.modules() if isinstance(m, Attention) and m.indexer_loss is not None]
        return ModelOutput(logits, mtp_logits, torch.stack(losses).mean() if indexer_loss and losses else None)


def set_qat_points(root: nn.Module, cfg: ModelConfig) -> None:
    """Set each Linear's QAT points from the release format of its weight (found by its official name under
    `root`): FP8-stored weights get the FP8 points when cfg.fp8_gemm_inputs, FP4-stored experts the MXFP4 weight
    point when cfg.mxfp4_experts; with cfg.qat_rollout_fp8 every one of them gets the FP8 weight point, the FP8
    the RL sync sends. The megatron stages call this too, so the flags mean the same in training."""
    for name, mod in root.named_modules():
        if isinstance(mod, Linear):
            fmt = cfg.storage_format(name + ".weight")
            if fmt in ("fp8", "fp4") and name != "head":
                # wo_a is read in an einsum, not through forward(): its input is never quantised
                mod.qat_input = "fp8" if cfg.fp8_gemm_inputs and not name.endswith("wo_a") else None
                mod.qat_weight = fmt if (fmt == "fp8" and cfg.fp8_gemm_inputs) or \
                    (fmt == "fp4" and cfg.mxfp4_experts) else None
                if cfg.qat_rollout_fp8:
                    mod.qat_weight = "fp8"


# =============================================================================================== init
def init_param(name: str, shape: tuple[int, ...], cfg: ModelConfig, seed: int) -> torch.Tensor:
    """Deterministic initial value of one parameter (fp32, or int32 for tid2eid), seeded by (seed, name), so
    the model and the checkpoint generator produce identical tensors without materialising each other.
    Linear weights ~ N(0, 1/fan_in); norms ~ 1 + N(0, 0.1^2); the comb part of hc bases ~ N(0, 1) so a random
    model has non-symmetric Sinkhorn matrices (orientation bugs show up), other hc bases 0, hc scales 0.1;
    attn_sink and the gate bias 0; ape ~ N(0, 0.5^2); embed ~ N(0, 1)."""
    g = torch.Generator().manual_seed((seed * 0x9E3779B1 + zlib.crc32(name.encode())) % (2 ** 63))
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "tid2eid":
        r = torch.rand(shape[0], cfg.n_routed_experts, generator=g)
        return r.argsort(-1)[:, :shape[1]].to(torch.int32)          # distinct experts per token
    if leaf in ("attn_sink", "bias"):
        return torch.zeros(shape)
    if leaf == "ape":
        return torch.randn(shape, generator=g) * 0.5
    if leaf.startswith("hc_") and leaf.endswith("_scale"):
        return torch.full(shape, 0.1)
    if leaf.startswith("hc_") and leaf.endswith("_base"):
        base = torch.zeros(shape)
        if shape[0] > cfg.hc_mult:       # block mixes: [pre | post | comb]
            base[2 * cfg.hc_mult:] = torch.randn(shape[0] - 2 * cfg.hc_mult, generator=g)
        return base
    if leaf.startswith("hc_") and leaf.endswith("_fn"):
        return torch.randn(shape, generator=g) * shape[1] ** -0.5
    if name == "embed.weight":
        return torch.randn(shape, generator=g)
    if "norm" in name.rsplit(".", 2)[-2]:
        return 1 + 0.1 * torch.randn(shape, generator=g)
    return torch.randn(shape, generator=g) * shape[-1] ** -0.5
