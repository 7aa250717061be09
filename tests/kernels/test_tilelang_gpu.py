"""GPU: TileLang kernels against the pure-torch references, values and gradients.

Every comparison asserts finiteness first and then |got - ref| <= tol * |ref| + atol in the 2-norm, with
no denominator that could be skipped: a NaN anywhere fails the test."""
import importlib.util

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(importlib.util.find_spec("tilelang") is None, reason="tilelang is not installed"),
]


def assert_close(name, got, ref, tol, atol=1e-6):
    assert torch.isfinite(got).all(), f"{name}: {(~torch.isfinite(got)).sum().item()} non-finite values"
    assert torch.isfinite(ref).all(), f"{name}: the reference itself is non-finite"
    err = (got.double() - ref.double()).norm().item()
    scale = ref.double().norm().item()
    assert err <= tol * scale + atol, f"{name}: |err| {err:.3e} > {tol} * |ref| {scale:.3e} + {atol}"


def make_case(B, S, N, H, D, K, pad_frac, sink_kind, empty_rows=0, seed=0, device="cuda"):
    """Unique indices per row (gather and dense references disagree on duplicates), a fraction of -1 slots,
    `empty_rows` rows with no valid slot at all, and KV's last row poisoned with NaN and never indexed."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(B, S, H, D, generator=g).to(device, torch.bfloat16)
    kv = torch.randn(B, N, D, generator=g).to(device, torch.bfloat16)
    kv[:, -1] = float("nan")                      # only a load of an unmasked/clamped slot could read it
    idx = torch.stack([torch.randperm(N - 1, generator=g)[:K] for _ in range(B * S)]).view(B, S, K)
    idx = torch.where(torch.rand(B, S, K, generator=g) < pad_frac, -1, idx)
    if empty_rows:
        idx[:, :empty_rows] = -1
    sink = {"zero": torch.zeros(H), "pos": torch.full((H,), 3.0), "neg": torch.full((H,), -3.0),
            "mixed": torch.randn(H, generator=g) * 4}[sink_kind]
    return q, kv, sink.to(device), idx.to(device, torch.int32)


CASES = [  # B, S, N, H, D, K, pad_frac, sink, empty_rows
    (1, 64, 700, 64, 512, 640, 0.2, "zero", 0),
    (2, 48, 300, 64, 512, 192, 0.5, "pos", 3),
    (1, 40, 400, 128, 512, 256, 0.1, "neg", 2),
    (1, 32, 200, 128, 512, 130, 0.3, "mixed", 1),     # top-k not a multiple of the block
    (2, 24, 100, 16, 128, 40, 0.3, "mixed", 2),       # few heads (padded to 64), D = 128
    (1, 37, 300, 64, 512, 256, 0.2, "pos", 1),        # odd S
    (2, 200, 600, 128, 512, 384, 0.2, "mixed", 1),    # 800 items: the persistent forward's CTAs take several each
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}S{}N{}H{}D{}K{}-{}".format(*c[:6], c[7]))
def test_sparse_attn_forward_and_lse(case):
    from dsv4.kernels import reference as ref
    from dsv4.kernels.tilelang_sparse_attn import sparse_attn_fwd
    *shape, pad, sink_kind, empty = case
    q, kv, sink, idx = make_case(*shape, pad, sink_kind, empty)
    scale = shape[4] ** -0.5
    o, lse = sparse_attn_fwd(q, kv, sink, idx, scale)
    o_ref, lse_ref = ref.sparse_attn_gather_lse(q.float(), kv.float(), sink, idx, scale)
    assert_close("o", o.float(), o_ref, 1e-2)
    assert_close("lse", lse, lse_ref, 1e-4)
    if empty:
        assert (o[:, :empty] == 0).all(), "rows with no valid slot must give o = 0"


@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}S{}N{}H{}D{}K{}-{}".format(*c[:6], c[7]))
def test_sparse_attn_gradients(case):
    from dsv4.kernels import reference as ref
    from dsv4.kernels.tilelang_sparse_attn import sparse_attn
    *shape, pad, sink_kind, empty = case
    q, kv, sink, idx = make_case(*shape, pad, sink_kind, empty, seed=1)
    scale = shape[4] ** -0.5
    do = torch.randn(q.shape, device="cuda", dtype=torch.bfloat16)
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, kv, sink)]
    sparse_attn(*leaves, idx, scale).backward(do)
    kv_clean = torch.where(torch.isnan(kv), 0, kv)   # the reference's gather touches the poisoned row's grad
    ref_leaves = [t.detach().float().clone().requires_grad_(True) for t in (q, kv_clean, sink)]
    ref.sparse_attn_gather(*ref_leaves, idx, scale).backward(do.float())
    for name, got, want, tol in zip(("dq", "dkv", "dsink"), (l.grad for l in leaves), (l.grad for l in ref_leaves),
                                    (2e-2, 2e-2, 2e-2)):
        assert_close(name, got.float(), want, tol, atol=1e-4)
    if empty:
        assert (leaves[0].grad[:, :empty] == 0).all(), "rows with no valid slot must give dq = 0"


def test_sparse_attn_out_of_range_indices_are_empty_slots():
    """An index >= N is an empty slot like -1 in the TileLang kernels (the forward masks its load; the backward's
    TMA box lies outside the tensor map and is zero-filled): same values and gradients as the reference given -1
    there. N itself, N + 1 and 2**30 are all used."""
    from dsv4.kernels import reference as ref
    from dsv4.kernels.tilelang_sparse_attn import sparse_attn
    q, kv, sink, idx = make_case(1, 32, 300, 64, 512, 256, 0.1, "pos", seed=3)
    N = kv.shape[1]
    g = torch.Generator(device="cpu").manual_seed(4)
    oob = (torch.rand(idx.shape, generator=g) < 0.2).to(idx.device)
    far = torch.tensor([N, N + 1, 2 ** 30], dtype=torch.int32)[torch.randint(0, 3, idx.shape, generator=g)]
    idx_oob = torch.where(oob, far.to(idx.device), idx)
    idx_ref = torch.where(oob | (idx < 0), -1, idx)
    do = torch.randn(q.shape, device="cuda", dtype=torch.bfloat16)
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, kv, sink)]
    o = sparse_attn(*leaves, idx_oob, 512 ** -0.5)
    o.backward(do)
    kv_clean = torch.where(torch.isnan(kv), 0, kv)
    ref_leaves = [t.detach().float().clone().requires_grad_(True) for t in (q, kv_clean, sink)]
    o_ref = ref.sparse_attn_gather(*ref_leaves, idx_ref, 512 ** -0.5)
    o_ref.backward(do.float())
    assert_close("o", o.float(), o_ref, 1e-2)
    for name, got, want in zip(("dq", "dkv", "dsink"), (l.grad for l in leaves), (l.grad for l in ref_leaves)):
        assert_close(name, got.float(), want, 2e-2, atol=1e-4)


def test_sparse_attn_nan_in_a_query_reaches_its_output_and_lse():
    """A NaN in a query's q must come out NaN in that query's O and LSE, as in the reference, not as a finite value
    (a `sum > 0` guard in the normalisation turned the NaN row sum into a finite LSE); every other query is finite
    and as the reference's."""
    from dsv4.kernels import reference as ref
    from dsv4.kernels.tilelang_sparse_attn import sparse_attn_fwd
    q, kv, sink, idx = make_case(1, 16, 300, 64, 512, 256, 0.1, "pos", seed=5)
    q[0, 3, 7, 11] = float("nan")
    o, lse = sparse_attn_fwd(q, kv, sink, idx, 512 ** -0.5)
    kv_clean = torch.where(torch.isnan(kv), 0, kv).float()
    o_ref, lse_ref = ref.sparse_attn_gather_lse(q.float(), kv_clean, sink, idx, 512 ** -0.5)
    assert torch.isnan(o_ref[0, 3, 7]).all() and torch.isnan(lse_ref[0, 3, 7])
    assert torch.isnan(o[0, 3, 7]).all(), "the poisoned head's output came out finite"
    assert torch.isnan(lse[0, 3, 7]), f"the poisoned head's LSE came out as {lse[0, 3, 7].item()}"
    rest = torch.ones(q.shape[1], dtype=torch.bool, device=q.device)
    rest[3] = False
    assert_close("o (other queries)", o[:, rest].float(), o_ref[:, rest], 1e-2)
    assert_close("lse (other queries)", lse[:, rest], lse_ref[:, rest], 1e-3, atol=1e-3)

