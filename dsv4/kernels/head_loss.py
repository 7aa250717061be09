"""The LM head's GEMM and its per-token cross-entropy as one autograd function, chunked over rows, that keeps what the
backward needs in bf16 (ModelConfig.head_loss = "fused").

The eager head (head_loss "eager") computes the fp32 logits [tokens, vocab] with split_gemm.linear, then
F.cross_entropy(reduction="none"). Autograd keeps the fp32 log-softmax for the backward (the logits themselves are
dropped once the caller lets go of them, but the two coexist in the forward), and the fp32 gradient of the logits
goes through several full passes before split_gemm rounds it to bf16 for its two GEMMs. On the H200 profile the
fp32 softmax alone is ~33 ms of a 1.23 s step.

Here, per chunk of _CHUNK_ROWS rows (at most one chunk's fp32 logits exist at once):
* forward: the fp32 logits by split_gemm's split GEMM (bf16 x exact: x @ hi(w) + x @ lo(w), two GEMMs, fp32 out; an
  fp32 x is split too, three), the halves from split_gemm.weight_halves (once a step under
  dsv4.stepmemo.weights_fixed()); then one compiled kernel (torch.compile, one graph per shape) that reads them for
  the row max and sum of exponentials and once more to write p = softmax(logits) in bf16 into a [tokens, vocab]
  buffer kept for the backward, and per row, in fp32, the loss lse - logit[label] and the label's term of the
  gradient, p_label - 1. The temperature and the allowed-token mask are applied inside the same reads.
* backward: one compiled kernel writes the logits' gradient (p - onehot(label)) * g / temperature in bf16 in place
  of p, the label entry from the fp32 p_label - 1; then the two bf16 GEMMs of split_gemm's "bf16x3_fwd" backward
  over all rows at once (dx = G @ bf16(w), dw = G^T @ bf16(x), fp32 out), so dw is one fp32 [vocab, dim] output
  (split_gemm's backward accumulates it chunk by chunk into a new output each time, holding two).

What it saves, per head (the LM head and each MTP block's) and micro-batch at 4096 tokens x 129,280 vocab x dim 4096.
COMPUTED from the kernels' reads and writes, NOT MEASURED on a GPU yet (tests/kernels/test_head_loss_gpu.py
measures the peak). One fp32 [tokens, vocab] tensor is 2,118,123,520 bytes, one bf16 1,059,061,760; a "pass" below is
one fp32 tensor's bytes read or written once.
* kept from forward to backward (besides x and w, which both keep): eager the fp32 log-softmax, 2,118,123,520 bytes;
  fused the bf16 p, 1,059,061,760, and p_label - 1 (fp32 per row), 16,384: 1,059,078,144 bytes in all.
* peak at the head, not counting the weight halves or bf16(w) (both paths hold them, unless the memo keeps them
  anyway): eager forward 4,236,247,040 (two fp32 tensors: the split GEMM's accumulator and output, then logits
  and log-softmax); fused forward 2,118,123,520 (p and two fp32 chunks of 1024 rows). Eager backward 6,883,901,440
  with the weight's gradient (the fp32 logits' gradient, a bf16 chunk of 2048 rows and two dw buffers; 6,354,370,560
  during the log-softmax backward: its output, its input gradient and its result); fused backward 3,277,848,576
  with the weight's gradient (the bf16 gradient, dw, dx in fp32 and bf16).
* passes over [tokens, vocab] (the GEMMs' reads of their bf16 input counted once): eager forward 7 (split GEMM 3:
  write, read + write; log-softmax 4: max, sum, read + write), backward 7.5 (nll's dense zero fill 1, log-softmax
  backward 4: its sum, gradient and output read, result written, split_gemm's cast to bf16 1.5, the GEMMs 1): 14.5,
  30.7 GB. Fused forward 6.5 (split GEMM 3; max and sum 2, or 1 with inductor's online softmax; p 1.5), backward 2
  (0.5 read + 0.5 write in place, the GEMMs 1): 8.5, 18.0 GB (7.5 with online softmax). The RL scoring path
  (logits / temperature, masked_fill of the disallowed tokens) adds 8 passes to the eager path (a read and a write
  per op, forward and backward) and none to the fused one: 22.5 against 8.5.

Numerics: the logits are the split GEMM's (fp32-grade, as the eager path's); lse, the loss and p_label are fp32 from
them, with log_softmax's arithmetic, so the loss is the eager path's up to fp32 rounding. The gradient is rounded to
bf16 as split_gemm's "bf16x3_fwd" backward rounds it; storing p in bf16 first rounds its entries twice (relative
error <= 2 x 2^-8 instead of 2^-8). The label entry, p_label - 1, is formed from the fp32 p_label: from a bf16 p it
would be lost where the model is confident (p_label 0.999 rounds to 1.0 in bf16, a zero gradient). Only fp32_gemm
"bf16x3_fwd" is fused: dsv4.megatron.model keeps the eager path for the other forms, for TP > 1 and off CUDA.

Labels equal to -100 (F.cross_entropy's ignore_index) give a zero loss and no gradient, as F.cross_entropy's do; a
label outside the allowed set gets logit -1e30 (loss ~1e30, no gradient at its own entry, as masked_fill's backward
gives): the caller's loss mask is expected to exclude it, as it must on the eager path.

On a CPU (`torch.mm`'s `out_dtype` has no CPU kernel) the same algorithm runs in an fp32 reference form: the same
weight halves, GEMMs of the bf16 operands upcast to fp32 (their products are exact in fp32, so only the summation
order differs from the GPU), the same chunks, bf16 p, label term and gradient formula, the elementwise parts eager
(tests/kernels/test_head_loss.py). The backward writes the gradient into the saved p, so a second backward through
the same graph (retain_graph) is refused. Without a gradient to compute (no_grad, or neither input requiring one)
no p is kept.
"""
from __future__ import annotations

