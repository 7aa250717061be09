"""Runtime switches (config.RUNTIME_SWITCHES) choose how the same math runs: each alternative must give the
reference's result. They act on CUDA only (a CPU runs the reference); here the alternatives are called directly:
the grouped routed experts through torch._grouped_mm's CPU path, the compiled regions through inductor's C++
backend. tests/megatron/test_train_gpu.py trains with the defaults on CUDA; tests/kernels/test_split_gemm.py
holds the split head GEMM to fp64."""
from __future__ import annotations

import pytest
import torch

from dsv4.config import RUNTIME_SWITCHES, ModelConfig
from dsv4.model import gated
from dsv4.megatron.layers import EAGER_HC, FUSABLE_HC, ParallelMoE, _compiled, q_heads, region, unrope
from dsv4.megatron.parallel import Ranks

ONE = Ranks(world=1, rank=0, tp=1, tp_rank=0, pp=1, pp_rank=0, dp=1, dp_rank=0, ep=1, ep_rank=0, etp=1,
            etp_rank=0, edp_rank=0)


def _moe(cfg: ModelConfig, seed: int = 0) -> ParallelMoE:
    torch.manual_seed(seed)
    moe = ParallelMoE(cfg.n_layers - 1, cfg, ONE)     # a learned-router layer (the first ones hash)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn_like(p, dtype=torch.float32) * 0.05)
    return moe


@pytest.mark.parametrize("qat", [False, True])
def test_grouped_experts_match_the_per_expert_loop(qat):
    cfg = ModelConfig.preset("tiny").with_overrides(n_routed_experts=8, n_activated_experts=3)
    moe = _moe(cfg)
    if qat:                                           # FP8 inputs and weights, as fp8_gemm_inputs sets them
        for e in moe.experts.values():
            for lin in (e.w1, e.w2, e.w3):
                lin.qat_input, lin.qat_weight = "fp8", "fp8"
    T = 96
    x = (torch.randn(T, cfg.dim) * 0.5).to(torch.bfloat16)
    weights = torch.rand(T, cfg.n_activated_experts)
    idx = torch.stack([torch.randperm(cfg.n_routed_experts)[:cfg.n_activated_experts] for _ in range(T)])
    idx[:, 0] = 2                                     # an uneven load; expert 7 may get none at all
    out = {}
    for impl in ("loop", "grouped"):
        xi = x.clone().requires_grad_(True)
        moe.zero_grad(set_to_none=True)
        # on a CPU _routed_local always loops; torch._grouped_mm's CPU path runs the grouped form here
        y = (moe._routed_grouped if impl == "grouped" else moe._routed_local)(xi, weights, idx)
        (y * torch.linspace(-1, 1, cfg.dim)).sum().backward()
        out[impl] = (y.detach(), xi.grad.clone(), {n: p.grad.clone() for n, p in moe.experts.named_parameters()
                                                     if p.grad is not None})
    (y0, gx0, gw0), (y1, gx1, gw1) = out["loop"], out["grouped"]
    assert torch.isfinite(y1).all() and torch.isfinite(gx1.float()).all()
    assert y1.abs().max() > 0
    torch.testing.assert_close(y1, y0, rtol=0, atol=0)           # the CPU grouped GEMM runs the same products
    torch.testing.assert_close(gx1.float(), gx0.float(), rtol=2e-2, atol=1e-3)
    assert gw1.keys() == gw0.keys()
    for n in gw0:
        assert torch.isfinite(gw1[n].float()).all()
        torch.testing.assert_close(gw1[n].float(), gw0[n].float(), rtol=2e-2, atol=1e-3, msg=n)


