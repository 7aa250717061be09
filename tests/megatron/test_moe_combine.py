"""The grouped MoE's combine (dsv4/megatron/layers.py _Combine: a gather of each token's k rows and their sum in
ascending expert order) against what it replaced and what the reference loop does: index_add of the fp32 rows into
zeros, one expert after another. Same bits forward and backward on the CPU (the GPU runs the same ops, compiled)."""
import pytest
import torch

from dsv4.megatron import layers


def _routing(T, k, E, seed):
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])      # top-k: distinct experts a token
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    pos = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel()))
    return idx, order, order // k, pos.view(T, k).sort(-1).values


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_combine_equals_the_reference_loops_sums_bit_for_bit(dtype):
    T, k, E, D = 37, 6, 16, 24
    idx, order, tok, pos = _routing(T, k, E, 0)
    out = torch.randn(T * k, D, generator=torch.Generator().manual_seed(1)).to(dtype).requires_grad_()
    y = layers._Combine.apply(out, pos, tok, layers.combine_rows, layers.spread_rows)
    # the reference loop: for each expert ascending, index_add its rows (sorted order = expert, then token)
    ref_out = out.detach().clone().requires_grad_()
    ref = torch.zeros(T, D)
    flat_sorted = idx.reshape(-1)[order]
    for e in torch.unique(idx).tolist():
        rows = (flat_sorted == e).nonzero().squeeze(1)
        ref = ref.index_add(0, tok[rows], ref_out[rows].float())
    assert torch.isfinite(y).all()
    assert torch.equal(y, ref)
    g = torch.randn(T, D, generator=torch.Generator().manual_seed(2))
    y.backward(g)
    ref.backward(g)
    assert out.grad.dtype == dtype and torch.isfinite(out.grad).all()
    assert torch.equal(out.grad, ref_out.grad)


def test_combine_sums_in_expert_order_not_slot_order():
    """Rows whose fp32 sum depends on the order: the result is the expert-ascending one."""
    T, k = 1, 3
    out = torch.tensor([[1e8], [1.0], [-1e8]])                  # sorted rows: experts 2, 5, 9 of the one token
    tok = torch.zeros(3, dtype=torch.long)
    pos = torch.tensor([[0, 1, 2]])
    y = layers._Combine.apply(out, pos, tok, layers.combine_rows, layers.spread_rows)
    assert y.item() == 0.0                                       # (1e8 + 1) - 1e8 in fp32; rows 2, 0, 1 give 1.0
    y2 = layers._Combine.apply(out, torch.tensor([[2, 0, 1]]), tok, layers.combine_rows, layers.spread_rows)
    assert y2.item() == 1.0


def test_compiled_combine_and_spread_match_eager():
    """The forms the moe region compiles on CUDA (_compiled: inductor; on a CPU its C++ backend) trace and give the
    eager bits: the sum's order is written out, and a gather and a cast have nothing to reorder."""
    T, k, E, D = 29, 6, 12, 40
    idx, order, tok, pos = _routing(T, k, E, 3)
    out = torch.randn(T * k, D, generator=torch.Generator().manual_seed(4)).bfloat16()
    g = torch.randn(T, D, generator=torch.Generator().manual_seed(5))
    y_e, y_c = layers.combine_rows(out, pos), layers._compiled("combine")(out, pos)
    s_e, s_c = layers.spread_rows(g, tok, torch.bfloat16), layers._compiled("spread")(g, tok, torch.bfloat16)
    assert torch.isfinite(y_c).all() and torch.isfinite(s_c.float()).all()
    assert torch.equal(y_c, y_e) and torch.equal(s_c, s_e)
