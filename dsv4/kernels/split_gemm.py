"""fp32 GEMMs on bf16 tensor cores: each fp32 operand split in two bf16 halves ("bf16x3").

The DSV4 head is fp32 (as in the official inference code: logits and the RL logprobs need it), and its GEMM
(dim x vocab = 4096 x 129,280) is the largest of the model. In fp32 it runs on the GPU's CUDA cores: on the
H200 about 50 TFLOP/s against ~700 for bf16 on the tensor cores, which made the head about half of a smoke
training step and the largest kernel of a decode step. TF32 would be fast but keeps only 10 mantissa bits.

The split: a = hi + lo with hi = bf16(a), lo = bf16(a - hi), so hi + lo carries 16 of fp32's 24 mantissa
bits. Then  a.b ~= hi_a.hi_b + hi_a.lo_b + lo_a.hi_b,  three bf16 GEMMs accumulated in fp32 with an fp32
output (cuBLAS through torch.mm / torch.addmm's `out_dtype`). What is dropped (lo_a.lo_b and the residual of
the split) is ~2^-16 of each product, against 2^-8 for one bf16 GEMM and 2^-11 for TF32; accumulation is
fp32 as before. tests/kernels/test_split_gemm_gpu.py measures the error against an fp64 product beside the
fp32 GEMM's own.

An input that is already bf16 (the head's: the final norm's bf16 output) is exact, so its lo half is zero and
the GEMM by it is skipped: two GEMMs, same result. The compressors' kv and gate projections are fp32 weights on
bf16 activations as well (ModelConfig.fp32_gemm covers both: dsv4.model.fp32_linear).

The backward can split too (`split_backward`, fp32_gemm "bf16x3": five GEMMs for a bf16 input) or run one bf16
GEMM per gradient (fp32_gemm "bf16x3_fwd": two), which rounds the logits' gradient to bf16 as every other
layer's gradient is: the logits themselves, which RL's log-probabilities read, stay split.

CUDA only: `mm`'s `out_dtype` has no CPU kernel, and on a CPU the fp32 GEMM is what runs anyway
(`linear` falls back to F.linear there, so CPU results stay exact).

While `dsv4.stepmemo.weights_fixed()` is open (the trainer opens it around one step's forward and backward, when
no weight changes) each weight is split once, not at every micro-batch: for the head that is 2 GB read and 1 GB written per
micro-batch saved, ~23 ms of an 8-micro-batch step at 4096 tokens on the H200.

`SplitWeight` keeps a weight's halves for a caller that multiplies by the same weight many times between
updates (the rollout engine's decode step): splitting a 2 GB head at every step would cost more than the
GEMM saves. Its buffers are refreshed in place, so a CUDA graph that captured them sees new weights.
"""
from __future__ import annotations

import torch

from dsv4.stepmemo import Memo, weight_key

# rows above which the backward splits its operands chunk by chunk (bounds the bf16 copies: a [rows, vocab]
# gradient in two bf16 halves is 4 * rows * vocab bytes, ~1 GB at 2048 x 129,280)
_CHUNK_ROWS = 2048
# at most this many rows, the two GEMMs by hi_b run as one on [hi_a; lo_a] (b is read once instead of twice:
# decode-sized GEMMs are bound by reading the weight)
_STACK_ROWS = 512


