"""The hyper-connections' Sinkhorn normalisation in one kernel forward and one backward (the rollout engine's
decode step; training's compiled hyper-connections with `compiled=...+sinkhorn`).

`dsv4.model.sinkhorn` on a [..., hc, hc] tensor is 2 reductions and 2 divisions per iteration, 20 iterations
per sub-block: in torch about 120 kernel launches on a few hundred bytes. inductor fuses each division with its
reduction but not the iterations (each reduction needs the previous one whole), which left ~300 tiny kernels in
a compiled decode step of the 4-layer model. Here one program holds BLOCK matrices in registers and runs every
iteration there. Triton rather than TileLang: the kernel is elementwise work on 4x4 tiles beside inductor's own
Triton kernels, and a custom op (`dsv4::sinkhorn`) keeps it opaque to dynamo, so the compiled regions call it
without a graph break.

Same operation order as the reference: row softmax plus eps, columns normalised, then (iters - 1) row/column
pairs, each sum plus eps. The sums of hc terms may associate differently (fp32 round-off).

Backward: autograd through the reference keeps every iteration's matrix and runs ~4 kernels an iteration (inductor
does not fuse across iterations either way), ~80 launches a sub-block's backward: with the forward's ~40, about
10,000 of a 4-layer training step's launches at 8 micro-batches, host time on a step the host already paces
(docs/training.md). Here the backward keeps only the logits and, for each of the 2*iters - 1 normalisations from
the last to the first, recomputes its input from them in registers (O(iters^2) steps on 4x4 tiles, cheaper than
the launch it replaces) and applies that normalisation's vector-Jacobian product:
y = c / (s + eps), s the sum of c along the axis => dc = (dy - sum(dy * y)) / (s + eps) along it; then the
softmax's, dx = p * (dg - sum(dg * p)) (the + eps has no gradient).
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:      # no Triton: `available()` is False and callers keep the torch reference
    triton = None


def available(t: torch.Tensor, hc: int) -> bool:
    """Whether the kernel serves [..., hc, hc] matrices on t's device (CUDA, Triton, hc a power of two)."""
    return triton is not None and t.is_cuda and hc & (hc - 1) == 0


if triton is not None:
    @triton.jit
    def _sinkhorn_kernel(x_ptr, out_ptr, n_mat, eps, ITERS: tl.constexpr, HC: tl.constexpr, BLOCK: tl.constexpr):
        m = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        r = tl.arange(0, HC)
        offs = m[:, None, None] * (HC * HC) + r[None, :, None] * HC + r[None, None, :]
        mask = (m < n_mat)[:, None, None] & (r < HC)[None, :, None] & (r < HC)[None, None, :]
        c = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        c = tl.exp(c - tl.max(c, axis=2)[:, :, None])
        c = c / tl.sum(c, axis=2)[:, :, None] + eps
        c = c / (tl.sum(c, axis=1)[:, None, :] + eps)
        for _ in range(ITERS - 1):
            c = c / (tl.sum(c, axis=2)[:, :, None] + eps)
            c = c / (tl.sum(c, axis=1)[:, None, :] + eps)
        tl.store(out_ptr + offs, c, mask=mask)

    @triton.jit
    def _normalise(c, j, eps):
        """Normalisation j of the sequence the forward runs: columns at even j, rows at odd j."""
        if j % 2 == 0:
            c = c / (tl.sum(c, axis=1)[:, None, :] + eps)
        else:
            c = c / (tl.sum(c, axis=2)[:, :, None] + eps)
        return c

    @triton.jit
    def _sinkhorn_bwd_kernel(x_ptr, g_ptr, dx_ptr, n_mat, eps, STEPS: tl.constexpr, HC: tl.constexpr,
                             BLOCK: tl.constexpr):
        m = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        r = tl.arange(0, HC)
        offs = m[:, None, None] * (HC * HC) + r[None, :, None] * HC + r[None, None, :]
        mask = (m < n_mat)[:, None, None] & (r < HC)[None, :, None] & (r < HC)[None, None, :]
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        p = tl.exp(x - tl.max(x, axis=2)[:, :, None])
        p = p / tl.sum(p, axis=2)[:, :, None]
        for back in range(STEPS):
            k = STEPS - 1 - back
            c = p + eps                                   # normalisation k's input, recomputed from the logits
            for j in range(k):
                c = _normalise(c, j, eps)
            if k % 2 == 0:                                # (the sums' shapes differ: a name for each)
                s_col = tl.sum(c, axis=1)[:, None, :] + eps
                g = (g - tl.sum(g * (c / s_col), axis=1)[:, None, :]) / s_col
            else:
                s_row = tl.sum(c, axis=2)[:, :, None] + eps
                g = (g - tl.sum(g * (c / s_row), axis=2)[:, :, None]) / s_row
        tl.store(dx_ptr + offs, p * (g - tl.sum(g * p, axis=2)[:, :, None]), mask=mask)


@torch.library.custom_op("dsv4::sinkhorn", mutates_args=())
def sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """[..., hc, hc] fp32 on CUDA (hc a power of two) -> doubly stochastic, as dsv4.model.sinkhorn."""
    hc = logits.shape[-1]
    x = logits.float().contiguous()
    out = torch.empty_like(x)
    n = x.numel() // (hc * hc)
    block = 64
    _sinkhorn_kernel[(triton.cdiv(n, block),)](x, out, n, eps, ITERS=iters, HC=hc, BLOCK=block)
    return out


@sinkhorn.register_fake
def _(logits, iters, eps):
    return torch.empty_like(logits, dtype=torch.float32)


@torch.library.custom_op("dsv4::sinkhorn_backward", mutates_args=())
def sinkhorn_backward(logits: torch.Tensor, grad: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """The gradient of `sinkhorn(logits, iters, eps)` with respect to fp32 logits, given the output's `grad`."""
    hc = logits.shape[-1]
    x, g = logits.float().contiguous(), grad.float().contiguous()
    dx = torch.empty_like(x)
    n = x.numel() // (hc * hc)
    block = 64
    _sinkhorn_bwd_kernel[(triton.cdiv(n, block),)](x, g, dx, n, eps, STEPS=2 * iters - 1, HC=hc, BLOCK=block)
    return dx


@sinkhorn_backward.register_fake
def _(logits, grad, iters, eps):
    return torch.empty_like(logits, dtype=torch.float32)


def _setup_context(ctx, inputs, output):
    logits, ctx.iters, ctx.eps = inputs
    ctx.dtype = logits.dtype
    ctx.save_for_backward(logits)


def _backward(ctx, grad):
    (logits,) = ctx.saved_tensors
    return sinkhorn_backward(logits, grad, ctx.iters, ctx.eps).to(ctx.dtype), None, None


sinkhorn.register_autograd(_backward, setup_context=_setup_context)
