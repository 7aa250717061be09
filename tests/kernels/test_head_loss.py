"""The fused head GEMM + cross-entropy (dsv4/kernels/head_loss.py) in its CPU reference form: the same split
weight halves, chunks (patched small, the last one ragged), bf16 softmax kept for the backward, fp32 label term and
gradient formula as on CUDA, the GEMMs as fp32 products of the bf16 operands.

The loss is held to F.cross_entropy on F.linear's fp32 logits. The gradients are held to the fp64 autograd reference
by a bound derived from what the function rounds (u = 2^-8, bf16's unit roundoff: 8 significant bits; G =
dloss/dlogits):
* each entry of G is rounded to bf16 twice (p when saved, G when written): |G - G64| <= (2u + u^2) |G64|, plus
  what the fp32 logits carry: the split drops w's residual below 2^-16 |w| (an fp32 x's residual and its dropped
  lo.lo term as much again each) and the fp32 sum over K adds at most K 2^-24 relatively, so every logit is
  within d = (3 2^-16 + K 2^-24) max(|x| @ |w|^T) / temperature of the exact one and every p within 4d
  relatively (z and the lse each off by <= d; 4d leaves room for exp's and log's own rounding); the label term
  p_label - 1 = -(the other p summed) likewise, plus (V + 1) 2^-24 |g| absolute (p_label comes from an fp32 sum
  of V exponentials: an absolute error, which does not shrink with 1 - p_label);
  so  E = (2u + u^2 + 4d) |G64| + (V + 1) 2^-24 |g| onehot  bounds each entry of G's error;
* dx = G @ bf16(w) returned in bf16 (x's dtype): bf16(w) is within u |w|, the output rounding within u |dx|
  <= u (|G64| @ |w| + error), so  |dx - dx64| <= (1 + u)^2 (E @ |w|) + u (2 + u) (|G64| @ |w|)  (x 1.01 for
  the fp32 sums, n 2^-24 relative over n <= 160,000 terms);
* dw = G^T @ x in fp32 (x bf16, exact):  |dw - dw64| <= E^T @ |x|  (x 1.01 for fp32 sums).
A version that keeps p_label in bf16 breaks the bound on rows where the model is confident (p_label ~ 0.999 rounds
to 1: a zero label gradient); test_label_term_keeps_fp32_precision checks that the bound sees it.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from dsv4 import stepmemo
from dsv4.config import ModelConfig
from dsv4.kernels import head_loss as hl
from dsv4.megatron.model import DSV4Stage
from dsv4.megatron.parallel import Ranks

ROOT = Path(__file__).resolve().parents[2]
U = 2.0 ** -8
ONE = Ranks(world=1, rank=0, tp=1, tp_rank=0, pp=1, pp_rank=0, dp=1, dp_rank=0, ep=1, ep_rank=0, etp=1,
            etp_rank=0, edp_rank=0)


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(hl, "_CHUNK_ROWS", 16)     # the cases' rows are no multiple of 16: the last chunk is ragged


def _case(M=61, K=48, V=160, seed=0, confident=(0, 17, 40), margin_p=0.999, ignored=(5, 33)):
    """x bf16 [M, K], w fp32 [V, K], labels [M] with rows `ignored` at -100; rows `confident` get their label's
    probability raised to ~margin_p (w[label] moved along x's row: in that row only the label's logit changes)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(torch.bfloat16)
    w = torch.randn(V, K, generator=g) * 0.3
    labels = torch.randint(0, V, (M,), generator=g)
    for r in confident:
        labels[r] = (7 * r + 3) % V                 # distinct labels
        z = (x[r].double() @ w.double().t())
        others = torch.logsumexp(torch.cat([z[:labels[r]], z[labels[r] + 1:]]), 0)
        want = others + torch.log(torch.tensor(margin_p / (1 - margin_p), dtype=torch.float64))
        xr = x[r].float()
        w[labels[r]] += float(want - z[labels[r]]) * xr / xr.dot(xr)
    labels[list(ignored)] = hl.IGNORE_INDEX
    return x, w, labels


