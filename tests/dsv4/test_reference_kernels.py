"""The two sparse-attention references (gather, dense masked) against each other and against a loop; the
indexer reference against its definition."""
import math

import pytest
import torch

from dsv4.kernels import reference as ref

B, S, H, D, N, K = 2, 6, 3, 16, 10, 5
SCALE = D ** -0.5


def _inputs(sink_kind: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, S, H, D, generator=g, dtype=torch.float64)
    kv = torch.randn(B, N, D, generator=g, dtype=torch.float64)
    sink = {"zero": torch.zeros(H), "positive": torch.full((H,), 2.0), "negative": torch.full((H,), -3.0),
            "mixed": torch.tensor([-2.0, 0.0, 1.5])}[sink_kind].double()
    # unique indices per row, some slots -1, row (0, 1) entirely empty, row (1, 2) full
    idx = torch.stack([torch.stack([torch.randperm(N, generator=g)[:K] for _ in range(S)]) for _ in range(B)])
    drop = torch.rand(B, S, K, generator=g) < 0.4
    idx = torch.where(drop, -1, idx)
    idx[0, 1] = -1
    idx[1, 2] = torch.arange(K)
    return q, kv, sink, idx.int()


def _loop(q, kv, sink, idx):
    o = torch.zeros_like(q)
    lse = torch.zeros(B, S, H, dtype=q.dtype)
    for b in range(B):
        for t in range(S):
            rows = [int(i) for i in idx[b, t] if i >= 0]
            for h in range(H):
                s = [SCALE * float(q[b, t, h] @ kv[b, r]) for r in rows]
                z = sum(math.exp(x) for x in s) + math.exp(float(sink[h]))
                lse[b, t, h] = math.log(z)
                for x, r in zip(s, rows):
                    o[b, t, h] += math.exp(x) / z * kv[b, r]
    return o, lse


@pytest.mark.parametrize("sink_kind", ["zero", "positive", "negative", "mixed"])
def test_gather_matches_dense_and_loop_values_and_grads(sink_kind):
    q, kv, sink, idx = _inputs(sink_kind)
    o_loop, lse_loop = _loop(q, kv, sink, idx)
    outs, grads = {}, {}
    for name, fn in (("gather", ref.sparse_attn_gather_lse), ("dense", ref.sparse_attn_dense_lse)):
        qq, kk, ss = (t.clone().requires_grad_() for t in (q, kv, sink))
        o, lse = fn(qq, kk, ss, idx, SCALE)
        assert torch.isfinite(o).all() and torch.isfinite(lse).all()
        (o * torch.linspace(-1, 1, D, dtype=o.dtype)).sum().add(lse.sum() * 0.3).backward()
        outs[name], grads[name] = (o, lse), (qq.grad, kk.grad, ss.grad)
        assert all(torch.isfinite(gr).all() for gr in grads[name])
        torch.testing.assert_close(o, o_loop, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(lse, lse_loop, rtol=1e-10, atol=1e-12)
    for a, b in zip(grads["gather"], grads["dense"]):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    assert grads["gather"][2].abs().max() > 0               # the sink receives a gradient


def test_all_masked_row_is_zero_and_finite_with_finite_grads():
    q, kv, sink, idx = _inputs("mixed")
    idx = torch.full_like(idx, -1)
    for fn in (ref.sparse_attn_gather_lse, ref.sparse_attn_dense_lse):
        qq, kk, ss = (t.clone().requires_grad_() for t in (q, kv, sink))
        o, lse = fn(qq, kk, ss, idx, SCALE)
        assert torch.equal(o, torch.zeros_like(o))
        torch.testing.assert_close(lse, ss.detach().view(1, 1, H).expand(B, S, H))   # only the sink remains
        (o.sum() + lse.sum()).backward()
        assert all(torch.isfinite(t.grad).all() for t in (qq, kk, ss))


def test_padded_slots_never_read_garbage():
    """A NaN in a kv row that only padded (-1) slots point at must not reach outputs or gradients."""
    q, kv, sink, idx = _inputs("zero")
    idx = torch.where(idx == 0, 1, idx)       # row 0 is never referenced ... but -1 is clamped onto it
    kv = kv.clone()
    kv[:, 0] = float("nan")
    kk = kv.clone().requires_grad_()
    o = ref.sparse_attn_gather(q, kk, sink, idx, SCALE)
    assert torch.isfinite(o).all()
    o.sum().backward()
    assert torch.isfinite(kk.grad).all() and torch.equal(kk.grad[:, 0], torch.zeros_like(kk.grad[:, 0]))


def test_float32_and_bf16_dtypes_follow_q():
    q, kv, sink, idx = _inputs("mixed")
    o = ref.sparse_attn_gather(q.bfloat16(), kv.bfloat16(), sink.float(), idx, SCALE)
    assert o.dtype == torch.bfloat16 and torch.isfinite(o.float()).all()
    o32 = ref.sparse_attn_gather(q.float(), kv.float(), sink.float(), idx, SCALE)
    torch.testing.assert_close(o.float(), o32, rtol=0.05, atol=0.03)


def test_dispatcher_torch_impl_is_the_reference():
    from dsv4.kernels import sparse_attn
    q, kv, sink, idx = _inputs("positive")
    torch.testing.assert_close(sparse_attn(q, kv, sink, idx, SCALE, impl="torch"),
                               ref.sparse_attn_gather(q, kv, sink, idx, SCALE))


def test_indexer_logits_and_topk():
    g = torch.Generator().manual_seed(0)
    Hi, Di, S_, ratio = 4, 8, 13, 4
    n = S_ // ratio
    q, k = torch.randn(1, S_, Hi, Di, generator=g), torch.randn(1, n, Di, generator=g)
    w = torch.randn(1, S_, Hi, generator=g)
    logits = ref.indexer_logits_ref(q, k, w, ratio)
    for t in range(S_):
        for c in range(n):
            if c < (t + 1) // ratio:
                want = sum(max(float(q[0, t, h] @ k[0, c]), 0.0) * float(w[0, t, h]) for h in range(Hi))
                assert abs(float(logits[0, t, c]) - want) < 1e-4
            else:
                assert logits[0, t, c] == float("-inf")
    top = ref.indexer_topk(logits, 2)
    assert top.shape == (1, S_, 2) and top.dtype == torch.int32
    for t in range(S_):
        valid = (t + 1) // ratio
        chosen = {int(i) for i in top[0, t] if i >= 0}
        assert len(chosen) == min(2, valid) and all(c < valid for c in chosen)
        if valid:
            best = set(logits[0, t, :valid].topk(min(2, valid)).indices.tolist())
            assert chosen == best
