"""DeepSeek-V4 quantization formats, in plain torch.

* FP8 e4m3 weights with 128x128 block scales (power-of-two "ue8m0" scales stored as e8m0, or fp32 amax/448).
* FP8 activation quant with 1xB blocks along the last dim (B = 128 for GEMM inputs, 64 for the KV QAT point).
* FP4 e2m1 quant with 1x32 power-of-two scales; MXFP4 packing (two codes per byte, LOW nibble = even element).
* Lossless MXFP4 -> FP8 128x128 cast, and the dequantizers.
* Straight-through quant-dequant wrappers (`*_qdq`) used by the model's QAT simulation points: the forward
  value is the quantized one, the gradient is the identity. While `dsv4.stepmemo.weights_fixed()` is open (the
  trainer opens it around one step's forward and backward, when no weight changes) each weight is quantised once, not at every
  micro-batch: eagerly that is hundreds of small kernels a weight (the H200 rl_smoke's training spent most of its
  1.69 s a step in them, over 4 micro-batches), and the micro-batches in flight share one copy of the value.

Scales are always returned as float32 tensors holding the exact scale value; `to_e8m0` / `from_e8m0`
convert power-of-two scales to and from the 1-byte e8m0 storage format (value 2^(byte-127)).
"""
from __future__ import annotations

import sys
from functools import lru_cache

import numpy as np
import torch

from dsv4.stepmemo import Memo, weight_key

FP8 = torch.float8_e4m3fn
E8M0 = torch.float8_e8m0fnu
FP8_MAX = 448.0
FP4_MAX = 6.0
# e2m1 code -> value; bit 3 is the sign, bits 0-2 index the magnitude
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


# ---------------------------------------------------------------------------------------------- scales
def pow2_ceil(x: torch.Tensor) -> torch.Tensor:
    """2^ceil(log2(x)) for positive x, exactly (frexp, no log rounding): the ue8m0 scale rule."""
    m, e = torch.frexp(x.float())
    e = torch.where(m == 0.5, e - 1, e)  # x is already a power of two
    return torch.ldexp(torch.ones_like(m), e)


def to_e8m0(scale: torch.Tensor) -> torch.Tensor:
    """Power-of-two float32 scales -> float8_e8m0fnu (exact; refuses anything else)."""
    if not bool((pow2_ceil(scale) == scale).all()):
        raise ValueError("to_e8m0: scales must be exact powers of two (use scale_fmt='ue8m0')")
    return scale.float().to(E8M0)


def from_e8m0(scale: torch.Tensor) -> torch.Tensor:
    """e8m0 (or its raw uint8 bytes) -> float32 scale values; float scales pass through."""
    if scale.dtype == torch.uint8:
        scale = scale.view(E8M0)
    return scale.float()


def _block_scale(amax: torch.Tensor, qmax: float, ue8m0: bool, amin: float) -> torch.Tensor:
    s = amax.float().clamp(min=amin) / qmax
    return pow2_ceil(s) if ue8m0 else s