def split(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 -> (hi, lo) bf16 with hi + lo ~= t to 16 mantissa bits."""
    hi = t.to(torch.bfloat16)
    return hi, (t - hi.float()).to(torch.bfloat16)


_HALVES = Memo("fp32 weight halves")


def weight_halves(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """split(w), once per weight while dsv4.stepmemo.weights_fixed() is open."""
    return _HALVES.get(weight_key(w), lambda: split(w.detach()))


def _mm(a: torch.Tensor, b: torch.Tensor, acc: torch.Tensor | None = None) -> torch.Tensor:
    """a @ b (bf16) with an fp32 output, accumulated into `acc` (fp32) when given."""
    if acc is None:
        return torch.mm(a, b, out_dtype=torch.float32)
    return torch.addmm(acc, a, b, out_dtype=torch.float32)


def mm3(a_hi, a_lo, b_hi, b_lo, acc: torch.Tensor | None = None) -> torch.Tensor:
    """(a_hi + a_lo) @ (b_hi + b_lo) without the lo.lo term, fp32 out: a [M, K], b [K, N] (any strides)."""
    M = a_hi.shape[0]
    if M <= _STACK_ROWS:
        y = _mm(torch.cat([a_hi, a_lo]), b_hi)
        y = y[:M] + y[M:]
        if acc is not None:
            y = y + acc
    else:
        y = _mm(a_hi, b_hi, acc)
        y = _mm(a_lo, b_hi, y)
    return _mm(a_hi, b_lo, y)


def _xw(x: torch.Tensor, wh: torch.Tensor, wl: torch.Tensor) -> torch.Tensor:
    """x @ (wh + wl)^T for x [M, K] already exact in bf16 (its lo half is zero): two GEMMs."""
    return _mm(x, wl.t(), _mm(x, wh.t()))


class _SplitLinear(torch.autograd.Function):
    """x [M, K] @ w [N, K]^T -> fp32. x fp32 is split; x bf16 is exact, so the GEMMs by its lo half are skipped."""

    @staticmethod
    def forward(ctx, x2d: torch.Tensor, w: torch.Tensor, split_backward: bool) -> torch.Tensor:
        ctx.save_for_backward(x2d, w)
        ctx.split_backward = split_backward
        wh, wl = weight_halves(w)
        if x2d.dtype == torch.bfloat16:
            return _xw(x2d, wh, wl)
        return mm3(*split(x2d), wh.t(), wl.t())

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        x2d, w = ctx.saved_tensors
        g = g.float()
        exact = x2d.dtype == torch.bfloat16
        need_x, need_w = ctx.needs_input_grad[:2]
        gx = torch.empty(x2d.shape, dtype=torch.float32, device=x2d.device) if need_x else None
        gw = None
        if ctx.split_backward:
            wh, wl = weight_halves(w) if need_x else (None, None)
        elif need_x:                     # one bf16 GEMM per gradient, fp32 out (the hi half is bf16(w))
            wh = weight_halves(w)[0] if _HALVES.open else w.to(torch.bfloat16)
        for i in range(0, g.shape[0], _CHUNK_ROWS):
            rows = slice(i, i + _CHUNK_ROWS)
            if not ctx.split_backward:
                gh = g[rows].to(torch.bfloat16)
                if need_x:
                    gx[rows] = _mm(gh, wh)
                if need_w:
                    gw = _mm(gh.t(), x2d[rows].to(torch.bfloat16), gw)
                continue
            gh, gl = split(g[rows])
            if need_x:
                gx[rows] = mm3(gh, gl, wh, wl)                             # g @ W
            if need_w:                                                      # g^T @ x, summed over chunks
                if exact:
                    gw = _mm(gl.t(), x2d[rows], _mm(gh.t(), x2d[rows], gw))
                else:
                    xh, xl = split(x2d[rows])
                    gw = mm3(gh.t(), gl.t(), xh, xl, gw)
        return (gx.to(x2d.dtype) if gx is not None else None), gw, None


def linear(x: torch.Tensor, w: torch.Tensor, split_backward: bool = True) -> torch.Tensor:
    """F.linear(x, w) for x [..., K] (fp32, or bf16: then exact and not split) and fp32 w [N, K] -> fp32 [..., N],
    by the split on CUDA (differentiable in both), in fp32 elsewhere. split_backward=False: the backward's two
    GEMMs run as one bf16 GEMM each."""
    if not x.is_cuda:
        return torch.nn.functional.linear(x.float(), w.float())
    x2d = x.reshape(-1, x.shape[-1])
    y = _SplitLinear.apply(x2d if x2d.dtype == torch.bfloat16 else x2d.float(), w.float(), split_backward)
    return y.view(*x.shape[:-1], w.shape[0])


class SplitWeight:
    """The bf16 halves of a fixed fp32 weight w [N, K], for `x @ w^T` many times between updates (no autograd).
    `refresh()` re-splits into the same buffers, after the weight changed in place."""

    def __init__(self, w: torch.Tensor):
        self.w = w
        self.hi = torch.empty(w.shape, dtype=torch.bfloat16, device=w.device)
        self.lo = torch.empty_like(self.hi)
        self.refresh()

    @torch.no_grad()
    def refresh(self) -> None:
        hi, lo = split(self.w.detach().float())
        self.hi.copy_(hi)
        self.lo.copy_(lo)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] (fp32, or bf16: exact) -> fp32 [..., N]; CUDA only."""
        x2d = x.reshape(-1, x.shape[-1])
        if x2d.dtype == torch.bfloat16:
            y = _xw(x2d, self.hi, self.lo)
        else:
            y = mm3(*split(x2d.float()), self.hi.t(), self.lo.t())
        return y.view(*x.shape[:-1], self.w.shape[0])
