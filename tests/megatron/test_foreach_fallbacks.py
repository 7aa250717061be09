"""The foreach forms the trainer puts in place of megatron's per-tensor fallbacks (no apex or TransformerEngine:
`train.foreach_l2_norm`, `train.foreach_scale`) compute what those fallbacks do: the gradient norm of a list of
tensors, a scaled copy into tensors of another dtype (the fp32 master weights into the bf16 ones), an in-place
scale (gradient clipping); and a trainer built in this process uses them."""
from __future__ import annotations

import torch

from dsv4.megatron.train import _foreach_megatron_fallbacks, foreach_l2_norm, foreach_scale


def _tensors(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=g, dtype=torch.float32).to(dtype) * s
            for shape, s in (((7, 5), 1.0), ((129,), 1e-3), ((3, 4, 2), 30.0), ((1,), 0.0))]


def test_l2_norm_equals_megatrons():
    from megatron.core.utils import local_multi_tensor_l2_norm
    flag = torch.zeros(1, dtype=torch.int)
    ts = _tensors()
    ours, _ = foreach_l2_norm(0, flag, [ts], False)
    ref = torch.norm(torch.tensor([float(torch.norm(t)) for t in ts]))
    assert ours.shape == (1,) and ours.dtype == torch.float32 and torch.isfinite(ours).all()
    assert torch.allclose(ours[0], ref, rtol=1e-6), (ours, ref)
    # megatron's own (it puts its result on "cuda": compare on its arithmetic above where there is no GPU)
    if torch.cuda.is_available():
        theirs, _ = local_multi_tensor_l2_norm(0, flag, [[t.cuda() for t in ts]], False)
        assert torch.allclose(ours, theirs.cpu(), rtol=1e-6)
    empty, _ = foreach_l2_norm(0, flag, [[]], False)
    assert empty.tolist() == [0.0]


def test_scale_equals_megatrons():
    from megatron.core.utils import local_multi_tensor_scale
    flag = torch.zeros(1, dtype=torch.int)
    for scale in (1.0, 0.37):
        src = _tensors()
        ours, theirs = [torch.empty_like(t, dtype=torch.bfloat16) for t in src], \
            [torch.empty_like(t, dtype=torch.bfloat16) for t in src]
        foreach_scale(0, flag, [src, ours], scale)
        local_multi_tensor_scale(0, flag, [src, theirs], scale)
        for a, b in zip(ours, theirs):
            assert torch.isfinite(a).all() and torch.equal(a, b)
        inplace, ref = _tensors(), [t * 0.37 for t in _tensors()]
        foreach_scale(0, flag, [inplace, inplace], 0.37)
        for a, b in zip(inplace, ref):
            assert torch.equal(a, b)


def test_the_trainer_installs_them():
    from megatron.core.optimizer import clip_grads, optimizer
    _foreach_megatron_fallbacks()
    assert clip_grads.l2_norm_impl is foreach_l2_norm
    assert clip_grads.multi_tensor_scale_impl is foreach_scale and optimizer.multi_tensor_scale_impl is foreach_scale