# ---------------------------------------------------------------------------------------------- FP8 activations
def act_quant(x: torch.Tensor, block: int = 128, ue8m0: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row 1 x `block` FP8 quant along the last dim: (q e4m3 [..., N], scale fp32 [..., N/block])."""
    n = x.shape[-1]
    if n % block:
        raise ValueError(f"act_quant: last dim {n} is not a multiple of block {block}")
    xb = x.float().unflatten(-1, (n // block, block))
    s = _block_scale(xb.abs().amax(-1), FP8_MAX, ue8m0, 1e-4)
    q = (xb / s.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.flatten(-2), s


def act_dequant(q: torch.Tensor, s: torch.Tensor, block: int = 128) -> torch.Tensor:
    return (q.float().unflatten(-1, (-1, block)) * s.unsqueeze(-1)).flatten(-2)


# ---------------------------------------------------------------------------------------------- FP8 weights
# elements a chunk of the eager quantisers' elementwise chains. On a CPU cache-sized: the chains run ~2-3x faster on
# chunks whose temporaries stay in cache. On a GPU each op of a chunk is a kernel launch costing ~10 us of host time,
# which at 2^19 elements (2 MB of fp32) outweighs the op itself (the RL step's QAT point and sync ran ~45,000 such
# ops a micro-batch); there a chunk only bounds the temporaries (64 MB of fp32 each, ~4 alive at once).
CHUNK_ELEMS = {"cpu": 1 << 19, "cuda": 1 << 24}


def _row_chunks(n_rows: int, row_elems: int, multiple: int = 1, target: int | None = None,
                device: torch.device | str | None = None) -> int:
    """Rows per chunk (a multiple of `multiple`) of about `target` elements: CHUNK_ELEMS of the device by default."""
    if target is None:
        target = CHUNK_ELEMS["cuda" if device is not None and torch.device(device).type == "cuda" else "cpu"]
    rows = max(1, target // max(row_elems, 1)) // multiple * multiple
    return max(rows, multiple)


def weight_quant_fp8(w: torch.Tensor, block: int = 128, ue8m0: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> (e4m3 [N, K], scale fp32 [ceil(N/block), ceil(K/block)]); ragged edge blocks are allowed."""
    n, k = w.shape
    step = _row_chunks(n, k, block, device=w.device)
    if n > step:
        parts = [weight_quant_fp8(c, block, ue8m0) for c in w.split(step)]
        return torch.cat([q for q, _ in parts]), torch.cat([s for _, s in parts])
    nb, kb = -(-n // block), -(-k // block)
    wp = torch.nn.functional.pad(w.float(), (0, kb * block - k, 0, nb * block - n))
    blocks = wp.view(nb, block, kb, block)
    s = _block_scale(blocks.abs().amax(dim=(1, 3)), FP8_MAX, ue8m0, 1e-4)
    q = (blocks / s[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(nb * block, kb * block)[:n, :k].contiguous(), s


def weight_dequant_fp8(q: torch.Tensor, s: torch.Tensor, block: int = 128, dtype=torch.bfloat16,
                       out: torch.Tensor | None = None) -> torch.Tensor:
    """W[i, j] = float(q[i, j]) * s[i // block, j // block], into `out` if given (dtype, q's shape)."""
    n, k = q.shape
    pow2 = s.dtype == E8M0
    s = from_e8m0(s) if pow2 else s.float()
    if n % block or k % block:
        full = s.repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]
        w = (q.float() * full).to(dtype)
        return w if out is None else out.copy_(w)
    out = torch.empty(n, k, dtype=dtype, device=q.device) if out is None else out
    # rows a chunk: whole block rows, or for a wide k a divisor of the block, so the temporaries stay cache-sized
    step = _row_chunks(n, k, device=q.device)
    step = step // block * block if step >= block else max(d for d in range(1, step + 1) if block % d == 0)
    fast = pow2 and dtype == torch.bfloat16 and float(s.max()) <= 2.0 ** 7
    if fast:
        s = (s * 2.0 ** 120).to(torch.bfloat16)
    for i in range(0, n, step):
        rows = min(step, block)
        blocks, si = (-1, rows, k // block, block), s[i // block:(i + step - 1) // block + 1][:, None, :, None]
        if fast:
            # e4m3 values and power-of-two scales are exact in bf16: widen the bits, scale in place (~3x .to())
            w = _e4m3_bits_as_bf16(q[i:i + step], out[i:i + step])
            w.view(blocks).mul_(si)
        else:
            out[i:i + step].view(blocks).copy_(q[i:i + step].view(blocks).float() * si)
    return out


_E4M3_NAN_AS_BF16 = 480.0 * 2.0 ** -120     # the magnitude the NaN code's bits widen to (above 448, the largest)


def _e4m3_bits_as_bf16(q: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Writes into `out` (bf16, q's shape) the e4m3 values of q times 2^-120. The byte, sign-extended to int16
    and shifted left by 4, has exponent+mantissa in bits 4-10 and copies of the sign in 11-15; the mask keeps
    bit 15 and 4-10 (e4m3 subnormals land on bf16 subnormals, so the one rule covers both). The NaN codes widen
    to +-480, the extremes, so one min/max pass finds them."""
    x = out.view(torch.int16)
    x.copy_(q.view(torch.int8))
    x.bitwise_left_shift_(4).bitwise_and_(0x87F0 - 0x10000)
    lo, hi = torch.aminmax(out)
    if float(hi) == _E4M3_NAN_AS_BF16 or float(lo) == -_E4M3_NAN_AS_BF16:
        out.masked_fill_((q.view(torch.uint8) & 0x7F) == 0x7F, float("nan"))
    return out


# ---------------------------------------------------------------------------------------------- FP4 e2m1
def fp4_encode(y: torch.Tensor) -> torch.Tensor:
    """Round already-scaled values (|y| <= 6) to e2m1 codes (uint8 0..15), round-to-nearest-even on ties.
    The e2m1 grid has step 0.5 below 2, 1 below 4 and 2 up to 6; torch.round is half-to-even on each step
    grid, which is the even-code choice (e.g. 0.75 -> 1, 1.25 -> 1, 2.5 -> 2, 5 -> 4)."""
    a = y.abs().float()
    step = torch.where(a < 2, 0.5, torch.where(a < 4, 1.0, 2.0))
    v = torch.round(a / step) * step                                   # a value of the magnitude grid
    mag = torch.where(v < 2, v * 2, torch.where(v < 4, v + 2, v / 2 + 4))   # 0,.5,1,1.5,2,3,4,6 -> 0..7
    return (mag.to(torch.uint8) | (torch.signbit(y).to(torch.uint8) << 3))


@lru_cache(maxsize=8)
def _fp4_table(device: torch.device) -> torch.Tensor:
    # cached per device: building it at each call is a host-to-device copy, which a CUDA graph capture refuses
    return torch.tensor(FP4_VALUES, dtype=torch.float32, device=device)


def fp4_decode(code: torch.Tensor) -> torch.Tensor:
    return _fp4_table(code.device)[code.long()]


def fp4_quant(x: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """1 x `block` FP4 quant along the last dim: (codes uint8 [..., N], scale fp32 [..., N/block], powers of two).
    amax is clamped to >= 6 * 2^-126 so the scale stays a normal e8m0 value."""
    n = x.shape[-1]
    if n % block:
        raise ValueError(f"fp4_quant: last dim {n} is not a multiple of block {block}")
    xb = x.float().unflatten(-1, (n // block, block))
    s = _block_scale(xb.abs().amax(-1), FP4_MAX, True, FP4_MAX * 2.0 ** -126)
    codes = fp4_encode((xb / s.unsqueeze(-1)).clamp(-FP4_MAX, FP4_MAX))
    return codes.flatten(-2), s


def fp4_dequant(codes: torch.Tensor, s: torch.Tensor, block: int = 32) -> torch.Tensor:
    return (fp4_decode(codes).unflatten(-1, (-1, block)) * from_e8m0(s).unsqueeze(-1)).flatten(-2)


def fp4_pack(codes: torch.Tensor) -> torch.Tensor:
    """[..., K] codes -> [..., K/2] int8; element 2k in the LOW nibble, 2k+1 in the high nibble."""
    c = codes.to(torch.uint8)
    return (c[..., 0::2] | (c[..., 1::2] << 4)).view(torch.int8)


def fp4_unpack(packed: torch.Tensor) -> torch.Tensor:
    p = packed.view(torch.uint8)
    return torch.stack([p & 0x0F, p >> 4], dim=-1).flatten(-2)


def mxfp4_quant(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Routed-expert weight [N, K] -> (packed int8 [N, K/2], e8m0 scales [N, K/32]): the released layout."""
    step = _row_chunks(w.shape[0], w.shape[1], device=w.device)
    if w.shape[0] > step:
        parts = [mxfp4_quant(c) for c in w.split(step)]
        return torch.cat([p for p, _ in parts]), torch.cat([s for _, s in parts])
    codes, s = fp4_quant(w, 32)
    return fp4_pack(codes), to_e8m0(s)


@lru_cache(maxsize=1)
def _fp4_quad_table() -> np.ndarray:
    """[65536] int64: two packed bytes (as one little-endian uint16) -> the bf16 bits of their four e2m1 values
    times 2^-120, lowest nibble first. The 2^-120 keeps 0.5 a normal number: a subnormal operand costs the
    CPU's multiply ~10x."""
    b = torch.arange(65536)
    v = torch.tensor(FP4_VALUES) * 2.0 ** -120
    quad = torch.stack([v[(b >> sh) & 0x0F] for sh in (0, 4, 8, 12)], dim=-1).to(torch.bfloat16)
    return quad.view(torch.int64).view(65536).numpy()


def mxfp4_dequant(packed: torch.Tensor, s: torch.Tensor, dtype=torch.bfloat16,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """[N, K/2] packed + [N, K/32] e8m0 -> [N, K], into `out` if given. e2m1 values times power-of-two scales are
    exact in bf16. For bf16 on the CPU it looks up two bytes at a time (numpy's gather is ~5x torch's here)
    straight into the output, and scales in place."""
    n, half = packed.shape
    scale = from_e8m0(s)
    if not (dtype == torch.bfloat16 and packed.device.type == "cpu" and packed.is_contiguous() and half % 2 == 0
            and sys.byteorder == "little" and float(scale.max()) <= 2.0 ** 7):
        vals = fp4_decode(fp4_unpack(packed))
        w = (vals.view(n, -1, 32) * scale.unsqueeze(-1)).view(n, half * 2).to(dtype)
        return w if out is None else out.copy_(w)
    out = torch.empty(n, half * 2, dtype=dtype) if out is None else out
    idx = packed.detach().view(torch.uint8).numpy().view(np.uint16)
    scale = (scale * 2.0 ** 120).to(torch.bfloat16).unsqueeze(-1)
    step = _row_chunks(n, half * 2, target=1 << 17)        # the gather runs fastest on L2-sized chunks
    for i in range(0, n, step):
        np.take(_fp4_quad_table(), idx[i:i + step], out=out[i:i + step].view(torch.int64).numpy())
        out[i:i + step].view(-1, half * 2 // 32, 32).mul_(scale[i:i + step])
    return out


def fp4_to_fp8(packed: torch.Tensor, s32: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 [N, K/2] + [N, K/32] -> FP8 e4m3 [N, K] + power-of-two fp32 scales [N/block, K/block].

    Per 128x128 block S = max(s32 over the block) / 2^6 and w8 = fp4 * (s32 / S). Each factor s32/S is a
    power of two <= 2^6 and |fp4| <= 6, so |w8| <= 384 < 448: exact whenever s32/S >= 2^-6 (all products
    stay normal e4m3). A block whose scales span more than 12 octaves loses its smallest entries; the
    caller can check exactness by comparing dequantized results (tests do)."""
    n, k = packed.shape[0], packed.shape[1] * 2
    if n % block or k % block:
        raise ValueError(f"fp4_to_fp8: shape [{n}, {k}] must be a multiple of {block} in both dims")
    vals = fp4_decode(fp4_unpack(packed))                         # [N, K]
    s32 = from_e8m0(s32)                                          # [N, K/32]
    sblk = s32.view(n // block, block, k // block, block // 32).amax(dim=(1, 3))  # [N/128, K/128]
    S = sblk / 64.0
    ratio = s32 / S.repeat_interleave(block, 0).repeat_interleave(block // 32, 1)
    w8 = (vals * ratio.repeat_interleave(32, 1)).to(FP8)
    return w8, S


# ---------------------------------------------------------------------------------------------- QAT (straight-through)
def _ste(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Forward value y, gradient of identity w.r.t. x."""
    return x + (y.to(x.dtype) - x).detach()


_QDQ = Memo("QAT weight values")


class _StoredValue(torch.autograd.Function):
    """Forward: a value computed before (a view of it, so every caller shares one copy); backward: the gradient to
    w as it is, the straight-through rule of _ste."""

    @staticmethod
    def forward(ctx, w: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        return value.view_as(value)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return g, None


def _weight_qdq(w: torch.Tensor, fmt: tuple, dequantized) -> torch.Tensor:
    """_ste(w, dequantized(w)), the value computed once per weight while dsv4.stepmemo.weights_fixed() is open:
    the same bits (the value is _ste's own forward, w + (y - w) in w's dtype), the same gradient."""
    if not _QDQ.open:
        return _ste(w, dequantized(w.detach()))
    d = w.detach()
    value = _QDQ.get(weight_key(w, *fmt), lambda: d + (dequantized(d).to(d.dtype) - d))
    return _StoredValue.apply(w, value)


def fp8_act_qdq(x: torch.Tensor, block: int = 128, ue8m0: bool = True) -> torch.Tensor:
    """A last dim that is not a multiple of `block` is zero-padded (zeros do not change a block's amax)."""
    n = x.shape[-1]
    xp = torch.nn.functional.pad(x.detach(), (0, -n % block))
    q, s = act_quant(xp, block, ue8m0)
    return _ste(x, act_dequant(q, s, block)[..., :n])


def fp4_act_qdq(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    c, s = fp4_quant(x.detach(), block)
    return _ste(x, fp4_dequant(c, s, block))


def fp8_weight_qdq(w: torch.Tensor, block: int = 128, ue8m0: bool = True) -> torch.Tensor:
    return _weight_qdq(w, ("fp8", block, ue8m0),
                       lambda d: weight_dequant_fp8(*weight_quant_fp8(d, block, ue8m0), block, torch.float32))


def mxfp4_weight_qdq(w: torch.Tensor) -> torch.Tensor:
    return _weight_qdq(w, ("mxfp4", 32), lambda d: fp4_dequant(*fp4_quant(d, 32), 32))
