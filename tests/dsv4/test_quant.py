"""Quantization formats: round trips, exact power-of-two scales, FP4 rounding and packing, lossless FP4->FP8."""
import pytest
import torch

from dsv4 import quant, stepmemo

G = torch.Generator().manual_seed(0)


def _is_pow2(s: torch.Tensor) -> bool:
    m, _ = torch.frexp(s)
    return bool(((m == 0.5) & (s > 0)).all())


def test_pow2_ceil_is_exact():
    x = torch.tensor([1.0, 0.75, 2.0 ** -20, 3.0, 448.0, 1e-4 / 448, 2.0 ** 10 + 1])
    want = torch.tensor([1.0, 1.0, 2.0 ** -20, 4.0, 512.0, 2.0 ** -22, 2.0 ** 11])
    assert torch.equal(quant.pow2_ceil(x), want)


@pytest.mark.parametrize("block", [128, 64])
def test_act_quant_ue8m0(block):
    x = torch.randn(3, 5, 256, generator=G) * torch.logspace(-3, 3, 256)
    q, s = quant.act_quant(x, block)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (3, 5, 256 // block)
    assert _is_pow2(s)
    qmax = q.float().unflatten(-1, (-1, block)).abs().amax(-1)
    assert (qmax <= 448).all() and (qmax >= 224).all()      # the smallest power of two that fits amax (224 after rounding)
    back = quant.act_dequant(q, s, block)
    assert torch.isfinite(back).all()
    scale_full = s.repeat_interleave(block, -1)
    normal = x.abs() >= scale_full * 2.0 ** -6               # e4m3 normal range: 3 mantissa bits
    err = (back - x).abs()
    assert (err[normal] <= x.abs()[normal] * 2.0 ** -4).all()
    assert (err[~normal] <= scale_full[~normal] * 2.0 ** -10).all()   # subnormal step 2^-9, half of it
    # by hand: amax 1 -> scale 2^ceil(log2(1/448)) = 2^-8, so q = 256 x, rounded to e4m3 (76.8 -> 80: step 8 in 64..128)
    q1, s1 = quant.act_quant(torch.tensor([[1.0, -0.5, 0.3] + [0.0] * (block - 3)]), block)
    assert s1.item() == 2.0 ** -8 and q1.float()[0, :3].tolist() == [256.0, -128.0, 80.0]


def test_act_quant_fp32_scales():
    x = torch.randn(4, 128, generator=G)
    q, s = quant.act_quant(x, 128, ue8m0=False)
    torch.testing.assert_close(s, x.abs().amax(-1, keepdim=True) / 448)
    assert (q.float().abs().amax(-1) == 448).all()


@pytest.mark.parametrize("shape", [(256, 384), (130, 200), (64, 128)])
def test_weight_fp8_blocks(shape):
    w = torch.randn(*shape, generator=G)
    w[: min(128, shape[0]), :128] *= 1000                    # one block far larger than the rest
    q, s = quant.weight_quant_fp8(w)
    assert q.shape == w.shape and s.shape == (-(-shape[0] // 128), -(-shape[1] // 128)) and _is_pow2(s)
    e8 = quant.to_e8m0(s)
    assert e8.dtype == torch.float8_e8m0fnu and torch.equal(quant.from_e8m0(e8), s)
    back = quant.weight_dequant_fp8(q, e8, dtype=torch.float32)
    assert torch.isfinite(back).all()
    rel = (back - w).norm() / w.norm()
    assert rel < 0.04                                        # e4m3 RMS rounding error ~2-3%
    # each block is scaled independently: the small blocks keep their own precision
    if shape[1] > 128:
        small = w[:, 128:]
        assert (back[:, 128:] - small).norm() / small.norm() < 0.04
    # FP8 values times power-of-two scales are exact in bf16: dequant -> bf16 -> requant is lossless
    q2, s2 = quant.weight_quant_fp8(quant.weight_dequant_fp8(q, s))
    assert torch.equal(s2, s) and torch.equal(q2.view(torch.uint8), q.view(torch.uint8))


def test_to_e8m0_refuses_non_powers_of_two():
    with pytest.raises(ValueError, match="powers of two"):
        quant.to_e8m0(torch.tensor([3.0]))


def test_fp4_codes_values_and_round_to_nearest_even():
    vals = torch.tensor(quant.FP4_VALUES)
    codes = quant.fp4_encode(vals)
    assert torch.equal(quant.fp4_decode(codes), vals)
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -5.0])
    want = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -0.0, -4.0])   # to the even code
    assert torch.equal(quant.fp4_decode(quant.fp4_encode(ties)), want)
    near = torch.tensor([0.26, 1.3, 2.6, 4.9, 5.1, 5.9])
    assert torch.equal(quant.fp4_decode(quant.fp4_encode(near)), torch.tensor([0.5, 1.5, 3.0, 4.0, 6.0, 6.0]))