def test_an_ep_ranks_grouped_local_experts_match_its_loop():
    """At EP > 1 a rank's experts run on the rows the all-to-all brought, sorted by local expert: on CUDA as one
    grouped GEMM a weight (ParallelMoE._run_grouped, as EP = 1 and the bench's rank shape run them), else one GEMM an
    expert (_run_loop). The grouped form through torch._grouped_mm's CPU path: the same rows out, gradients close."""
    cfg = ModelConfig.preset("tiny").with_overrides(n_routed_experts=8, n_activated_experts=3)
    moe = _moe(cfg, seed=2)
    per_expert = torch.tensor([13, 0, 7, 21, 2, 9, 0, 11])            # two local experts without rows
    n = int(per_expert.sum())
    rows = (torch.randn(n, cfg.dim, generator=torch.Generator().manual_seed(3)) * 0.5).to(torch.bfloat16)
    w = torch.rand(n, 1, generator=torch.Generator().manual_seed(4))
    out = {}
    for name in ("loop", "grouped"):
        r = rows.clone().requires_grad_(True)
        moe.zero_grad(set_to_none=True)
        y = moe._run_grouped(r, w, per_expert) if name == "grouped" else moe._run_loop(r, w, per_expert.tolist())
        (y.float() * torch.linspace(-1, 1, cfg.dim)).sum().backward()
        out[name] = (y.detach(), r.grad.clone(), {k: p.grad.clone() for k, p in moe.experts.named_parameters()
                                                  if p.grad is not None})
    (y0, g0, w0), (y1, g1, w1) = out["loop"], out["grouped"]
    assert torch.isfinite(y1.float()).all() and y1.float().abs().max() > 0
    torch.testing.assert_close(y1, y0, rtol=0, atol=0)
    torch.testing.assert_close(g1.float(), g0.float(), rtol=2e-2, atol=1e-3)
    assert not any(k.startswith(("1.", "6.")) for k in w0)             # the loop never ran the empty experts
    for k in set(w1) - set(w0):                                         # the stacked GEMM gives them zeros
        assert k.startswith(("1.", "6.")) and w1[k].abs().max() == 0, k
    for k in w0:
        assert torch.isfinite(w1[k].float()).all()
        torch.testing.assert_close(w1[k].float(), w0[k].float(), rtol=2e-2, atol=1e-3, msg=k)


def test_switches_are_validated_and_listed():
    for key in RUNTIME_SWITCHES:
        assert hasattr(ModelConfig(), key)
    assert ModelConfig.preset("tiny").with_overrides(compiled="hc+attn+moe").compiled_regions == ("hc", "attn", "moe")
    for bad in (dict(moe_impl="fast"), dict(compiled="hc+jit"), dict(fp32_gemm="bf16")):
        with pytest.raises(ValueError, match=next(iter(bad))):
            ModelConfig.preset("tiny").with_overrides(**bad)


def test_regions_stay_eager_off_cuda():
    cfg = ModelConfig.preset("tiny").with_overrides(compiled="hc+attn+moe")
    assert region(cfg, "hc", torch.zeros(1)) is EAGER_HC
    assert region(cfg, "q_heads", torch.zeros(1)) is q_heads and region(cfg, "gated", torch.zeros(1)) is gated


@pytest.mark.parametrize("dim", [64, 2048])
def test_fusable_hc_forms_match_the_reference(dim):
    """The forms the hc region compiles (split-K mixes GEMM, unrolled C^T R), run eagerly: the reference's math in
    fp32 sums of another order. dim 2048 splits K = hc * dim into 1024-wide chunks, 64 into one per stream."""
    cfg = ModelConfig.preset("tiny")
    hc, g = cfg.hc_mult, torch.Generator().manual_seed(1)
    X = torch.randn(2, 8, hc, dim, generator=g).to(torch.bfloat16)
    fn = torch.randn((2 + hc) * hc, hc * dim, generator=g) * 0.02
    scale, base = torch.rand(3, generator=g), torch.randn((2 + hc) * hc, generator=g) * 0.1
    f = torch.randn(2, 8, dim, generator=g).to(torch.bfloat16)
    head_fn, head_base = fn[:hc], base[:hc]
    res = {}
    for name, fns in (("eager", EAGER_HC), ("fusable", FUSABLE_HC)):
        ins = [t.clone().requires_grad_(True) for t in (X, fn, scale, base, f)]
        x, post, comb = fns.pre(*ins[:4], hc, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.norm_eps)
        out = fns.post(ins[4], ins[0], post, comb)
        y = fns.head(ins[0], head_fn, scale[:1], head_base, cfg.hc_eps, cfg.norm_eps)
        ((x.float() * 0.3).sum() + (out.float() ** 2).mean() + comb.sum(-1).pow(2).sum() + y.float().sum()).backward()
        res[name] = [x, post, comb, out, y] + [t.grad for t in ins]
    for a, b in zip(res["eager"], res["fusable"]):
        assert torch.isfinite(b.float()).all() and b.float().abs().max() > 0
        # bf16 outputs may round the other way by one ulp; fp32 ones agree to fp32 accumulation error
        tol = dict(rtol=1e-2, atol=1e-2) if b.dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(b.float(), a.float(), **tol)