from functools import lru_cache

import torch

from dsv4.kernels import split_gemm

# rows per chunk of the forward's fp32 logits: the split GEMM holds two fp32 [rows, vocab] buffers at once (its
# accumulator and its output), 2 x 0.53 GB at 1024 x 129,280
_CHUNK_ROWS = 1024
IGNORE_INDEX = -100          # F.cross_entropy's default: such rows add no loss and no gradient
_MASKED = -1e30              # dsv4.megatron.model.DSV4Stage._scored_logits's fill for disallowed tokens


# ---------------------------------------------------------------------------------------------- GEMMs
def _mm(a: torch.Tensor, b: torch.Tensor, acc: torch.Tensor | None = None) -> torch.Tensor:
    """a @ b of bf16 operands with an fp32 result (+ acc). CUDA: split_gemm's tensor-core GEMM; elsewhere the fp32
    GEMM of the upcast operands (bf16 products are exact in fp32: only the summation order differs)."""
    if a.is_cuda:
        return split_gemm._mm(a, b, acc)
    y = a.float() @ b.float()
    return y if acc is None else acc + y


def _logits(x: torch.Tensor, wh: torch.Tensor, wl: torch.Tensor) -> torch.Tensor:
    """x [r, K] @ (wh + wl)^T -> fp32 [r, V]: x bf16 is exact (two GEMMs, split_gemm._xw), fp32 x is split (three)."""
    if x.dtype == torch.bfloat16:
        return _mm(x, wl.t(), _mm(x, wh.t()))
    xh, xl = split_gemm.split(x.float())
    return _mm(xh, wl.t(), _mm(xl, wh.t(), _mm(xh, wh.t())))