def test_fp4_pack_low_nibble_first():
    codes = torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8)
    packed = quant.fp4_pack(codes)
    assert packed.dtype == torch.int8 and packed.view(torch.uint8).tolist() == [[0x21, 0x0F]]
    assert torch.equal(quant.fp4_unpack(packed), codes)


def test_mxfp4_round_trip():
    w = torch.randn(64, 256, generator=G) * torch.logspace(-2, 2, 256)
    packed, s = quant.mxfp4_quant(w)
    assert packed.shape == (64, 128) and packed.dtype == torch.int8
    assert s.shape == (64, 8) and s.dtype == torch.float8_e8m0fnu and _is_pow2(quant.from_e8m0(s))
    back = quant.mxfp4_dequant(packed, s, torch.float32)
    step = quant.from_e8m0(s).repeat_interleave(32, -1)
    assert torch.isfinite(back).all() and ((back - w).abs() <= step).all()   # half the widest e2m1 gap (2)
    amax = w.abs().unflatten(-1, (-1, 32)).amax(-1)
    assert ((amax / quant.from_e8m0(s) > 3) & (amax / quant.from_e8m0(s) <= 6)).all()
    # representable values survive a second pass unchanged (codes may differ: an amax that rounded down to 3
    # halves the block scale, and 2x every e2m1 value <= 3 is again an e2m1 value)
    assert torch.equal(quant.mxfp4_dequant(*quant.mxfp4_quant(back), torch.float32), back)


def test_fp4_to_fp8_is_lossless():
    w = torch.randn(256, 256, generator=G) * torch.logspace(-1, 1, 256)
    packed, s = quant.mxfp4_quant(w)
    w8, S = quant.fp4_to_fp8(packed, s)
    assert w8.dtype == torch.float8_e4m3fn and S.shape == (2, 2) and _is_pow2(S)
    assert torch.equal(quant.weight_dequant_fp8(w8, S, dtype=torch.float32), quant.mxfp4_dequant(packed, s, torch.float32))
    assert w8.float().abs().max() <= 384


def test_straight_through_gradients_are_identity():
    x = torch.randn(4, 128, generator=G, requires_grad=True)
    for fn in (quant.fp8_act_qdq, quant.fp4_act_qdq, quant.fp8_weight_qdq, quant.mxfp4_weight_qdq):
        x.grad = None
        y = fn(x)
        assert not torch.equal(y, x) and torch.isfinite(y).all()
        (y * 3).sum().backward()
        assert torch.equal(x.grad, torch.full_like(x, 3.0))


def test_act_qdq_pads_ragged_last_dim():
    x = torch.randn(2, 64, generator=G)
    y = quant.fp8_act_qdq(x, 128)
    q, s = quant.act_quant(torch.nn.functional.pad(x, (0, 64)), 128)
    assert torch.equal(y, quant.act_dequant(q, s, 128)[:, :64])


