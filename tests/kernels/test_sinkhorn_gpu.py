"""GPU: the fused Sinkhorn kernel (dsv4/kernels/triton_sinkhorn.py) against dsv4.model.sinkhorn, called directly
and from inside a torch.compile'd function (the decode step's regions call it so)."""
import pytest
import torch

from dsv4.kernels import triton_sinkhorn
from dsv4.model import sinkhorn

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("shape", [(1, 1, 4, 4), (64, 1, 4, 4), (3, 1000, 4, 4), (5, 7, 2, 2)])
def test_fused_sinkhorn_equals_the_reference(shape):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(*shape, generator=g) * 8).cuda()        # large logits: near-one-hot softmax rows
    ref = sinkhorn(logits, 20, 1e-6)
    got = triton_sinkhorn.sinkhorn(logits, 20, 1e-6)
    assert torch.isfinite(got).all()
    err = (got - ref).abs().max().item()
    assert err < 2e-6, err
    assert (got.sum(-2) - 1).abs().max().item() < 1e-5            # columns sum to one, as the reference's do


def test_fused_sinkhorn_inside_torch_compile():
    logits = torch.randn(64, 1, 4, 4, device="cuda")
    f = torch.compile(lambda x: triton_sinkhorn.sinkhorn(x * 2.0, 20, 1e-6) + 1.0, fullgraph=True)
    got = f(logits)
    ref = sinkhorn(logits * 2.0, 20, 1e-6) + 1.0
    assert torch.isfinite(got).all() and (got - ref).abs().max().item() < 2e-6


@pytest.mark.parametrize("compiled", [False, True])
def test_fused_sinkhorn_gradient_equals_autograd_through_the_reference(compiled):
    """The backward kernel, called by autograd and from a compiled region's backward (training's hyper-connections
    with compiled=...+sinkhorn), against autograd through the reference in fp64."""
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(4096, 4, 4, generator=g) * 4).cuda()
    dy = torch.randn(4096, 4, 4, generator=g).cuda()
    ref_x = logits.double().requires_grad_()
    (sinkhorn(ref_x * 2.0, 20, 1e-6) * dy.double()).sum().backward()
    f = lambda x: (triton_sinkhorn.sinkhorn(x * 2.0, 20, 1e-6) * dy).sum()
    if compiled:
        f = torch.compile(f, fullgraph=True)
    x = logits.clone().requires_grad_()
    f(x).backward()
    assert torch.isfinite(x.grad).all()
    err = ((x.grad.double() - ref_x.grad).abs().max() / ref_x.grad.abs().max()).item()
    assert err < 1e-5, err
