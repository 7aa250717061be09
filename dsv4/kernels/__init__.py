"""Kernel dispatchers the model calls.

Each op has a pure-torch reference (`impl="torch"`, dsv4/kernels/reference.py) and a TileLang kernel
(`impl="tilelang"`). TileLang is imported only when asked for, so importing this module (and the model)
costs no compiler start-up and works where TileLang is not installed.

Conventions shared by both implementations (see docs/kernels.md):
- `topk_idxs == -1` marks a padded slot: it contributes nothing, and its KV row is never read.
- `attn_sink[h]` is a logit in the scaled-score space; it enters the softmax denominator only.
- A row with no valid index returns 0 (the sink alone takes all the probability mass).
- Indices outside [0, N) are treated as padding by the TileLang kernels.
"""
from __future__ import annotations

import logging
import sys

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


def sparse_attn_lse(q, kv, attn_sink, topk_idxs, softmax_scale: float, impl: str = "torch"):
    """Forward with the log-sum-exp: (o, lse[B,S,H] fp32, natural log, sink included). Not differentiable
    under impl='tilelang' (use sparse_attn for training)."""
    _check_impl(impl, "sparse_attn_lse")
    if impl == "tilelang":
        from .tilelang_sparse_attn import sparse_attn_fwd
        return sparse_attn_fwd(q, kv, attn_sink, topk_idxs, softmax_scale)
    from .reference import sparse_attn_gather_lse
    return sparse_attn_gather_lse(q, kv, attn_sink, topk_idxs, softmax_scale)


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
    from .reference import indexer_topk as topk_of
    return topk_of(indexer_logits(q, k, weights, ratio, impl), topk)


def act_quant(x, block_size: int = 128, scale_fmt: str | None = None, impl: str = "torch"):
    """Blockwise FP8 e4m3 quantization along the last dim -> (q float8_e4m3fn, scales fp32 [..., D/block]).
    scale_fmt None: scale = amax/448; "ue8m0": the power of two at or above it."""
    _check_impl(impl, "act_quant")
    if scale_fmt not in (None, "ue8m0"):
        raise ValueError(f"act_quant: scale_fmt must be None or 'ue8m0', got {scale_fmt!r}")
    if impl == "tilelang":
        from .tilelang_act_quant import act_quant as tl_act_quant
        return tl_act_quant(x, block_size, scale_fmt)
    from dsv4.quant import act_quant as act_quant_ref
    return act_quant_ref(x, block_size, ue8m0=scale_fmt == "ue8m0")


def tilelang_compile(program, out_idx, pass_configs: dict | None = None):
    """Compile a TileLang PrimFunc for the current GPU. On Hopper the target is spelled out
    (sm_90a, tvm_ffi) rather than auto-detected, so kernels prebuilt on a GPU-less machine with the same
    target land in the same TileLang cache entry (TILELANG_CACHE_DIR) and are reused as they are."""
    import tilelang
    import torch
    _tilelang_logs_to_stderr()
    target = "auto"
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() == (9, 0):
        target = HOPPER_TARGET
    try:
        return tilelang.compile(program, out_idx=out_idx, target=target, execution_backend="tvm_ffi",
                                pass_configs=dict(pass_configs or {}))
    except (TypeError, ValueError, AttributeError):   # tilelang < 0.1.15 wants a Target object
        if target is not HOPPER_TARGET:
            raise
        from tvm.target import Target
        return tilelang.compile(program, out_idx=out_idx, target=Target(HOPPER_TARGET), execution_backend="tvm_ffi",
                                pass_configs=dict(pass_configs or {}))


HOPPER_TARGET = {"kind": "cuda", "arch": "sm_90a"}


class _Stderr(logging.Handler):
    """Writes each record to the sys.stderr of the moment (pytest's capture and redirections included)."""

    def emit(self, record):
        try:
            sys.stderr.write(self.format(record) + "\n")
        except Exception:
            self.handleError(record)


def _tilelang_logs_to_stderr() -> None:
    """TileLang logs each compile ("begins to compile kernel ...") through tqdm.write, which prints on stdout: a
    command's `--json` output then does not parse (`v4 bench kernels --json` did not, on a cache miss). Its
    handlers are swapped for ones that write to stderr, same format."""
    log = logging.getLogger("tilelang")
    for h in list(log.handlers):
        if not isinstance(h, _Stderr):
            log.removeHandler(h)
            out = _Stderr(h.level)
            out.setFormatter(h.formatter)
            log.addHandler(out)
