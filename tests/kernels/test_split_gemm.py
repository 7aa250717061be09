"""The split fp32 GEMM (dsv4/kernels/split_gemm.py): the split itself on any device; on a GPU the GEMMs, forward
and backward, against an fp64 product beside the fp32 GEMM's own error and one bf16 GEMM's.

Errors are max |got - ref| / max |ref| over the output, finiteness asserted first."""
import pytest
import torch

from dsv4 import stepmemo
from dsv4.kernels import split_gemm


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(got).all(), f"{(~torch.isfinite(got)).sum().item()} non-finite values"
    return ((got.double() - ref).abs().max() / ref.abs().max()).item()


def test_split_keeps_sixteen_mantissa_bits():
    t = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 3, 4096)
    hi, lo = split_gemm.split(t)
    assert hi.dtype == lo.dtype == torch.bfloat16
    one = ((hi.float() - t).abs() / t.abs()).max().item()
    two = ((hi.float() + lo.float() - t).abs() / t.abs()).max().item()
    assert one > 2 ** -10, one                     # bf16 alone: 8 bits
    assert two < 2 ** -15, two                     # hi + lo: 16 bits


def test_linear_is_f_linear_on_cpu():
    x, w = torch.randn(5, 64), torch.randn(32, 64)
    assert torch.equal(split_gemm.linear(x, w), torch.nn.functional.linear(x, w))


def _case(M, K, N, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).cuda()
    w = (torch.randn(N, K, generator=g) * 0.02).cuda()
    return x, w


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("M", [64, 2048], ids=["decode-rows", "training-rows"])
def test_forward_within_fp32_grade(M):
    x, w = _case(M, 4096, 16384)
    ref = x.double() @ w.double().t()
    split = rel_err(split_gemm.linear(x, w), ref)
    fp32 = rel_err(torch.nn.functional.linear(x, w), ref)
    bf16 = rel_err((x.bfloat16() @ w.bfloat16().t()).float(), ref)
    sw = split_gemm.SplitWeight(w)
    cached = rel_err(sw.linear(x), ref)
    print(f"\nM={M}: split {split:.2e}  cached {cached:.2e}  fp32 {fp32:.2e}  bf16 {bf16:.2e}")
    assert split < 1e-4 and cached < 1e-4
    assert bf16 > 20 * split                      # the split is what makes the difference
    w.mul_(-2.0)                                  # a weight update in place, then refresh
    sw.refresh()
    assert rel_err(sw.linear(x), x.double() @ w.double().t()) < 1e-4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_backward_within_fp32_grade():
    x, w = _case(3000, 1024, 8192, seed=1)       # 3000 rows: two backward chunks, the second partial
    g = torch.randn(3000, 8192, device="cuda")
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    (split_gemm.linear(xs, ws) * g).sum().backward()
    gx_ref = g.double() @ w.double()
    gw_ref = g.double().t() @ x.double()
    ex, ew = rel_err(xs.grad, gx_ref), rel_err(ws.grad, gw_ref)
    print(f"\ngrad x {ex:.2e}  grad w {ew:.2e}")
    assert ex < 1e-4 and ew < 1e-4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("N", [24, 8192], ids=["narrow-w", "wide-w"])
def test_bf16_input_is_exact_and_skips_its_lo_half(N):
    """A bf16 x (the head's normed input) is exact: two GEMMs give the fp32-grade product; the
    backward either splits (fp32-grade gradients) or runs one bf16 GEMM per gradient (bf16-grade)."""
    x, w = _case(3000, 1024, N, seed=2)
    x = x.bfloat16()
    g = torch.randn(3000, N, device="cuda")
    ref = x.double() @ w.double().t()
    errs = {}
    for split_backward in (True, False):
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = split_gemm.linear(xs, ws, split_backward=split_backward)
        (y * g).sum().backward()
        assert y.dtype == torch.float32 and xs.grad.dtype == torch.bfloat16
        errs[split_backward] = (rel_err(y, ref), rel_err(xs.grad.float(), g.double() @ w.double()),
                                rel_err(ws.grad, g.double().t() @ x.double()))
    print(f"\nN={N}: split backward (y, gx, gw) {errs[True]}, bf16 backward {errs[False]}")
    assert errs[True][0] < 1e-4 and errs[True][2] < 1e-4
    assert errs[True][1] < 1e-2                   # gx is returned in x's dtype, bf16
    assert errs[False][2] > 20 * errs[True][2]    # the bf16 backward is bf16-grade, not the split's
    assert errs[False][2] < 2e-2


def test_weights_fixed_splits_each_weight_once_while_open():
    w, v = torch.randn(32, 64), torch.randn(32, 64)
    assert split_gemm.weight_halves(w) is not split_gemm.weight_halves(w)     # closed: a fresh split each call
    with stepmemo.weights_fixed():
        first = split_gemm.weight_halves(w)
        assert split_gemm.weight_halves(w) is first
        assert split_gemm.weight_halves(v) is not first
        with stepmemo.weights_fixed():                                       # nested: the same store
            assert split_gemm.weight_halves(w) is first
        assert torch.equal(first[0], split_gemm.split(w)[0]) and torch.equal(first[1], split_gemm.split(w)[1])
    assert not split_gemm._HALVES.open


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("split_backward", [True, False], ids=["bf16x3", "bf16x3_fwd"])
def test_reused_halves_give_the_same_gradients(split_backward):
    """Two micro-batches through the head-shaped split linear with and without weights_fixed(): identical."""
    x, w = _case(2048, 1024, 8192)
    x = x.bfloat16()
    grads = []
    for reuse in (False, True):
        wp = w.clone().requires_grad_()
        xs = [x.clone().requires_grad_() for _ in range(2)]
        with (stepmemo.weights_fixed() if reuse else torch.enable_grad()):
            for xi in xs:
                split_gemm.linear(xi, wp, split_backward).square().mean().backward()
        grads.append((wp.grad, [xi.grad for xi in xs]))
    (w0, x0), (w1, x1) = grads
    assert torch.isfinite(w1).all() and all(torch.isfinite(g).all() for g in x1)
    assert torch.equal(w0, w1) and all(torch.equal(a, b) for a, b in zip(x0, x1))