def test_sparse_attn_matches_dense_reference_and_neg_inf_sink():
    """Second reference (dense mask) and a -inf sink (no sink) with empty rows: still finite."""
    from dsv4.kernels import reference as ref
    from dsv4.kernels.tilelang_sparse_attn import sparse_attn
    q, kv, sink, idx = make_case(1, 32, 256, 64, 512, 128, 0.3, "zero", empty_rows=2, seed=2)
    sink = torch.full_like(sink, float("-inf"))
    q, kv, sink = (t.detach().clone().requires_grad_(True) for t in (q, kv, sink))
    o = sparse_attn(q, kv, sink, idx, 512 ** -0.5)
    o.float().square().sum().backward()
    for name, t in (("o", o), ("dq", q.grad), ("dkv", kv.grad), ("dsink", sink.grad)):
        assert torch.isfinite(t).all(), f"{name} non-finite with a -inf sink"
    kv_clean = torch.where(torch.isnan(kv.detach()), 0, kv.detach()).float()
    o_ref = ref.sparse_attn_dense(q.detach().float(), kv_clean, sink.detach(), idx, 512 ** -0.5)
    assert torch.isfinite(o_ref[:, 2:]).all()
    assert_close("o vs dense", o[:, 2:].float(), o_ref[:, 2:], 1e-2)
    assert (o[:, :2] == 0).all()