def _reference(x, w, labels, g, temperature=1.0, allowed=None):
    """fp64 autograd: loss, dx, dw, G = dloss/dlogits (the masked entries' zero included)."""
    xs, ws = x.double().requires_grad_(), w.double().requires_grad_()
    logits = xs @ ws.t()
    logits.retain_grad()
    z = logits / temperature if temperature != 1.0 else logits
    if allowed is not None:
        z = z.masked_fill(~allowed, -1e30)
    loss = F.cross_entropy(z, labels, reduction="none")
    (loss * g.double()).sum().backward()
    return loss.detach(), xs.grad, ws.grad, logits.grad


def _fused(x, w, labels, g, **kw):
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    loss = hl.linear_cross_entropy(xs, ws, labels, **kw)
    (loss * g).sum().backward()
    return loss.detach(), xs.grad, ws.grad


def _bound_ratios(x, w, labels, g, gx, gw, ref, temperature=1.0, x_w=None):
    """max |error| / bound for dx and dw (<= 1: within the bound derived in the module docstring). x_w: the x the
    dw GEMM reads (default x)."""
    _, gx64, gw64, G64 = ref
    xw = (x.double().abs() @ w.double().abs().t()).max().item()
    d = (3 * 2.0 ** -16 + x.shape[1] * 2.0 ** -24) * xw / temperature
    onehot = torch.zeros_like(G64)
    valid = labels != hl.IGNORE_INDEX
    onehot[valid.nonzero().squeeze(1), labels[valid]] = 1.0
    V = w.shape[0]
    E = (2 * U + U * U + 4 * d) * G64.abs() + (V + 1) * 2.0 ** -24 * (g.double() / temperature).abs()[:, None] * onehot
    wa, xa = w.double().abs(), (x if x_w is None else x_w).double().abs()
    bx = 1.01 * ((1 + U) ** 2 * (E @ wa) + U * (2 + U) * (G64.abs() @ wa))
    bw = 1.01 * (E.t() @ xa)
    for t in (gx, gw):
        assert torch.isfinite(t.float()).all(), f"{(~torch.isfinite(t.float())).sum().item()} non-finite values"
    rx = ((gx.double() - gx64).abs() / bx.clamp_min(1e-300)).max().item()
    rw = ((gw.double() - gw64).abs() / bw.clamp_min(1e-300)).max().item()
    return rx, rw


def _g(M, seed=1):
    g = torch.randn(M, generator=torch.Generator().manual_seed(seed))
    g[::7] = 0.0                                    # masked-out tokens
    return g


def test_loss_is_f_cross_entropy_of_the_fp32_logits():
    x, w, labels = _case()
    loss = hl.linear_cross_entropy(x, w, labels)
    ref = F.cross_entropy(F.linear(x.float(), w), labels, reduction="none")
    assert torch.isfinite(loss).all() and loss.dtype == torch.float32
    assert (loss[[5, 33]] == 0).all()
    # the split weight's dropped residual (< 2^-16 |w|) moves a logit by less than this
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)
    with torch.no_grad():                           # no gradient wanted: no softmax kept, the same loss
        assert torch.equal(hl.linear_cross_entropy(x, w, labels), loss)
    # [B, S, K] inputs keep their token dims
    assert torch.equal(hl.linear_cross_entropy(x.view(1, 61, -1), w, labels.view(1, 61)), loss.view(1, 61))


