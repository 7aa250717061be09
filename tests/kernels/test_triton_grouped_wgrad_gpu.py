"""GPU: the Triton grouped weight-gradient kernel against the per-expert cuBLAS accumulation it replaces
(moe_impl=grouped's backward), at a V4-Flash EP-8 rank's expert shapes (2048 x 4096 weights, ~768 rows an expert,
routing-like imbalance, some experts empty), and the trainer's autograd function on it."""
import pytest
import torch

from dsv4.kernels import triton_grouped_wgrad as tw
from dsv4.megatron import layers

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(tw.triton is None, reason="triton is not installed")]


def _counts(E: int, mean: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    c = (torch.rand(E, generator=g) * 2 * mean).long()
    c[3] = 0                                                            # an expert the batch did not choose
    return c


@pytest.mark.parametrize("N, K", [(2048, 4096), (4096, 2048), (136, 200)])
def test_matches_per_expert_addmm(N, K):
    E = 32
    counts = _counts(E, 768 if N >= 2048 else 40, 0)
    offs = torch.cumsum(counts, 0).to(torch.int32).cuda()
    T = int(counts.sum())
    g = torch.Generator(device="cuda").manual_seed(1)
    dy = torch.randn(T, N, device="cuda", generator=g).bfloat16()
    x = torch.randn(T, K, device="cuda", generator=g).bfloat16()
    start = [torch.randn(N, K, device="cuda", generator=g) for _ in range(E)]
    fused, loop = [s.clone() for s in start], [s.clone() for s in start]
    tw.accumulate(dy, x, offs, fused)
    b = [0] + offs.tolist()
    for e in range(E):
        if b[e + 1] > b[e]:
            torch.addmm(loop[e], dy[b[e]:b[e + 1]].t(), x[b[e]:b[e + 1]], out_dtype=torch.float32, out=loop[e])
    for e in range(E):
        assert torch.isfinite(fused[e]).all()
        if counts[e] == 0:
            assert torch.equal(fused[e], start[e])
            continue
        ref = start[e].double() + dy[b[e]:b[e + 1]].double().t() @ x[b[e]:b[e + 1]].double()
        scale = ref.abs().max()
        err_f = ((fused[e].double() - ref).abs().max() / scale).item()
        err_l = ((loop[e].double() - ref).abs().max() / scale).item()
        assert err_f < 1e-5 and err_f <= 2 * err_l + 1e-7, (e, err_f, err_l)


def test_expert_gemm_on_the_triton_wgrad():
    """_ExpertGemm without host offsets (moe_impl=grouped_triton): the same outputs and row gradients as with
    them, main_grad within fp32 round-off of the per-expert path's, no .grad left for megatron's hook."""
    E, out, inp = 8, 256, 512
    counts = torch.tensor([96, 0, 40, 200, 8, 64, 128, 16])
    offs = torch.cumsum(counts, 0).to(torch.int32).cuda()
    rows = int(counts.sum())
    g = torch.Generator(device="cuda").manual_seed(3)
    ws = {k: [(torch.randn(out, inp, device="cuda", generator=torch.Generator(device="cuda").manual_seed(e)) * 0.02)
              .bfloat16().requires_grad_() for e in range(E)] for k in ("triton", "addmm")}
    for k in ws:
        for w in ws[k]:
            w.main_grad = torch.zeros(out, inp, device="cuda")
    for _ in range(2):
        a = torch.randn(rows, inp, device="cuda", generator=g).bfloat16()
        dy = torch.randn(rows, out, device="cuda", generator=g).bfloat16()
        res = {}
        for k, host in (("triton", None), ("addmm", layers._HostOffsets(offs))):
            ak = a.clone().requires_grad_()
            y = layers._ExpertGemm.apply(ak, offs, host, *ws[k])
            y.backward(dy)
            res[k] = (y, ak.grad)
        assert torch.equal(res["triton"][0], res["addmm"][0]) and torch.equal(res["triton"][1], res["addmm"][1])
    for wt, wa in zip(ws["triton"], ws["addmm"]):
        assert wt.grad is None and torch.isfinite(wt.main_grad).all()
        torch.testing.assert_close(wt.main_grad, wa.main_grad, rtol=1e-5, atol=1e-5)