@pytest.mark.parametrize("B,S,Hi,Di,ratio", [(1, 256, 64, 128, 4), (2, 100, 4, 64, 4), (1, 300, 64, 128, 16)])
def test_indexer_logits(B, S, Hi, Di, ratio):
    from dsv4.kernels import reference as ref
    from dsv4.kernels.tilelang_indexer import indexer_logits
    g = torch.Generator().manual_seed(3)
    N = S // ratio
    q = torch.randn(B, S, Hi, Di, generator=g).cuda().bfloat16()
    k = torch.randn(B, N, Di, generator=g).cuda().bfloat16()
    w = (torch.randn(B, S, Hi, generator=g) * (Hi * Di) ** -0.5).cuda()
    got = indexer_logits(q, k, w, ratio)
    want = ref.indexer_logits_ref(q.float(), k.float(), w, ratio)
    visible = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), visible), "causal bound differs from c < (t+1)//ratio"
    assert (got[~visible] == float("-inf")).all()
    assert_close("logits", got[visible], want[visible], 1e-4)
    k_sel = min(8, N)
    got_top = ref.indexer_topk(got, k_sel).sort(-1).values
    want_top = ref.indexer_topk(want, k_sel).sort(-1).values
    assert (got_top == want_top).float().mean() > 0.99, "top-k sets differ beyond near-ties"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("block,fmt", [(128, "ue8m0"), (128, None), (64, "ue8m0"), (64, None)])
def test_act_quant_bit_exact(dtype, block, fmt):
    """Bit-exact against the formula (IEEE amax / 448, RNE e4m3 cast); within one ulp of dsv4.quant, whose
    `tensor / 448` runs on CUDA as a multiplication by the rounded reciprocal."""
    from dsv4.quant import act_quant as act_quant_ref, pow2_ceil
    from dsv4.kernels.tilelang_act_quant import act_quant
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(3, 77, 512, generator=g) * torch.logspace(-6, 3, 512)).to("cuda", dtype)
    x[0, 0, :block] = 0                           # amax clamp to 1e-4
    q, s = act_quant(x, block, fmt)
    assert torch.isfinite(s).all() and torch.isfinite(q.float()).all()
    xb = x.float().unflatten(-1, (-1, block))
    amax = xb.abs().amax(-1).clamp(min=1e-4)
    s_spec = amax / torch.full_like(amax, 448.0)
    if fmt == "ue8m0":
        s_spec = pow2_ceil(s_spec)
    assert torch.equal(s, s_spec), f"scales differ in {(s != s_spec).sum().item()} blocks"
    q_spec = (xb / s_spec.unsqueeze(-1)).clamp(-448, 448).to(torch.float8_e4m3fn).flatten(-2)
    assert torch.equal(q.view(torch.uint8), q_spec.view(torch.uint8)), \
        f"fp8 codes differ in {(q.view(torch.uint8) != q_spec.view(torch.uint8)).sum().item()} elements"
    _, s_ref = act_quant_ref(x, block, ue8m0=fmt == "ue8m0")
    assert ((s - s_ref).abs() <= s_ref * 2.0 ** -22).all(), "more than one ulp from dsv4.quant.act_quant"