def test_gradients_within_the_bf16_rounding_bound():
    x, w, labels = _case()
    g = _g(x.shape[0])
    ref = _reference(x, w, labels, g)
    p = torch.softmax(x.double() @ w.double().t(), -1)
    conf = p[[0, 17, 40], labels[[0, 17, 40]]]
    assert ((conf > 0.998) & (conf < 0.9995)).all(), conf        # the case has the confident rows it claims
    loss, gx, gw = _fused(x, w, labels, g)
    assert gx.dtype == torch.bfloat16 and gw.dtype == torch.float32
    rx, rw = _bound_ratios(x, w, labels, g, gx, gw, ref)
    print(f"\nerror / bound: dx {rx:.3f}  dw {rw:.3f}")
    assert rx <= 1 and rw <= 1, (rx, rw)
    assert (gw[labels[5]] != 0).any()               # (an ignored row's label is someone else's too, or zero)


def test_fp32_input_is_split_and_within_the_same_bound():
    """An fp32 x (a model whose activations are fp32) is split as split_gemm splits it; dw reads bf16(x)."""
    x, w, labels = _case(seed=3)
    x = x.float() + torch.randn(x.shape, generator=torch.Generator().manual_seed(4)) * 1e-3   # not bf16-exact
    g = _g(x.shape[0])
    loss, gx, gw = _fused(x, w, labels, g)
    torch.testing.assert_close(loss, F.cross_entropy(F.linear(x, w), labels, reduction="none"), rtol=1e-5, atol=1e-5)
    assert gx.dtype == torch.float32
    loss64, gx64, _, G64 = _reference(x, w, labels, g)
    xb = x.to(torch.bfloat16)                       # dw = G^T @ bf16(x), as split_gemm's bf16x3_fwd backward
    ref = (loss64, gx64, G64.t() @ xb.double(), G64)
    rx, rw = _bound_ratios(x, w, labels, g, gx, gw, ref, x_w=xb)
    assert rx <= 1 and rw <= 1, (rx, rw)


def test_label_term_keeps_fp32_precision(monkeypatch):
    """Rows with p_label ~ 0.999: the label's gradient p_label - 1 ~ -1e-3 is taken from the fp32 p_label, so it is
    rounded to bf16 once (relative error <= u, the fp32 p_label's own error ~1e-7 being 1e-4 of it). With only
    those rows weighted (g = 1 there, 0 elsewhere) dw[label] is that entry times x's row, plus the other confident
    rows' p of that label (< 1e-5 each). The same function with p_label rounded to bf16 (0.999 -> 1.0: no gradient)
    breaks the bound: the test can fail."""
    rows = torch.tensor([0, 3, 11, 19])
    x, w, labels = _case(M=20, confident=tuple(rows.tolist()), margin_p=0.999, ignored=(5,))
    g = torch.zeros(20)
    g[rows] = 1.0
    ref = _reference(x, w, labels, g)
    label_grad = ref[3][rows, labels[rows]]
    assert ((label_grad > -1.1e-3) & (label_grad < -0.9e-3)).all(), label_grad

    def errors():
        _, gx, gw = _fused(x, w, labels, g)
        rx, rw = _bound_ratios(x, w, labels, g, gx, gw, ref)
        dw64 = ref[2][labels[rows]]
        rel = ((gw[labels[rows]].double() - dw64).norm(dim=1) / dw64.norm(dim=1)).max().item()
        return rx, rw, rel

    rx, rw, rel = errors()
    print(f"\nerror / bound: dx {rx:.3f}  dw {rw:.3f};  dw[label] relative error {rel:.2e}")
    assert rx <= 1 and rw <= 1, (rx, rw)
    assert rel < 1.1 * U, rel

    real = hl.chunk_forward

    def bf16_p_label(logits, labels, temperature, allowed, p_out):
        loss, dlabel = real(logits, labels, temperature, allowed, p_out)
        return loss, (dlabel + 1).to(torch.bfloat16).float() - 1    # p_label as the bf16 p holds it

    monkeypatch.setattr(hl, "chunk_forward", bf16_p_label)
    rx, rw, rel = errors()
    print(f"p_label in bf16: error / bound: dx {rx:.1f}  dw {rw:.1f};  dw[label] relative error {rel:.2e}")
    assert rx > 1 and rw > 1 and rel > 0.5


