"""The routed experts' GEMM that accumulates weight gradients straight into megatron's fp32 main_grad
(dsv4/megatron/layers.py _ExpertGemm), against the plain path: stacked weights, torch._grouped_mm under autograd,
bf16 weight gradients added into main_grad afterwards (what megatron's hook did). Two micro-batches accumulate;
one expert gets no rows. The fused path keeps the products in fp32 until they are added, so it differs from the
plain one by the plain path's bf16 rounding of each gradient: compared against an fp64 reference."""
import pytest
import torch

from dsv4.megatron import layers

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _weights(E, out, inp, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    ws = [(torch.randn(out, inp, device="cuda", generator=g) * 0.02).bfloat16().requires_grad_() for _ in range(E)]
    for w in ws:
        w.main_grad = torch.zeros(out, inp, device="cuda")
    return ws


def test_expert_gemm_accumulates_into_main_grad():
    E, out, inp = 8, 256, 512
    counts = torch.tensor([96, 0, 40, 200, 8, 64, 128, 16])          # expert 1 gets no rows
    offs = torch.cumsum(counts, 0).to(torch.int32).cuda()
    rows = int(counts.sum())
    g = torch.Generator(device="cuda").manual_seed(1)
    mbs = [(torch.randn(rows, inp, device="cuda", generator=g).bfloat16(),
            torch.randn(rows, out, device="cuda", generator=g).bfloat16()) for _ in range(2)]
    fused, plain = _weights(E, out, inp), _weights(E, out, inp)
    ref = [torch.zeros(out, inp, dtype=torch.float64, device="cuda") for _ in range(E)]
    for a, dy in mbs:
        a1 = a.clone().requires_grad_()
        assert layers._accumulates_in_main_grad(fused, a1)
        y1 = layers._ExpertGemm.apply(a1, offs, layers._HostOffsets(offs), *fused)
        y1.backward(dy)
        a2 = a.clone().requires_grad_()
        y2 = torch._grouped_mm(a2, torch.stack(plain).transpose(1, 2), offs=offs)
        y2.backward(dy)
        for w in plain:
            w.main_grad.add_(w.grad)
            w.grad = None
        assert torch.equal(y1, y2)
        assert torch.isfinite(a1.grad).all()
        torch.testing.assert_close(a1.grad, a2.grad)
        b = [0] + offs.tolist()
        for e in range(E):
            ref[e] += dy[b[e]:b[e + 1]].double().t() @ a[b[e]:b[e + 1]].double()
    assert all(w.grad is None for w in fused)                          # nothing left for megatron's hook
    for e in range(E):
        f, p = fused[e].main_grad, plain[e].main_grad
        assert torch.isfinite(f).all()
        scale = ref[e].abs().max().clamp_min(1e-30)
        err_f = ((f.double() - ref[e]).abs().max() / scale).item()
        err_p = ((p.double() - ref[e]).abs().max() / scale).item()
        if e == 1:
            assert f.abs().max() == 0 and p.abs().max() == 0
            continue
        assert err_f < 1e-5, (e, err_f)                                # fp32 accumulation of exact bf16 products
        assert err_f <= err_p + 1e-6, (e, err_f, err_p)                # no worse than the bf16-gradient path


def test_plain_path_without_main_grad():
    """No main_grad (no DDP) or no gradient wanted: the plain grouped GEMM, weight gradients as usual."""
    ws = [torch.randn(16, 32, device="cuda").bfloat16().requires_grad_() for _ in range(2)]
    a = torch.randn(8, 32, device="cuda").bfloat16()
    assert not layers._accumulates_in_main_grad(ws, a)
    for w in ws:
        w.main_grad = torch.zeros(16, 32, device="cuda")
    with torch.no_grad():
        assert not layers._accumulates_in_main_grad(ws, a)
    assert layers._accumulates_in_main_grad(ws, a)


def test_expert_stack_once_a_step():
    """Under stepmemo.weights_fixed() (the trainer's step) the experts' weights are stacked once for all the
    micro-batches: the same outputs and main_grad bits as stacking at every call, one stack made."""
    from dsv4.stepmemo import weights_fixed
    E, out, inp = 4, 128, 256
    counts = torch.tensor([30, 0, 50, 20])
    offs = torch.cumsum(counts, 0).to(torch.int32).cuda()
    g = torch.Generator(device="cuda").manual_seed(2)
    mbs = [(torch.randn(100, inp, device="cuda", generator=g).bfloat16(),
            torch.randn(100, out, device="cuda", generator=g).bfloat16()) for _ in range(3)]

    def run(ws, memo: bool):
        ys = []
        with weights_fixed() if memo else torch.enable_grad():
            for a, dy in mbs:
                a = a.clone().requires_grad_()
                y = layers._ExpertGemm.apply(a, offs, layers._HostOffsets(offs), *ws)
                y.backward(dy)
                ys.append((y.detach(), a.grad))
            if memo:
                assert len(layers._STACKS.store) == 1
        return ys

    every, once = _weights(E, out, inp), _weights(E, out, inp)
    for (y1, g1), (y2, g2) in zip(run(every, False), run(once, True)):
        assert torch.isfinite(y1).all() and torch.isfinite(g1).all()
        assert torch.equal(y1, y2) and torch.equal(g1, g2)
    for w1, w2 in zip(every, once):
        assert torch.isfinite(w1.main_grad).all() and torch.equal(w1.main_grad, w2.main_grad)
    assert layers._STACKS.store is None                                # nothing held past the step
