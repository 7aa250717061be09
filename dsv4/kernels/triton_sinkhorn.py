"""The hyper-connections' Sinkhorn normalisation in one kernel (forward only: the rollout engine's decode step).

`dsv4.model.sinkhorn` on a [..., hc, hc] tensor is 2 reductions and 2 divisions per iteration, 20 iterations
per sub-block: in torch about 120 kernel launches on a few hundred bytes. inductor fuses each division with its
reduction but not the iterations (each reduction needs the previous one whole), which left ~300 tiny kernels in
a compiled decode step of the 4-layer model. Here one program holds BLOCK matrices in registers and runs every
iteration there. Triton rather than TileLang: the kernel is elementwise work on 4x4 tiles beside inductor's own
Triton kernels, and a custom op (`dsv4::sinkhorn`) keeps it opaque to dynamo, so the compiled regions call it
without a graph break.

Same operation order as the reference: row softmax plus eps, columns normalised, then (iters - 1) row/column
pairs, each sum plus eps. The sums of hc terms may associate differently (fp32 round-off).
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