def test_scored_path_matches_the_eager_scored_logits():
    """Temperature and an allowed-token mask (RL's log-probabilities) against DSV4Stage._scored_logits followed by
    its cross_entropy, the eager path the model runs; one row's label is disallowed (loss ~1e30, no gradient at its
    own entry, as masked_fill's backward gives)."""
    x, w, labels = _case(seed=5)
    V = w.shape[0]
    allowed = torch.rand(V, generator=torch.Generator().manual_seed(6)) < 0.7
    allowed[labels[labels >= 0]] = True
    allowed[labels[9]] = False
    score = {"temperature": 0.7, "allowed": allowed}
    stage = SimpleNamespace(ranks=ONE, _score_args=DSV4Stage._score_args)
    logits = F.linear(x.float(), w)
    eager = DSV4Stage.cross_entropy(stage, DSV4Stage._scored_logits(stage, logits[None], score), labels[None])[0]
    t, mask = DSV4Stage._score_args(score)
    g = _g(x.shape[0])
    loss, gx, gw = _fused(x, w, labels, g, temperature=t, allowed=mask)
    assert torch.isfinite(loss).all() and loss[9] > 1e29
    torch.testing.assert_close(loss, eager, rtol=1e-5, atol=1e-5)
    ref = _reference(x, w, labels, g, temperature=0.7, allowed=allowed)
    assert (ref[3][9, labels[9]] == 0) and (ref[3][:, ~allowed] == 0).all()
    rx, rw = _bound_ratios(x, w, labels, g, gx, gw, ref, temperature=0.7)
    assert rx <= 1 and rw <= 1, (rx, rw)
    assert (gw[~allowed] == 0).all()                # disallowed tokens: probability 0, no gradient


def test_micro_batches_under_weights_fixed_are_identical():
    x, w, labels = _case(seed=7)
    x2, _, labels2 = _case(seed=8, confident=())
    g = _g(x.shape[0])
    out = []
    for memo in (False, True):
        ws = w.clone().requires_grad_()
        xs = [t.clone().requires_grad_() for t in (x, x2)]
        with stepmemo.weights_fixed() if memo else torch.enable_grad():
            losses = [hl.linear_cross_entropy(a, ws, lab) for a, lab in zip(xs, (labels, labels2))]
            for loss in losses:
                (loss * g).sum().backward()
        out.append([losses[0].detach(), losses[1].detach(), xs[0].grad, xs[1].grad, ws.grad])
    for a, b in zip(*out):
        assert torch.equal(a, b)


def test_a_second_backward_is_refused():
    x, w, labels = _case(seed=9)
    ws = w.clone().requires_grad_()
    loss = hl.linear_cross_entropy(x, ws, labels).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="runs once per forward"):
        loss.backward()


def test_compiled_parts_match_the_eager_ones():
    """The elementwise parts through torch.compile (inductor's C++ backend here, Triton on CUDA): the same loss and
    the same bf16 gradient, written in place into the saved softmax chunk by chunk."""
    x, w, labels = _case(M=37, V=96, seed=10, confident=(0,), ignored=(5,))
    allowed = torch.ones(96, dtype=torch.bool)
    allowed[::5] = False
    allowed[labels[labels >= 0]] = True
    g = _g(37)
    eager = _fused(x, w, labels, g, temperature=0.9, allowed=allowed, compiled=False)
    comp = _fused(x, w, labels, g, temperature=0.9, allowed=allowed, compiled=True)
    torch.testing.assert_close(comp[0], eager[0], rtol=1e-6, atol=1e-6)
    for a, b in zip(comp[1:], eager[1:]):
        assert torch.isfinite(a.float()).all()
        torch.testing.assert_close(a.float(), b.float(), rtol=2 * U, atol=1e-6)   # a bf16 entry may round apart


