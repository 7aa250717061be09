"""TileLang lightning-indexer scores (DeepSeek-V4 CSA layers):

    I[b,t,c] = sum_h relu(q[b,t,h] . k[b,c]) * w[b,t,h]       fp32, -inf where c >= (t+1) // ratio

q[B,S,Hi,Di] (Hi = 64, Di = 128 in V4), k[B,N,Di] (one compressed entry per `ratio` tokens),
w[B,S,Hi] already scaled by Hi^-0.5 * Di^-0.5. Entry c is complete (visible) for query t only when
its whole block precedes t, hence the causal bound. Top-k over these scores is `indexer_topk`.
"""
# no `from __future__ import annotations`: TileLang evaluates the kernel signatures' annotations
import functools

import torch

BLOCK_N = 64          # compressed entries per CTA (the wgmma M)
BLOCK_T = 8           # queries per CTA, one GEMM each against the same K tile
HEAD_PAD = 16         # heads padded to a multiple of this (wgmma N); padded heads get weight 0


def indexer_program(heads: int, dim: int, ratio: int):
    """(Q[B,S,Hi,Di] bf16, K[B,N,Di] bf16, W[B,S,Hi] f32) -> Logits[B,S,N] f32; B, S, N dynamic."""
    import tilelang.language as T

    assert heads % HEAD_PAD == 0 and dim % 16 == 0
    B, S, N = T.dynamic("B"), T.dynamic("S"), T.dynamic("N")
    bf16, f32 = T.bfloat16, T.float32

    @T.prim_func
    def indexer_logits(Q: T.Tensor([B, S, heads, dim], bf16), K: T.Tensor([B, N, dim], bf16),
                       W: T.Tensor([B, S, heads], f32), Logits: T.Tensor([B, S, N], f32)):
        with T.Kernel(T.ceildiv(N, BLOCK_N), T.ceildiv(S, BLOCK_T), B, threads=128) as (bn, bt, b):
            k_sh = T.alloc_shared([BLOCK_N, dim], bf16)
            q_sh = T.alloc_shared([heads, dim], bf16)
            acc = T.alloc_fragment([BLOCK_N, heads], f32)
            out = T.alloc_fragment([BLOCK_N], f32)
            for c, d in T.Parallel(BLOCK_N, dim):
                k_sh[c, d] = T.if_then_else(bn * BLOCK_N + c < N, K[b, bn * BLOCK_N + c, d], T.cast(0, bf16))
            for tt in T.serial(BLOCK_T):
                t = bt * BLOCK_T + tt
                if t < S:
                    if bn * BLOCK_N < (t + 1) // ratio:     # some entry of this tile is visible to t
                        for h, d in T.Parallel(heads, dim):
                            q_sh[h, d] = Q[b, t, h, d]
                        T.gemm(k_sh, q_sh, acc, transpose_B=True, clear_accum=True)
                        for c, h in T.Parallel(BLOCK_N, heads):
                            acc[c, h] = T.max(acc[c, h], 0) * W[b, t, h]
                        T.reduce_sum(acc, out, dim=1)
                        for c in T.Parallel(BLOCK_N):
                            if bn * BLOCK_N + c < N:
                                Logits[b, t, bn * BLOCK_N + c] = T.if_then_else(
                                    bn * BLOCK_N + c < (t + 1) // ratio, out[c], -T.infinity(f32))
                    else:
                        for c in T.Parallel(BLOCK_N):
                            if bn * BLOCK_N + c < N:
                                Logits[b, t, bn * BLOCK_N + c] = -T.infinity(f32)

    return indexer_logits


@functools.lru_cache(maxsize=None)
def _kernel(heads: int, dim: int, ratio: int):
    from . import tilelang_compile
    return tilelang_compile(indexer_program(heads, dim, ratio), [3])


def indexer_logits(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, ratio: int) -> torch.Tensor:
    """q[B,S,Hi,Di], k[B,N,Di], weights[B,S,Hi] (CUDA) -> fp32 [B,S,N] with -inf outside the causal bound."""
    B, S, Hi, Di = q.shape
    if k.shape[0] != B or k.shape[2] != Di or weights.shape != (B, S, Hi):
        raise ValueError(f"indexer_logits: shapes disagree: q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"weights {tuple(weights.shape)}")
    if Di % 16:
        raise ValueError(f"indexer_logits: head dim {Di} must be a multiple of 16")
    Hp = -(-Hi // HEAD_PAD) * HEAD_PAD
    qp = torch.nn.functional.pad(q.to(torch.bfloat16), (0, 0, 0, Hp - Hi)).contiguous()
    wp = torch.nn.functional.pad(weights.float(), (0, Hp - Hi)).contiguous()
    return _kernel(Hp, Di, ratio)(qp, k.to(torch.bfloat16).contiguous(), wp)
