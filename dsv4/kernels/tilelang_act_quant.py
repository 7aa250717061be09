"""TileLang FP8 activation quantization (DeepSeek `act_quant`): per row, per contiguous block of
`block_size` elements along the last dim (128 for GEMM inputs, 64 for the KV QAT):

    amax = max(|x_blk|) clamped to >= 1e-4;  s = amax / 448  (ue8m0: the power of two at or above it)
    q    = e4m3(clamp(x / s, -448, 448))     (round to nearest even)

The ue8m0 rounding uses the exponent bits (exponent + (mantissa != 0)), not ceil(log2(.)), which can
round the wrong way just above a power of two. Matches dsv4.quant.act_quant bit for bit.
"""
# no `from __future__ import annotations`: TileLang evaluates the kernel signatures' annotations
import functools

import torch

FP8_MAX = 448.0
ROWS = 32            # rows a CTA quantizes per block column


def act_quant_program(dim: int, block_size: int, ue8m0: bool, in_dtype: str):
    """(X[M, dim] in_dtype) -> (Q[M, dim] e4m3, S[M, dim/block] f32); M is dynamic."""
    import tilelang.language as T

    assert dim % block_size == 0, f"dim={dim} is not a multiple of block_size={block_size}"
    M = T.dynamic("M")
    nb = dim // block_size

    @T.prim_func
    def act_quant(X: T.Tensor([M, dim], in_dtype), Q: T.Tensor([M, dim], T.float8_e4m3fn),
                  Sc: T.Tensor([M, nb], T.float32)):
        with T.Kernel(T.ceildiv(M, ROWS), nb, threads=128) as (bm, bk):
            x = T.alloc_fragment([ROWS, block_size], T.float32)
            amax = T.alloc_fragment([ROWS], T.float32)
            scale = T.alloc_fragment([ROWS], T.float32)
            for i, j in T.Parallel(ROWS, block_size):
                x[i, j] = T.if_then_else(bm * ROWS + i < M, T.cast(X[bm * ROWS + i, bk * block_size + j], T.float32), 0)
            T.reduce_absmax(x, amax, dim=1)
            for i in T.Parallel(ROWS):
                scale[i] = T.max(amax[i], 1e-4) / FP8_MAX
                if ue8m0:
                    bits = T.reinterpret(scale[i], T.uint32)
                    scale[i] = T.reinterpret(((bits >> 23) + T.Cast(T.uint32, (bits & 0x7FFFFF) != 0)) << 23, T.float32)
                if bm * ROWS + i < M:
                    Sc[bm * ROWS + i, bk] = scale[i]
            for i, j in T.Parallel(ROWS, block_size):
                if bm * ROWS + i < M:
                    Q[bm * ROWS + i, bk * block_size + j] = T.cast(T.clamp(x[i, j] / scale[i], -FP8_MAX, FP8_MAX), T.float8_e4m3fn)

    return act_quant


@functools.lru_cache(maxsize=None)
def _kernel(dim: int, block_size: int, ue8m0: bool, in_dtype: str):
    from . import tilelang_compile
    return tilelang_compile(act_quant_program(dim, block_size, ue8m0, in_dtype), [1, 2])


def act_quant(x: torch.Tensor, block_size: int = 128, scale_fmt: str | None = None):
    """x[..., D] bf16/fp32 on CUDA -> (q float8_e4m3fn [..., D], scales fp32 [..., D/block_size])."""
    if x.shape[-1] % block_size:
        raise ValueError(f"act_quant: last dim {x.shape[-1]} is not a multiple of block_size {block_size}")
    if x.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"act_quant: x must be bf16 or fp32, got {x.dtype}")
    lead, D = x.shape[:-1], x.shape[-1]
    in_dtype = "bfloat16" if x.dtype == torch.bfloat16 else "float32"
    q, s = _kernel(D, block_size, scale_fmt == "ue8m0", in_dtype)(x.reshape(-1, D).contiguous())
    return q.view(*lead, D), s.view(*lead, D // block_size)
