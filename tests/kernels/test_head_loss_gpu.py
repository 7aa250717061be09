"""GPU: the fused head loss (dsv4/kernels/head_loss.py, ModelConfig.head_loss="fused") against the eager head it
replaces (split_gemm.linear with fp32_gemm "bf16x3_fwd", then F.cross_entropy) on CUDA: the loss, the gradients
within the bf16-rounding bound of tests/kernels/test_head_loss.py (held by both paths, against fp64), the peak
memory of a forward and backward at 4096 tokens x 129,280 vocab, and a DSV4Stage's losses and gradients with
head_loss eager vs fused."""
from __future__ import annotations

import gc
from types import SimpleNamespace

import pytest
import torch

from dsv4.kernels import head_loss as hl
from dsv4.kernels import split_gemm
from dsv4.megatron.model import DSV4Stage
from test_head_loss import ONE, _bound_ratios, _g, _reference, run_stage_script

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _eager(x, w, labels, score=None):
    """The model's eager head at TP = 1: split_gemm.linear (bf16x3_fwd), _scored_logits, cross_entropy."""
    stage = SimpleNamespace(ranks=ONE, _score_args=DSV4Stage._score_args)
    logits = split_gemm.linear(x, w, split_backward=False)
    if score is not None:
        logits = DSV4Stage._scored_logits(stage, logits, score)
    return DSV4Stage.cross_entropy(stage, logits[None], labels[None])[0]


@pytest.mark.parametrize("scored", [False, True], ids=["lm", "scored"])
def test_fused_matches_the_eager_head(scored):
    M, K, V = 3000, 512, 32000                      # 3000 rows: three chunks of 1024, the last one ragged
    g0 = torch.Generator().manual_seed(0)
    x = torch.randn(M, K, generator=g0).to(torch.bfloat16).cuda()
    w = (torch.randn(V, K, generator=g0) * 0.1).cuda()
    labels = torch.randint(0, V, (M,), generator=g0).cuda()
    labels[7] = hl.IGNORE_INDEX
    g = _g(M).cuda()
    score, t, allowed = None, 1.0, None
    if scored:
        allowed = (torch.rand(V, generator=g0) < 0.7).cuda()
        allowed[labels[labels >= 0]] = True
        score, t = {"temperature": 0.8, "allowed": allowed}, 0.8
    ref = _reference(x, w, labels, g, temperature=t, allowed=allowed)           # fp64, on the GPU
    results = {}
    for name in ("eager", "fused"):
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        if name == "fused":
            loss = hl.linear_cross_entropy(xs, ws, labels, t, allowed)
        else:
            loss = _eager(xs, ws, labels, score)
        (loss * g).sum().backward()
        results[name] = (loss.detach(), xs.grad, ws.grad)
    (le, gxe, gwe), (lf, gxf, gwf) = results["eager"], results["fused"]
    assert torch.isfinite(lf).all() and lf.dtype == torch.float32
    torch.testing.assert_close(lf, le, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(lf.double(), ref[0], rtol=1e-5, atol=1e-4)
    ratios = {name: _bound_ratios(x, w, labels, g, gx, gw, ref, temperature=t)
              for name, (_, gx, gw) in results.items()}
    print(f"\nerror / bound (dx, dw): {ratios}")
    for name, (rx, rw) in ratios.items():
        assert rx <= 1 and rw <= 1, (name, rx, rw)


def _peak_bytes(step) -> int:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def test_fused_peak_memory_is_below_the_eager_heads():
    """Forward + backward of one micro-batch of 4096 tokens through the DSV4 head (4096 x 129,280, fp32 weight): the
    peak allocated beyond the inputs (the weight's gradient, 2.1 GB, in both)."""
    M, K, V = 4096, 4096, 129280
    g0 = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(M, K, device="cuda", generator=g0).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(V, K, device="cuda", generator=g0) * 0.02).requires_grad_()
    labels = torch.randint(0, V, (M,), device="cuda", generator=g0)
    mask = torch.ones(M, device="cuda")

    def step(fused: bool):
        def run():
            loss = hl.linear_cross_entropy(x, w, labels) if fused else _eager(x, w, labels)
            (loss * mask).sum().backward()
        return run

    peaks = {}
    for fused in (True, False):
        step(fused)()                               # warm-up: compilation, cuBLAS workspaces
        x.grad = w.grad = None
        peaks["fused" if fused else "eager"] = _peak_bytes(step(fused))
        assert torch.isfinite(w.grad).all() and torch.isfinite(x.grad).all()
        x.grad = w.grad = None
    print(f"\npeak beyond the inputs: eager {peaks['eager'] / 1e9:.3f} GB  fused {peaks['fused'] / 1e9:.3f} GB "
          f"({peaks['eager']} / {peaks['fused']} bytes)")
    assert peaks["fused"] < peaks["eager"], peaks


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_stage_losses_equal_with_eager_and_fused_head_loss(dtype):
    """A tiny DSV4Stage (world 1, NCCL) on CUDA: the LM and MTP losses, RL's scored log-probabilities and every
    gradient with head_loss eager and fused. dtype fp32: the head's input is fp32 (split as the eager GEMM splits
    it)."""
    run_stage_script("cuda", dtype)