# ---------------------------------------------------------------------------------------------- elementwise parts
def chunk_forward(logits: torch.Tensor, labels: torch.Tensor, temperature: float, allowed: torch.Tensor | None,
                  p_out: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk's loss and label term from its fp32 logits [r, V]: (lse - z[label], p_label - onehot weight), both
    fp32 [r], z = logits / temperature with disallowed tokens at -1e30. Writes p = softmax(z) in bf16 into p_out
    [r, V] when given. The arithmetic is log_softmax's: z - max - log(sum exp(z - max))."""
    z = logits / temperature if temperature != 1.0 else logits
    if allowed is not None:
        z = z.masked_fill(~allowed, _MASKED)
    m = z.amax(dim=-1, keepdim=True)
    log_s = torch.log(torch.exp(z - m).sum(dim=-1, keepdim=True))
    valid = labels != IGNORE_INDEX
    idx = torch.where(valid, labels, 0)
    logp_label = (z.gather(1, idx[:, None]) - m) - log_s                 # [r, 1]
    if p_out is not None:
        p_out.copy_(torch.exp((z - m) - log_s))
    loss = torch.where(valid, -logp_label.squeeze(1), 0.0)
    onehot = 1.0 if allowed is None else allowed[idx].float()          # the mask's backward zeroes a masked label
    return loss, torch.exp(logp_label.squeeze(1)) - onehot


def chunk_backward(p: torch.Tensor, labels: torch.Tensor, dlabel: torch.Tensor, g: torch.Tensor) -> None:
    """p [r, V] bf16 <- the logits' gradient (p - onehot) * g in bf16, in place; the label entry is dlabel * g
    (dlabel = p_label - 1 in fp32). g [r] fp32 (already divided by the temperature); ignored rows get zero."""
    g = torch.where(labels != IGNORE_INDEX, g, 0.0)
    col = torch.arange(p.shape[1], device=p.device)
    G = torch.where(col[None, :] == labels[:, None], (dlabel * g)[:, None], p.float() * g[:, None])
    p.copy_(G.to(torch.bfloat16))


@lru_cache(maxsize=None)
def _compiled(name: str):
    # one graph per shape (dynamic=False: the chunk's rows and the vocabulary are constants of the kernel); a
    # training step sees two row counts (full chunks and the last one)
    return torch.compile({"forward": chunk_forward, "backward": chunk_backward}[name], dynamic=False)


def _part(name: str, t: torch.Tensor, compiled: bool | None):
    if compiled if compiled is not None else t.is_cuda:
        return _compiled(name)
    return chunk_forward if name == "forward" else chunk_backward


# ---------------------------------------------------------------------------------------------- the function
def _forward(x, w, labels, temperature: float, allowed, compiled, keep: bool):
    """(loss [M], p [M, V] bf16 or None, dlabel [M]) chunk by chunk; p only when `keep` (a backward will follow)."""
    M, V = x.shape[0], w.shape[0]
    wh, wl = split_gemm.weight_halves(w)
    p = torch.empty((M, V), dtype=torch.bfloat16, device=x.device) if keep else None
    loss = torch.empty(M, dtype=torch.float32, device=x.device)
    dlabel = torch.empty(M, dtype=torch.float32, device=x.device)
    fwd = _part("forward", x, compiled)
    for i in range(0, M, _CHUNK_ROWS):
        rows = slice(i, min(i + _CHUNK_ROWS, M))
        logits = _logits(x[rows], wh, wl)
        loss[rows], dlabel[rows] = fwd(logits, labels[rows], temperature, allowed, p[rows] if keep else None)
        del logits                              # the next chunk's GEMM may reuse its memory
    return loss, p, dlabel


class _HeadLoss(torch.autograd.Function):
    """x [M, K] (bf16, or fp32), w [V, K] fp32, labels [M] int64 -> per-token cross-entropy [M] fp32."""

    @staticmethod
    def forward(ctx, x, w, labels, temperature: float, allowed, compiled):
        loss, p, dlabel = _forward(x, w, labels, temperature, allowed, compiled, keep=True)
        ctx.save_for_backward(x, w, labels, p, dlabel)
        ctx.temperature, ctx.compiled, ctx.used = temperature, compiled, False
        return loss

    @staticmethod
    def backward(ctx, g):
        if ctx.used:
            raise RuntimeError("head_loss: the backward writes the logits' gradient into its saved softmax, so it runs "
                               "once per forward (no retain_graph); use head_loss='eager' to backpropagate twice")
        ctx.used = True
        x, w, labels, p, dlabel = ctx.saved_tensors
        g = g.float()
        if ctx.temperature != 1.0:
            g = g / ctx.temperature
        bwd = _part("backward", x, ctx.compiled)
        for i in range(0, x.shape[0], _CHUNK_ROWS):
            rows = slice(i, min(i + _CHUNK_ROWS, x.shape[0]))
            bwd(p[rows], labels[rows], dlabel[rows], g[rows])
        G = p                                   # now the logits' gradient, bf16 [M, V]
        need_x, need_w = ctx.needs_input_grad[:2]
        gx = gw = None
        if need_x:                              # as split_gemm's bf16x3_fwd backward: bf16(w) is the hi half
            wh = split_gemm.weight_halves(w)[0] if split_gemm._HALVES.open else w.to(torch.bfloat16)
            gx = _mm(G, wh).to(x.dtype)
        if need_w:
            gw = _mm(G.t(), x.to(torch.bfloat16))
        return gx, gw, None, None, None, None


def linear_cross_entropy(x: torch.Tensor, w: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0,
                         allowed: torch.Tensor | None = None, compiled: bool | None = None) -> torch.Tensor:
    """F.cross_entropy(F.linear(x, w) / temperature, masked to `allowed`, labels, reduction="none") for x [..., K]
    (bf16: exact; or fp32), w [V, K] fp32, labels [...] int64 (-100: ignored) -> fp32 [...], differentiable in x and
    w. allowed: [V] bool or None (disallowed tokens' logits -1e30, as DSV4Stage._scored_logits). compiled: the
    elementwise parts through torch.compile (default: on CUDA). On a CPU the fp32 reference form runs."""
    if x.shape[:-1] != labels.shape:
        raise ValueError(f"head_loss: x {tuple(x.shape)} and labels {tuple(labels.shape)} disagree on the token dims")
    x2d = x.reshape(-1, x.shape[-1])
    if x2d.dtype != torch.bfloat16:
        x2d = x2d.float()
    if allowed is not None:
        allowed = allowed.to(device=x.device, dtype=torch.bool)
        if allowed.shape != (w.shape[0],):
            raise ValueError(f"head_loss: allowed {tuple(allowed.shape)} is not one flag per vocabulary row "
                             f"({w.shape[0]})")
    args = (x2d, w.float(), labels.reshape(-1), float(temperature), allowed, compiled)
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
        loss = _HeadLoss.apply(*args)
    else:                                       # no backward: no softmax kept
        loss = _forward(*args, keep=False)[0]
    return loss.view(labels.shape)
