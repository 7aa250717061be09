"""The trainer's gradient finite check (dsv4/megatron/train.py all_finite): right on NaN and both infinities in any
dtype, and allocating nothing of the buffers' size (torch.isfinite's temporaries were 7 bytes an element: 21 GiB
on the routed experts' buffer of a TP8 EP8 rank, which ran out of memory on them)."""
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dsv4.megatron.train import all_finite


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), None])
def test_all_finite_finds_each_kind(dtype, bad):
    bufs = [torch.zeros(1000, dtype=dtype), torch.randn(3000).to(dtype), torch.zeros(0, dtype=dtype)]
    if bad is not None:
        bufs[1][1234] = bad
    got = all_finite(bufs)
    assert got.dtype == torch.bool and got.dim() == 0
    assert bool(got) is (bad is None)


def test_all_finite_of_nothing_is_true():
    assert bool(all_finite([]))


def test_all_finite_allocates_nothing_of_the_buffers_size():
    live: dict[int, int] = {}
    peak = [0]

    class Sizes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in (out if isinstance(out, (tuple, list)) else (out,)):
                if isinstance(t, torch.Tensor):
                    live[id(t)] = t.numel() * t.element_size()
                    weakref.finalize(t, live.pop, id(t), None)
            peak[0] = max(peak[0], sum(live.values()))
            return out
    g = torch.zeros(1 << 20)
    with Sizes():
        all_finite([g, g])
    assert peak[0] <= 64, peak[0]                 # a few 0-d tensors, against 7 MiB for isfinite on g