def test_compiled_hc_matches_eager_forward_and_backward():
    """The compiled hyper-connections (inductor; on a CPU its C++ backend) against the reference functions."""
    cfg = ModelConfig.preset("tiny")
    hc, d = cfg.hc_mult, cfg.dim
    g = torch.Generator().manual_seed(0)
    X = torch.randn(2, 16, hc, d, generator=g).to(torch.bfloat16)
    fn = torch.randn((2 + hc) * hc, hc * d, generator=g) * 0.02
    scale, base = torch.rand(3, generator=g), torch.randn((2 + hc) * hc, generator=g) * 0.1
    f = torch.randn(2, 16, d, generator=g).to(torch.bfloat16)
    res = {}
    for name, fns in (("eager", EAGER_HC), ("compiled", _compiled("hc"))):
        ins = [t.clone().requires_grad_(True) for t in (X, fn, scale, base, f)]
        x, post, comb = fns.pre(*ins[:4], hc, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.norm_eps)
        out = fns.post(ins[4], ins[0], post, comb)
        loss = (x.float() * 0.3).sum() + (out.float() ** 2).mean() + comb.sum(-1).pow(2).sum()
        loss.backward()
        res[name] = [x, comb, out] + [t.grad for t in ins]
    for a, b in zip(res["eager"], res["compiled"]):
        assert torch.isfinite(b.float()).all()
        torch.testing.assert_close(b.float(), a.float(), rtol=2e-2, atol=2e-3)


def test_compiled_attention_and_expert_regions_match_eager():
    cfg = ModelConfig.preset("tiny")
    g = torch.Generator().manual_seed(1)
    S, H, D, r = 16, 4, cfg.head_dim, cfg.rope_head_dim
    ang = torch.arange(S).float().unsqueeze(-1) * torch.rand(r // 2, generator=g)
    cos, sin = ang.cos(), ang.sin()
    q = torch.randn(2, S, H, D, generator=g).to(torch.bfloat16)
    a, b = torch.randn(32, 48, generator=g).to(torch.bfloat16) * 4, torch.randn(32, 48, generator=g).to(torch.bfloat16)
    w = torch.rand(32, 1, generator=g)
    cases = [(q_heads, (q, cos, sin, cfg.norm_eps), "q_heads"), (unrope, (q, cos, sin), "unrope"),
             (gated, (a, b, w, cfg.swiglu_limit, torch.bfloat16), "gated")]
    for eager, args, name in cases:
        outs = []
        for f in (eager, _compiled(name)):
            ins = [t.clone().requires_grad_(True) if isinstance(t, torch.Tensor) and t is not cos and t is not sin
                   else t for t in args]
            y = f(*ins)
            (y.float() * torch.linspace(-1, 1, y.shape[-1])).sum().backward()
            outs.append([y] + [t.grad for t in ins if isinstance(t, torch.Tensor) and t.requires_grad])
        for e, c in zip(*outs):
            assert torch.isfinite(c.float()).all(), name
            # eager rounds the normed q to bf16 before rotating it, the fused kernel does not: bf16 steps of the
            # input's scale, so the error is taken against the largest value
            err = ((c.float() - e.float()).abs().max() / e.float().abs().max()).item()
            assert err < 1e-2, (name, err)