def test_fast_dequant_paths_are_exact_on_every_code():
    """The bf16 bit-widening FP8 path and the two-byte FP4 table agree with plain float arithmetic on all codes,
    subnormals and NaN included."""
    codes = torch.arange(256, dtype=torch.uint8).repeat(128, 64)              # [128, 16384]: every byte, many times
    q8 = codes.view(torch.float8_e4m3fn)[:, :256]
    s = quant.to_e8m0(torch.tensor([[2.0 ** -9, 2.0 ** 3]]))
    fast = quant.weight_dequant_fp8(q8, s, dtype=torch.bfloat16).float()
    slow = q8.float() * torch.tensor([2.0 ** -9] * 128 + [2.0 ** 3] * 128)
    assert torch.equal(fast.isnan(), slow.isnan()) and fast.isnan().any()
    assert torch.equal(fast.nan_to_num(), slow.nan_to_num())
    packed = codes.view(torch.int8)
    s4 = quant.to_e8m0(torch.full((128, packed.shape[1] * 2 // 32), 2.0 ** -3))
    want = quant.fp4_dequant(quant.fp4_unpack(packed), s4, 32)
    assert torch.equal(quant.mxfp4_dequant(packed, s4, torch.float32), want)
    assert torch.equal(quant.mxfp4_dequant(packed, s4).float(), want)


@pytest.mark.parametrize("shape", [(256, 8192), (384, 512)], ids=["chunks-inside-a-block-row", "whole-block-rows"])
def test_fast_dequant_in_chunks_matches_plain_arithmetic(shape):
    """The fast paths work through the weight in cache-sized chunks of rows (part of a 128-row block when k is wide);
    every chunk must meet its own scales, and a NaN code past the first chunk must still come out NaN."""
    n, k = shape
    q8 = (torch.randn(n, k, generator=G) * 40).clamp(-448, 448).to(torch.float8_e4m3fn)
    q8.view(torch.uint8)[n - 1, k - 1] = 0xFF                                   # a NaN code in the last chunk
    s = quant.to_e8m0(2.0 ** torch.randint(-12, 6, (n // 128, k // 128), generator=G).float())
    fast = quant.weight_dequant_fp8(q8, s, dtype=torch.bfloat16).float()
    slow = q8.float() * quant.from_e8m0(s).repeat_interleave(128, 0).repeat_interleave(128, 1)
    assert fast[-1, -1].isnan() and int(fast.isnan().sum()) == 1 and not fast.isinf().any()
    assert torch.equal(fast.nan_to_num(), slow.nan_to_num())
    packed = torch.randint(-128, 128, (n, k // 2), dtype=torch.int8, generator=G)
    s4 = quant.to_e8m0(2.0 ** torch.randint(-20, 7, (n, k // 32), generator=G).float())
    want = quant.fp4_dequant(quant.fp4_unpack(packed), s4, 32)
    got = quant.mxfp4_dequant(packed, s4)
    assert got.dtype == torch.bfloat16 and torch.isfinite(got).all() and torch.equal(got.float(), want)


@pytest.mark.parametrize("fn", [quant.fp8_weight_qdq, quant.mxfp4_weight_qdq], ids=["fp8", "mxfp4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reused_weight_qdq_is_the_same_forward_and_gradient(fn, dtype):
    """Three micro-batches through a QAT weight with and without weights_fixed(): the same outputs and
    accumulated gradient bit for bit; with it the weight is quantised once (a count of the ops dispatched), and the
    values the micro-batches hold for their backward are one copy."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))
    w0 = torch.randn(256, 384, generator=G).to(dtype)
    xs = [torch.randn(8, 384, generator=G).to(dtype) for _ in range(3)]
    got, ops = [], []
    for reuse in (False, True):
        w = w0.clone().requires_grad_()
        Count.n, outs, held = 0, [], []
        with stepmemo.weights_fixed() if reuse else torch.enable_grad(), Count():
            for x in xs:
                q = fn(w)
                held.append(q)
                outs.append(torch.nn.functional.linear(x, q))
        ops.append(Count.n)
        for y in outs:
            (y.float() ** 2).sum().backward()
        assert all(torch.isfinite(y).all() for y in outs) and torch.isfinite(w.grad).all()
        got.append((outs, w.grad, held))
    (o0, g0, h0), (o1, g1, h1) = got
    assert all(torch.equal(a, b) for a, b in zip(o0, o1)) and torch.equal(g0, g1)
    assert len({h.untyped_storage().data_ptr() for h in h1}) == 1            # one copy shared
    assert len({h.untyped_storage().data_ptr() for h in h0}) == 3
    assert ops[1] < ops[0] / 2, ops                                            # quantised once, not three times
    assert not quant._QDQ.open


def test_the_gpus_large_chunks_give_the_same_bits(monkeypatch):
    """On CUDA the quantisers work in chunks of CHUNK_ELEMS["cuda"] elements (each op a kernel launch: fewer, larger
    ones); every chunk holds whole 128-row blocks, so the values cannot depend on the chunking. Checked on the CPU by
    giving it the GPU's chunk size: the same bits for FP8 quantisation, both dequantisations, MXFP4."""
    assert quant._row_chunks(4096, 4096, 128, device="cuda") == (1 << 24) // 4096
    assert quant._row_chunks(4096, 4096, 128) == (1 << 19) // 4096 // 128 * 128
    g = torch.Generator().manual_seed(0)
    w = torch.randn(1536, 1024, generator=g) * torch.logspace(-3, 1, 1536).unsqueeze(1)    # several chunks on a CPU
    runs = []
    for elems in (quant.CHUNK_ELEMS["cpu"], quant.CHUNK_ELEMS["cuda"]):
        monkeypatch.setitem(quant.CHUNK_ELEMS, "cpu", elems)
        assert (quant._row_chunks(1536, 1024, 128) < 1536) == (elems == 1 << 19)
        q, s = quant.weight_quant_fp8(w)
        runs.append((q.view(torch.uint8), s, quant.weight_dequant_fp8(q, s, dtype=torch.float32),
                     quant.weight_dequant_fp8(*quant.weight_quant_fp8(w, 128, True), dtype=torch.bfloat16),
                     *quant.mxfp4_quant(w)))
    for a, b in zip(*runs):
        assert torch.isfinite(a.float()).all()
        assert torch.equal(a.view(torch.uint8) if a.dtype.itemsize == 1 else a,
                           b.view(torch.uint8) if b.dtype.itemsize == 1 else b)