def test_the_stage_fuses_only_where_it_can():
    X = SimpleNamespace(is_cuda=True)
    base = ModelConfig.preset("tiny", head_loss="fused")

    def fused(cfg=base, x=X, tp=1):
        return DSV4Stage.fused_head_loss(SimpleNamespace(cfg=cfg, ranks=SimpleNamespace(tp=tp)), x)

    assert fused()
    assert not fused(cfg=base.with_overrides(head_loss="eager"))
    assert not fused(x=SimpleNamespace(is_cuda=False))
    assert not fused(tp=2)
    assert not fused(cfg=base.with_overrides(fp32_gemm="bf16x3"))
    assert not fused(cfg=base.with_overrides(fp32_gemm="fp32"))


def run_stage_script(device: str, dtype: str, gpu_rounding: bool = False) -> None:
    """A tiny world-1 DSV4Stage (megatron process groups in a subprocess) with head_loss eager, then fused: the LM
    and MTP losses and RL's scored log-probabilities must agree, and each gradient of the fused path must be as close
    to a reference's as the eager path's is. On a CPU the stage is told to fuse (DSV4Stage.fused_head_loss answers
    no off CUDA), so the function's CPU form runs under the model: the wiring of model.py is checked here, the CUDA
    form by tests/kernels/test_head_loss_gpu.py.

    The reference is the eager head with fp32_gemm "bf16x3", whose backward keeps the logits' gradient in fp32 (split
    into bf16 halves). The eager default rounds that gradient to bf16 once on CUDA, the fused path twice, and in a
    bf16 model both roundings reach the small parameters whose gradient is a sum that cancels (the hc scales and
    biases, the attention sinks) amplified: there eager and fused differ from each other, and each from the
    reference, by 10-90 %, so fused is held to its distance from the reference against eager's, not to eager's bits,
    and those few-entry vectors together (alone, one of them moves 5-20x eager's distance in some draws).
    gpu_rounding runs split_gemm's CUDA route on the CPU (bf16 operands, fp32 sums: torch.mm of the bf16 values in
    fp32), the eager head rounding as it does on a GPU."""
    backend = "nccl" if device == "cuda" else "gloo"
    code = textwrap.dedent(f"""
        import socket, torch
        from dsv4.config import ModelConfig
        from dsv4.kernels import head_loss as hl
        from dsv4.kernels import split_gemm
        from dsv4.megatron.model import DSV4Stage, Objective, model_provider
        from dsv4.megatron.parallel import Layout, init_parallel
        from dsv4.megatron.train import init_distributed
        s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
        init_distributed(0, 1, "{backend}", "{device}", "127.0.0.1", port)
        init_parallel(Layout(), 1)
        if "{device}" == "cpu":
            DSV4Stage.fused_head_loss = lambda self, X: self.cfg.head_loss == "fused"
            hl._CHUNK_ROWS = 48                     # 128 tokens a micro-batch: three chunks, the last ragged
        if {gpu_rounding!r}:
            def linear(x, w, split_backward=True):
                x2d = x.reshape(-1, x.shape[-1])
                x2d = x2d if x2d.dtype == torch.bfloat16 else x2d.float()
                return split_gemm._SplitLinear.apply(x2d, w.float(), split_backward).view(*x.shape[:-1], w.shape[0])
            split_gemm.linear = linear
            split_gemm._mm = lambda a, b, acc=None: torch.mm(a.float(), b.float()) + (0 if acc is None else acc)
        cfg = ModelConfig.preset("tiny", dtype="{dtype}", compiled="none")
        stage = model_provider(cfg, Layout(), Objective(mtp_coeff=0.3), device="{device}")
        stage.init_weights(cfg.seed)
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, cfg.vocab_size, (2, 65), generator=g)
        ids, labels = tokens[:, :-1].to("{device}"), tokens[:, 1:].to("{device}")
        mask = torch.ones(2, 64, device="{device}")
        mask[1, 50:] = 0
        allowed = torch.rand(cfg.vocab_size, generator=g) < 0.8
        allowed[tokens.flatten()] = True
        score = {{"temperature": 0.8, "allowed": allowed.to("{device}")}}
        out = {{}}
        for mode, switches in (("ref", dict(head_loss="eager", fp32_gemm="bf16x3")), ("eager", dict(head_loss="eager")),
                               ("fused", dict(head_loss="fused"))):
            stage.cfg = cfg.with_overrides(**switches)
            assert stage.fused_head_loss(ids) == (mode == "fused")
            stage.zero_grad(set_to_none=True)
            lm, mtp = stage(ids, labels, mask)
            (lm + 0.3 * mtp).backward()
            grads = {{n: p.grad.float() for n, p in stage.named_parameters() if p.grad is not None}}
            stage.zero_grad(set_to_none=True)
            logp = stage(ids, labels, mask, score=score)
            (logp * mask).sum().backward()
            sgrads = {{n: p.grad.float() for n, p in stage.named_parameters() if p.grad is not None}}
            out[mode] = (lm.item(), mtp.item(), logp.detach(), grads, sgrads)
        (lm0, mtp0, lp0, g0, s0), (lm1, mtp1, lp1, g1, s1) = out["eager"], out["fused"]
        gr, sr = out["ref"][3:]
        assert mtp0 > 0
        assert abs(lm1 - lm0) <= 1e-5 * abs(lm0) and abs(mtp1 - mtp0) <= 1e-5 * abs(mtp0), (lm0, lm1, mtp0, mtp1)
        assert torch.isfinite(lp1).all()
        torch.testing.assert_close(lp1, lp0, rtol=1e-5, atol=1e-4)
        assert "mtp.0.hc_head_fn" in g0 and "mtp.0.hc_head_fn" not in s0      # scoring runs no MTP block
        def rel(a, ref):
            den = ref.norm().item()
            return (a - ref).norm().item() / den if den else 0.0
        shares = []                            # each bound's use: (fused's distance / its bound, what)
        def bound(n, ef, ee, floor):
            # within a floor (fp32 runs, and the CPU's eager head, which equals the reference: two roundings of 2^-9
            # on the head's weight) or 3x eager's own distance: twice the roundings, and slack for a distance that
            # is itself a sample of bf16 noise
            assert ef <= max(floor, 3 * ee), (n, "fused", ef, "eager", ee)
            shares.append((ef / max(floor, 3 * ee), n))
        for e, f, ref in ((g0, g1, gr), (s0, s1, sr)):
            assert e.keys() == f.keys() == ref.keys() and "head.weight" in e, (sorted(e), sorted(f))
            # The vectors of a few entries (hc scales and biases, attention sinks) have gradients that are sums
            # which cancel: one rounding more moves one of them by 5-20x eager's distance in some draws and less
            # in others, so they are held together, each alone only to the reference's order of magnitude.
            few = [n for n in ref if ref[n].numel() < 64]
            for n in ref:
                assert all(torch.isfinite(d[n]).all() for d in (f, e, ref)), n
                if n in few:
                    assert rel(f[n], ref[n]) <= 1.0, (n, "fused", rel(f[n], ref[n]))
                else:
                    bound(n, rel(f[n], ref[n]), rel(e[n], ref[n]), 1e-2 if n == "head.weight" else 1e-1)
            cat = lambda d: torch.cat([d[n].flatten() for n in few])
            bound("the few-entry vectors", rel(cat(f), cat(ref)), rel(cat(e), cat(ref)), 1e-1)
        worst = max(shares)
        print("ok", lm0, lm1, mtp0, mtp1, "closest to its bound (share of it)", worst)
    """)
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH")))), "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout[-2000:] + r.stderr[-3000:]
    print(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("dtype, gpu_rounding", [("fp32", False), ("bf16", True)], ids=["fp32", "bf16-gpu-rounding"])
def test_stage_losses_equal_with_eager_and_fused_head_loss_on_cpu(dtype, gpu_rounding):
    run_stage_script("cpu", dtype, gpu_rounding)
