"""TileLang sparse MQA attention with an attention sink (DeepSeek-V4), forward and backward.

One KV latent row (D = 512 in V4) is both key and value for every head; each query token t attends to
the K rows `kv[b, topk_idxs[b, t, :]]` (-1 = padding). Per head h, with s_j = scale * <q_h, kv_j>:

    o_h   = sum_j exp(s_j - M) kv_j / (sum_j exp(s_j - M) + exp(sink_h - M)),   M = max(max_j s_j, sink_h)
    lse_h = log(sum_j exp(s_j) + exp(sink_h))        (natural log, sink included)

Kernels work in base 2 (exp2/log2, scores pre-multiplied by log2 e): `lse2 = lse / ln 2`.
Padded slots (-1, or any index outside [0, N)) are masked at the LOAD (their shared-memory rows are
zero-filled, by predicated cp.async in the forward and by TMA's out-of-bounds fill in the backward, so KV
is never read out of bounds) and at the score (-inf). A row whose slots are all padding gives o = 0,
finite lse (= sink) and zero gradients.

Backward (per query, per head block; K = V = kv so dkv gets both contributions):
    P   = exp2(s2 - lse2)                  s2 = scale*log2e*<q,kv_j>, P = 0 on padding
    dS  = P * (dO.kv_j - Delta) * scale     Delta = sum_d o*dO
    dq  = dS @ kv ;  dkv[idx_j] += dS^T q + P^T dO  (fp32 atomics)
    dsink_h = -sum_{b,t} Delta * exp2(sink_h*log2e - lse2)

Pass configs live in FWD_PASS_CONFIGS / BWD_PASS_CONFIGS and every build takes them as an argument,
so `dsv4.kernels.bisect` can compile the same kernel under other settings.
"""
# no `from __future__ import annotations`: TileLang evaluates the kernel signatures' annotations, closures included

import functools
import math

import torch

LOG2E = 1.4426950408889634
HEAD_BLOCK = 64          # heads per CTA: the wgmma M dimension
FWD_BLOCK = 64           # KV rows per pipeline stage in the forward
BWD_BLOCK = 64           # KV rows per step in the backward: the dkv GEMMs' M (wgmma needs 64)
BWD_DKV_COLS = 128       # dkv columns computed and added at a time (registers next to dq's 64 x D/2)
TOPK_MULTIPLE = 2 * FWD_BLOCK   # the forward consumes stages in pairs, the backward P/dS buffers
H200_SMS = 132                  # the persistent forward's grid where no GPU says otherwise (lowering on a CPU machine)

# TileLang pass configs, keyed by their string names so they mean the same thing across tilelang
# versions. The backward must never run with aggressive shared-memory merge: on tilelang 0.1.9-0.1.10
# it aliases a loop-carried buffer (tile-ai/tilelang#2199) and the gradients come out NaN.
# The forward places its own barriers: TileLang's automatic partial syncs gave the producer warpgroup and a consumer
# the same named-barrier id (3), and the two then release each other's bar.sync (a hang). Its gather issues cp.async by
# address (CP_ASYNC16), each copy zero-filling a padded row; TileLang's safe-memory pass would wrap every copy in a
# bounds check on the row index and skip the padded rows' copies, leaving stale shared memory where the zeros belong.
FWD_PASS_CONFIGS: dict[str, object] = {"tl.disable_thread_storage_sync": True, "tl.disable_safe_memory_legalize": True}
WG0_BAR, WG1_BAR, PAIR_BAR = 1, 2, 3   # named barriers (bar.sync id): warpgroup 0, warpgroup 1, both (256 threads)
# setmaxnreg of warpgroups 0, 1 and the producer: at most 504 for 384 threads. Warpgroup 1 (which applies P0 before its
# own softmax) runs faster with more: 1.2-2.0 % less time at V4-Flash with (200, 200, 104) than (208, 192, 104), and
# (200, 208, 96) with the evict-first Q and O below 2.2-3.0 %; with 184 for either consumer ptxas spills.
FWD_REGS = (200, 208, 96)
# CUDA prepended to the forward: 16 bytes global -> shared by cp.async, zero-filled when `pred` is false (src-size 0).
CP_ASYNC16 = r"""
__device__ __forceinline__ void v4_cp_async16(void* smem, const void* gmem, bool pred) {
  unsigned s = (unsigned)__cvta_generic_to_shared(smem);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(s), "l"(gmem), "r"(pred ? 16 : 0) : "memory");
}
"""
# CUDA prepended to both kernels. TileLang builds without --use_fast_math, so T.exp2 is CUDA's exp2f: the MUFU.EX2 that
# v4_ex2 issues, behind a range check and two predicated multiplies that keep results below 2^-126 subnormal (~6
# instructions an exponential in the forward's softmax instead of an FFMA and the MUFU). Flushing those to zero changes
# nothing a softmax can see: in the forward each term is divided by a row sum >= 1 (the term that set the running max
# is exp2(0)), in the backward each P is a probability. Same MUFU, so normal-range results are bit for bit CUDA's.
FAST_EX2 = r"""
__device__ __forceinline__ float v4_ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
"""
# Row max and row sum of a 64 x N wgmma accumulator (one warpgroup; N = FWD_BLOCK), in the register layout TileLang
# gives it (DKV_RED4 reads the same layout): a thread holds rows r and r + 8 (h = 0, 1), its elements of row h at acc[4j + 2h]
# and acc[4j + 2h + 1], j < N / 8, and the quad's 4 lanes hold the row between them; `out` is a [64] fragment, 2 a thread.
# A tree, where T.reduce_max / T.reduce_sum emit a chain of N / 4 dependent instructions: the softmax runs on one warp
# a scheduler, so each link of a chain costs its full latency.
ROW_REDUCE = r"""
template <int W, bool MAX>
__device__ __forceinline__ void v4_tree(float* t) {    // t[k] (op)= t[k + W], then W / 2, ...: t[0] holds the result
  if constexpr (W >= 1) {
    #pragma unroll
    for (int k = 0; k < W; ++k) t[k] = MAX ? fmaxf(t[k], t[k + W]) : t[k] + t[k + W];
    v4_tree<W / 2, MAX>(t);
  }
}

template <int N, bool MAX>
__device__ __forceinline__ void v4_row_reduce(const float* acc, float* out) {
  #pragma unroll
  for (int h = 0; h < 2; ++h) {
    float t[N / 4];
    #pragma unroll
    for (int j = 0; j < N / 8; ++j) {
      t[2 * j] = acc[4 * j + 2 * h];
      t[2 * j + 1] = acc[4 * j + 2 * h + 1];
    }
    v4_tree<N / 8, MAX>(t);
    float x = t[0];
    #pragma unroll
    for (int lane = 1; lane <= 2; lane *= 2) {
      float y = __shfl_xor_sync(0xffffffffu, x, lane);
      x = MAX ? fmaxf(x, y) : x + y;
    }
    out[h] = MAX ? fmaxf(out[h], x) : x;       // max: folded into the running max; sum: the block's row sum
  }
}
"""
# The backward is warp-specialized by hand and synchronizes with mbarriers (TileLang's own warp
# specialization and storage-sync passes off), and its global accesses are in bounds by construction
# (grid = S x B; an index is checked before it addresses dKV; TMA fills out-of-range rows), so the bounds
# checks TileLang's safe-memory pass would add are switched off (they put a branch and a recomputed
# address in front of every atomic).
BWD_PASS_CONFIGS: dict[str, object] = {
    "tl.enable_aggressive_shared_memory_merge": False,
    "tl.disable_warp_specialized": True,
    "tl.disable_thread_storage_sync": True,
    "tl.disable_safe_memory_legalize": True,
}


def valid(idx, N):
    """A top-k slot that names a row of KV (as a TileLang expression): -1 and anything >= N are padding."""
    return (idx >= 0) & (idx < N)


def ex2(x):
    """2^x as one MUFU.EX2 (see FAST_EX2), as a TileLang expression."""
    import tilelang.language as T
    return T.call_extern("float32", "v4_ex2", x)


def _frozen(cfg: dict | None) -> tuple:
    return tuple(sorted((cfg or {}).items()))


# --------------------------------------------------------------------------------------------------
# Kernel programs
# --------------------------------------------------------------------------------------------------

def fwd_program(heads: int, dim: int, topk: int, sm_scale: float, num_ctas: int = H200_SMS):
    """Forward PrimFunc: (Q[B,S,H,D] bf16, KV[B,N,D] bf16, Idx[B,S,topk] i32, Sink[H] f32)
    -> (O[B,S,H,D] bf16, Lse2[B,S,H] f32). B, S, N are dynamic.

    The schedule of FlashMLA's sm90 sparse prefill kernel, persistent. `num_ctas` CTAs (one an SM) take the (batch,
    query, 64-head block) items in turn. 384 threads: warpgroups 0 and 1 score alternate 64-row blocks of an item over
    all of D (block 2j in buffer 0 by warpgroup 0, 2j + 1 in buffer 1 by warpgroup 1), so one's score GEMMs run while
    the other runs its softmax; the running max passes 0 -> 1 -> 0 through shared memory. Warpgroup 0 owns O[:, :D/2],
    warpgroup 1 O[:, D/2:]: each applies its own block's P from registers (wgmma RS) to its half of that block's V and
    the other's P from shared memory to its half of the other block. Warpgroup 0 hands its P over at its own block's
    max; warpgroup 1 applies it at once, before its own softmax, and both then move to the pair's max. Each buffer is
    two D-halves with their own ready/free mbarriers; warpgroup 2 refills the halves in the order they free up, 8
    threads a 128-byte row segment, with the pair's row indices in registers (loaded a pair ahead) and without waiting
    for its own copies (cp.async.mbarrier.arrive.noinc). An item's O leaves through the halves its warpgroup read last
    (V1_l, V0_r); the next item's Q is loaded first, as soon as both last score GEMMs have read Q."""
    import tilelang.language as T

    assert heads % HEAD_BLOCK == 0, f"heads={heads} must be a multiple of {HEAD_BLOCK} (pad on the host)"
    assert dim % 128 == 0, f"dim={dim} must be a multiple of 128"
    assert topk % TOPK_MULTIPLE == 0, f"topk={topk} must be a multiple of {TOPK_MULTIPLE} (pad with -1)"
    B, S, N = T.dynamic("B"), T.dynamic("S"), T.dynamic("N")
    HB, BI, D2 = HEAD_BLOCK, FWD_BLOCK, dim // 2
    rep = heads // HB
    n_pairs = topk // BI // 2
    scale2 = sm_scale * LOG2E
    bf16, f32 = T.bfloat16, T.float32
    neg_big = -(2.0 ** 30)      # finite "no score yet": keeps (m_prev - m) free of inf - inf
    R0, R1, RP = FWD_REGS

    @T.macro
    def coords(item, c):
        # (batch, query, first head) of an item, computed once into registers: left as expressions, TileLang
        # inlined their 64-bit divisions into every address of the gather, which then took twice as long
        c[0] = item // (S * rep)
        c[1] = item // rep % S            # the `rep` head blocks of a query are neighbours: L2 reuse
        c[2] = item % rep * HB

    @T.macro
    def load_q(Q, b, s, h0, q_l, q_r, bar_q):
        # one thread issues 64-column boxes (Q copied by the producer's threads cost 1.5-4 % more). Q and O are read
        # or written once: evict-first keeps L2 for the KV rows every query gathers from (0.3-0.9 % less time)
        for c in T.unroll(D2 // 64):
            T.tma_copy(Q[b, s, h0:h0 + HB, c * 64:c * 64 + 64], q_l[:, c * 64:c * 64 + 64], barrier=bar_q,
                       leader_scope_threads=128, eviction_policy="evict_first")
            T.tma_copy(Q[b, s, h0:h0 + HB, D2 + c * 64:D2 + c * 64 + 64], q_r[:, c * 64:c * 64 + 64], barrier=bar_q,
                       leader_scope_threads=128, eviction_policy="evict_first")
        T.barrier_arrive(bar_q)

    @T.macro
    def half(KV, rows, N, b, dst, c0, free, ready, ph, g, t8):
        # warpgroup 2 refills one D-half of a buffer: group g (8 threads, 16 B each of a 64-column tile) copies rows
        # g, g + 16, g + 32, g + 48. Padded rows are zero-filled (src-size 0), never read (KV[-1] is out of bounds,
        # and stale shared memory may hold NaN bit patterns that 0 * NaN would spread through P @ V). With a warp a
        # row (512 B) and the row indices read from Idx at each copy, the kernel took 0.85-0.91 ms at V4-Flash.
        T.barrier_wait(free, ph ^ 1)
        for k in T.unroll(4):
            for t in T.unroll(D2 // 64):
                T.call_extern("handle", "v4_cp_async16", T.address_of(dst[g + 16 * k, t * 64 + t8 * 8]),
                              T.address_of(KV[b, T.max(rows[k], 0), c0 + t * 64 + t8 * 8]), valid(rows[k], N))
        T.cp_async_barrier_noinc(ready)

    @T.macro
    def put_mask(Idx, N, b, s, i, mask, mfull):
        # 0 / -inf a slot, beside the buffer: the scoring warpgroup starts its scores from it
        for j in T.Parallel(BI):
            mask[j] = T.if_then_else(valid(Idx[b, s, i * BI + j], N), 0, -T.infinity(f32))
        T.barrier_arrive(mfull)

    @T.macro
    def softmax(acc_s, m, l_blk):
        # fold the block's row max into m (base-2 exponent = score * scale2), P = exp2(s - m) in place, its row sums
        T.call_extern("handle", f"v4_row_reduce<{BI}, true>", acc_s.data, m.data)
        for h, c in T.Parallel(HB, BI):
            acc_s[h, c] = ex2(acc_s[h, c] * scale2 - m[h] * scale2)
        T.call_extern("handle", f"v4_row_reduce<{BI}, false>", acc_s.data, l_blk.data)

    @T.macro
    def finish(acc_o, m, m_fin, f, l, l_other, Sink, h0):
        # fold in the sink (M = max(m, sink) keeps rows with no valid slot finite) and normalise
        for h in T.Parallel(HB):
            m_fin[h] = T.max(m[h] * scale2, Sink[h0 + h] * LOG2E)               # final max, base 2
            f[h] = T.exp2(m[h] * scale2 - m_fin[h])
            l[h] = (l[h] + l_other[h]) * f[h] + T.exp2(Sink[h0 + h] * LOG2E - m_fin[h])
            # l == 0 only if no slot and sink = -inf; `!= 0`, not `> 0`: a NaN sum must reach O, not turn it into 0
            f[h] = T.if_then_else(l[h] != 0, f[h] / l[h], 0)
        for h, d in T.Parallel(HB, D2):
            acc_o[h, d] *= f[h]

    @T.macro
    def store_o(acc_o, o_sh, O, b, s, h0, c0, bar_id):
        T.copy(acc_o, o_sh)
        T.fence_proxy_async()
        T.sync_threads(bar_id, 128)
        # TMA store; its issuing thread waits until it has read o_sh
        T.copy(o_sh, O[b, s, h0:h0 + HB, c0:c0 + D2], eviction_policy="evict_first")

    def consumer_fragments():
        # a consumer warpgroup's scores, P, half of O, and per-row max, previous max, factor, sum, block sum
        return (T.alloc_fragment([HB, BI], f32), T.alloc_fragment([HB, BI], bf16), T.alloc_fragment([HB, D2], f32),
                *(T.alloc_fragment([HB], f32) for _ in range(5)))

    @T.prim_func
    def sparse_attn_fwd(
        Q: T.Tensor([B, S, heads, dim], bf16),
        KV: T.Tensor([B, N, dim], bf16),
        Idx: T.Tensor([B, S, topk], T.int32),
        Sink: T.Tensor([heads], f32),
        O: T.Tensor([B, S, heads, dim], bf16),
        Lse: T.Tensor([B, S, heads], f32),
    ):
        with T.Kernel(num_ctas, threads=384, prelude=FAST_EX2 + ROW_REDUCE + CP_ASYNC16) as cta:
            q_l = T.alloc_shared([HB, D2], bf16)
            q_r = T.alloc_shared([HB, D2], bf16)
            k0_l = T.alloc_shared([BI, D2], bf16)
            k0_r = T.alloc_shared([BI, D2], bf16)
            k1_l = T.alloc_shared([BI, D2], bf16)
            k1_r = T.alloc_shared([BI, D2], bf16)
            p0_sh = T.alloc_shared([HB, BI], bf16)
            p1_sh = T.alloc_shared([HB, BI], bf16)
            m_sh = T.alloc_shared([HB], f32)
            l_sh0 = T.alloc_shared([HB], f32)
            l_sh1 = T.alloc_shared([HB], f32)
            mask0 = T.alloc_shared([BI], f32)
            mask1 = T.alloc_shared([BI], f32)

            # each warpgroup its own fragments: given one set, TileLang dropped the second warpgroup's statements
            acc_s0, p0, acc_o0, m0, mo0, f0, l0, lb0 = consumer_fragments()
            acc_s1, p1, acc_o1, m1, mo1, f1, l1, lb1 = consumer_fragments()
            crd = T.alloc_local([3], T.int32)             # this item's (b, s, h0)
            rows0 = T.alloc_local([4], T.int32)           # the producer's rows of the next pair's two blocks
            rows1 = T.alloc_local([4], T.int32)
            cur0 = T.alloc_local([4], T.int32)            # and of this pair's
            cur1 = T.alloc_local([4], T.int32)

            bar_q = T.alloc_barrier(arrive_count=128)
            q_free = T.alloc_barrier(arrive_count=256)    # both last score GEMMs of an item have read Q
            r0l = T.alloc_barrier(arrive_count=128)       # a half landed: the producer's threads' copies (noinc)
            r0r = T.alloc_barrier(arrive_count=128)
            r1l = T.alloc_barrier(arrive_count=128)
            r1r = T.alloc_barrier(arrive_count=128)
            fr0l = T.alloc_barrier(arrive_count=128)      # a half's last reader is done with it
            fr0r = T.alloc_barrier(arrive_count=128)
            fr1l = T.alloc_barrier(arrive_count=128)
            fr1r = T.alloc_barrier(arrive_count=128)
            mf0 = T.alloc_barrier(arrive_count=128)       # a buffer's mask is written
            mf1 = T.alloc_barrier(arrive_count=128)
            max0 = T.alloc_barrier(arrive_count=128)      # warpgroup 0's max and P are in m_sh, p0_sh
            max1 = T.alloc_barrier(arrive_count=128)      # warpgroup 1's (the pair's max) and P are in m_sh, p1_sh
            p0_free = T.alloc_barrier(arrive_count=128)   # warpgroup 1 is done with p0_sh

            tx = T.get_thread_binding()
            n_mine = (B * S * rep - cta + num_ctas - 1) // num_ctas     # items cta, cta + num_ctas, ...
            # Every barrier but bar_q and q_free completes once a pair: its phase is the CTA's pair count & 1.

            # setmaxnreg only moves registers inside the CTA's launch allocation (168 x 384): the three
            # warpgroups' targets must sum to at most 504 a thread, or an increase waits forever.
            if tx >= 256:                                     # producer
                T.set_max_nreg(RP, 0)
                g, t8 = (tx - 256) // 8, tx % 8
                for it in T.serial(n_mine):
                    coords(cta + it * num_ctas, crd)
                    b, s = crd[0], crd[1]
                    for k in T.unroll(4):
                        rows0[k] = Idx[b, s, g + 16 * k]
                        rows1[k] = Idx[b, s, BI + g + 16 * k]
                    # Q first, once both last score GEMMs of the item before have read it (before V0_l frees):
                    # loaded behind this item's first halves it arrived late (1.2 % slower at V4-Flash)
                    if it > 0:
                        T.barrier_wait(q_free, (it - 1) & 1)
                    load_q(Q, b, s, crd[2], q_l, q_r, bar_q)
                    for j in T.serial(n_pairs):
                        ph = (it * n_pairs + j) & 1
                        for k in T.unroll(4):
                            cur0[k] = rows0[k]
                            cur1[k] = rows1[k]
                        # block 2j -> buffer 0, 2j + 1 -> buffer 1, the halves in the order they free up
                        half(KV, cur0, N, b, k0_l, 0, fr0l, r0l, ph, g, t8)
                        put_mask(Idx, N, b, s, 2 * j, mask0, mf0)
                        half(KV, cur1, N, b, k1_r, D2, fr1r, r1r, ph, g, t8)
                        put_mask(Idx, N, b, s, 2 * j + 1, mask1, mf1)
                        if j + 1 < n_pairs:
                            for k in T.unroll(4):
                                rows0[k] = Idx[b, s, (2 * j + 2) * BI + g + 16 * k]
                                rows1[k] = Idx[b, s, (2 * j + 3) * BI + g + 16 * k]
                        half(KV, cur0, N, b, k0_r, D2, fr0r, r0r, ph, g, t8)
                        half(KV, cur1, N, b, k1_l, 0, fr1l, r1l, ph, g, t8)
            elif tx < 128:                                    # warpgroup 0: even blocks, O[:, :D/2]
                T.set_max_nreg(R0, 1)
                for it in T.serial(n_mine):
                    coords(cta + it * num_ctas, crd)
                    T.fill(m0, neg_big)
                    T.fill(l0, 0)
                    T.fill(acc_o0, 0)
                    T.barrier_wait(bar_q, it & 1)
                    for j in T.serial(n_pairs):
                        ph = (it * n_pairs + j) & 1
                        T.barrier_wait(mf0, ph)
                        for h, c in T.Parallel(HB, BI):
                            acc_s0[h, c] = mask0[c]               # 0 or -inf: padding masked before the scores land
                        T.barrier_wait(r0l, ph)
                        T.wgmma_gemm(q_l, k0_l, acc_s0, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                        if j > 0:
                            T.wait_wgmma(1)                       # the last pair's O += P1 @ V1_l: V1_l is free
                            T.barrier_arrive(fr1l)
                        T.barrier_wait(r0r, ph)
                        T.wgmma_gemm(q_r, k0_r, acc_s0, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                        T.wait_wgmma(0)
                        if j == n_pairs - 1:
                            T.barrier_arrive(q_free)
                        T.copy(m0, mo0)
                        softmax(acc_s0, m0, lb0)
                        for h in T.Parallel(HB):
                            f0[h] = ex2((mo0[h] - m0[h]) * scale2)
                            l0[h] = l0[h] * f0[h] + lb0[h]
                        T.copy(acc_s0, p0)
                        # P0 at this block's max goes out at once: warpgroup 1 applies it to V0_r before its own
                        # softmax and frees V0_r early (in FlashMLA's order it frees last, with 10 % of the time)
                        if it * n_pairs + j > 0:
                            T.barrier_wait(p0_free, ph ^ 1)
                        T.copy(p0, p0_sh)
                        T.copy(m0, m_sh)
                        T.fence_proxy_async()                 # p0_sh is read by wgmma (async proxy)
                        T.barrier_arrive(max0)
                        for h, d in T.Parallel(HB, D2):
                            acc_o0[h, d] *= f0[h]
                        T.wgmma_gemm(p0, k0_l, acc_o0, policy=T.GemmWarpPolicy.FullRow)
                        T.wait_wgmma(0)
                        T.barrier_arrive(fr0l)
                        T.barrier_wait(max1, ph)              # the pair's max and P1, from warpgroup 1
                        for h in T.Parallel(HB):
                            mo0[h] = m_sh[h]
                            f0[h] = ex2((m0[h] - mo0[h]) * scale2)
                            m0[h] = mo0[h]
                            l0[h] = l0[h] * f0[h]
                        for h, d in T.Parallel(HB, D2):
                            acc_o0[h, d] *= f0[h]
                        T.wgmma_gemm(p1_sh, k1_l, acc_o0, policy=T.GemmWarpPolicy.FullRow)
                    T.wait_wgmma(0)
                    T.copy(l0, l_sh0)
                    T.sync_threads(PAIR_BAR, 256)
                    finish(acc_o0, m0, mo0, f0, l0, l_sh1, Sink, crd[2])
                    for h in T.Parallel(HB):
                        Lse[crd[0], crd[1], crd[2] + h] = T.if_then_else(l0[h] != 0, mo0[h] + T.log2(l0[h]), mo0[h])
                    # O leaves through V1_l (its last reader was this warpgroup's P1 @ V1_l), which is then refilled
                    store_o(acc_o0, k1_l, O, crd[0], crd[1], crd[2], 0, WG0_BAR)
                    T.barrier_arrive(fr1l)
            else:                                             # warpgroup 1: odd blocks, O[:, D/2:]
                T.set_max_nreg(R1, 1)
                for it in T.serial(n_mine):
                    coords(cta + it * num_ctas, crd)
                    T.fill(m1, neg_big)
                    T.fill(l1, 0)
                    T.fill(acc_o1, 0)
                    T.barrier_wait(bar_q, it & 1)
                    for j in T.serial(n_pairs):
                        ph = (it * n_pairs + j) & 1
                        T.barrier_wait(mf1, ph)
                        for h, c in T.Parallel(HB, BI):
                            acc_s1[h, c] = mask1[c]
                        T.barrier_wait(r1r, ph)
                        T.wgmma_gemm(q_r, k1_r, acc_s1, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                        T.barrier_wait(r1l, ph)
                        T.wgmma_gemm(q_l, k1_l, acc_s1, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                        T.wait_wgmma(0)
                        if j == n_pairs - 1:
                            T.barrier_arrive(q_free)
                        T.barrier_wait(max0, ph)              # warpgroup 0's max and P0
                        T.copy(m1, mo1)
                        for h in T.Parallel(HB):
                            m1[h] = m_sh[h]
                            f1[h] = ex2((mo1[h] - m1[h]) * scale2)
                            l1[h] = l1[h] * f1[h]
                        for h, d in T.Parallel(HB, D2):
                            acc_o1[h, d] *= f1[h]
                        T.wgmma_gemm(p0_sh, k0_r, acc_o1, policy=T.GemmWarpPolicy.FullRow)
                        T.copy(m1, mo1)
                        softmax(acc_s1, m1, lb1)
                        T.copy(acc_s1, p1)
                        T.copy(p1, p1_sh)
                        T.copy(m1, m_sh)
                        T.fence_proxy_async()
                        T.barrier_arrive(max1)
                        for h in T.Parallel(HB):
                            f1[h] = ex2((mo1[h] - m1[h]) * scale2)
                        T.wait_wgmma(0)                       # O1 += P0 @ V0_r is done
                        if j < n_pairs - 1:                   # (an item's last V0_r frees once O has left through it)
                            T.barrier_arrive(fr0r)
                        T.barrier_arrive(p0_free)
                        for h in T.Parallel(HB):
                            l1[h] = l1[h] * f1[h] + lb1[h]
                        for h, d in T.Parallel(HB, D2):
                            acc_o1[h, d] *= f1[h]
                        T.wgmma_gemm(p1, k1_r, acc_o1, policy=T.GemmWarpPolicy.FullRow)
                        T.wait_wgmma(0)
                        T.barrier_arrive(fr1r)
                    T.copy(l1, l_sh1)
                    T.sync_threads(PAIR_BAR, 256)
                    finish(acc_o1, m1, mo1, f1, l1, l_sh0, Sink, crd[2])
                    store_o(acc_o1, k0_r, O, crd[0], crd[1], crd[2], D2, WG1_BAR)
                    T.barrier_arrive(fr0r)
    return sparse_attn_fwd


# The backward's dkv atomics, 16 bytes a lane (CUDA, prepended to the kernel's source). A wgmma accumulator
# (64 rows over 4 warps) gives lane q of a quad columns 8j + 2q and 8j + 2q + 1 of rows r and r + 8, at
# acc[4j + 2h], acc[4j + 2h + 1] (h = 0 for r, 1 for r + 8), r = 16 * warp + lane / 4. Lanes q and q ^ 1 swap
# one pair, so that even lanes hold four consecutive columns of each even j and odd lanes of each odd j: one `red.v4` where there were two
# `red.v2` (the backward ran 12-14 % faster: 2.93-3.02 ms against 3.36-3.44 at V4-Flash, interleaved on the H200).
# Rows whose index is padding (< 0 or >= n) are skipped; both lanes of a pair always shuffle.
DKV_RED4 = r"""
template <int NC>
__device__ __forceinline__ void v4_dkv_red4(const float* acc, float* dkv, const int* idx, int n, int row_stride,
                                            int col0) {
  const int q = threadIdx.x & 3;
  const bool odd = q & 1;
  const int r = (threadIdx.x & 127) / 32 * 16 + (threadIdx.x & 31) / 4;
  const int idx0 = idx[r], idx1 = idx[r + 8];
  float* dst0 = dkv + (long long)idx0 * row_stride + col0;
  float* dst1 = dkv + (long long)idx1 * row_stride + col0;
  const bool ok0 = (unsigned)idx0 < (unsigned)n, ok1 = (unsigned)idx1 < (unsigned)n;
  #pragma unroll
  for (int j = 0; j < NC / 8; j += 2) {
    #pragma unroll
    for (int h = 0; h < 2; ++h) {
      float a0 = acc[4 * j + 2 * h], a1 = acc[4 * j + 2 * h + 1];          // columns 8j + 2q, +1
      float b0 = acc[4 * j + 4 + 2 * h], b1 = acc[4 * j + 4 + 2 * h + 1];  // columns 8(j+1) + 2q, +1
      float r0 = __shfl_xor_sync(0xffffffffu, odd ? a0 : b0, 1);
      float r1 = __shfl_xor_sync(0xffffffffu, odd ? a1 : b1, 1);
      float x0 = odd ? r0 : a0, x1 = odd ? r1 : a1, x2 = odd ? b0 : r0, x3 = odd ? b1 : r1;
      int col = odd ? 8 * (j + 1) + 2 * (q - 1) : 8 * j + 2 * q;
      float* d = (h ? dst1 : dst0) + col;
      if (h ? ok1 : ok0)
        asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};"
                     :: "l"(d), "f"(x0), "f"(x1), "f"(x2), "f"(x3) : "memory");
    }
  }
}
"""


def bwd_program(heads: int, dim: int, topk: int, sm_scale: float):
    """Backward PrimFunc: (Q, KV, O, dO, Idx, Lse2[B,S,H] f32, Sink[H] f32; dKV[B,N,D] f32 and dSink[H] f32
    accumulated in place) -> dQ[B,S,H,D] bf16. One CTA per (query, 64-head block), 256 threads, BWD_BLOCK
    KV rows a step.

    Warp-specialized: warpgroup 0 computes S, P, dP and dS (n64 GEMMs) and dq[:, :D/2]; warpgroup 1
    computes dq[:, D/2:] and dkv, and issues every dkv atomic. P and dS pass through two shared-memory
    buffers, so warpgroup 0 scores block i+1 while warpgroup 1 still adds block i's dkv: the fp32 atomics
    (5.4 GB into L2 at V4-Flash; without them the kernel ran in 1.97 ms, with them in 3.5-3.6 when both
    warpgroups did every step together) now overlap the tensor work (3.34-3.40 ms against 3.51-3.57, both
    with 8-byte atomics). dkv rows are added straight from the accumulator registers, 16 bytes a lane
    (DKV_RED4; 2.93-3.02 ms), BWD_DKV_COLS columns at a time (a block's whole dkv would not fit beside dq).
    Warpgroup 0 issues the S and dP GEMMs interleaved in 64-column K chunks: as two whole GEMMs ptxas kept
    every wgmma descriptor of the first for the second and spilled 660 bytes (this way 236 remain).

    KV rows arrive by TMA, one 64-column box each, each warp's leader 8 rows: an index of -1 (or >= N) lies
    outside the tensor map, so TMA writes zeros and still counts the box's bytes toward the barrier. Block
    i+1 is fetched (by both warpgroups, half the rows each) once both dq GEMMs have read block i.
    The CTA starts with Q and dO by TMA, O into registers (dim/128 fragments of 64 x 128) and block 0's
    rows, all at once; Delta = rowsum(O * dO) in fp32 follows while block 0 lands (a separate fp32 pass over
    O and dO once cost a quarter of the backward's time), and each CTA adds its share of dsink
    (-Delta * exp2(sink - lse2), 64 fp32 atomics). dQ leaves through q_sh as one TMA store."""
    import tilelang.language as T

    assert heads % HEAD_BLOCK == 0 and dim % BWD_DKV_COLS == 0 and topk % (2 * BWD_BLOCK) == 0
    assert BWD_DKV_COLS % 64 == 0 and BWD_BLOCK % 8 == 0 and dim % 128 == 0
    B, S, N = T.dynamic("B"), T.dynamic("S"), T.dynamic("N")
    HB, BS, DC = HEAD_BLOCK, BWD_BLOCK, BWD_DKV_COLS
    D2 = dim // 2
    n_dc = dim // DC
    n_blk = topk // BS
    assert n_dc <= 4, f"dim={dim}: O is held in registers for Delta as at most 4 chunks of {DC} columns"
    rep = heads // HB
    scale2 = sm_scale * LOG2E
    bf16, f32 = T.bfloat16, T.float32

    @T.macro
    def fetch(KV, Idx, b, s, i, kv_sh, kv_full, tx, first_row):
        # a warpgroup's half of block i (rows first_row ... first_row + BS/2) into kv_sh: each warp's leader
        # BS/8 rows, dim/64 boxes a row
        for jj in T.serial(BS // 8):
            for c in T.unroll(dim // 64):
                T.tma_copy(KV[b, Idx[b, s, i * BS + first_row + (tx // 32 % 4) * (BS // 8) + jj], c * 64:(c + 1) * 64],
                           kv_sh[first_row + (tx // 32 % 4) * (BS // 8) + jj, c * 64:(c + 1) * 64], barrier=kv_full,
                           leader_scope_threads=32)
        T.barrier_arrive(kv_full)

    @T.macro
    def delta_part(od, o_c, do_sh, c):
        for h, d in T.Parallel(HB, DC):
            od[h, d] += T.cast(o_c[h, d], f32) * T.cast(do_sh[h, c * DC + d], f32)

    @T.macro
    def scores(KV, Idx, N, b, s, i, tx, q_sh, do_sh, kv_sh, lse_sh, delta_sh, acc_p, acc_dp, ds_loc, acc_dq_l,
               p_b, ds_b, pds_full, pds_empty, ph, kv_full, kv_empty):
        # warpgroup 0, block i: S and dP (interleaved K chunks: see the docstring), P, dS, dq[:, :D/2]
        T.barrier_wait(kv_full, i & 1)
        T.clear(acc_p)
        T.clear(acc_dp)
        for kc in T.unroll(dim // 64):
            T.wgmma_gemm(q_sh[:, kc * 64:(kc + 1) * 64], kv_sh[:, kc * 64:(kc + 1) * 64], acc_p, transpose_B=True,
                         policy=T.GemmWarpPolicy.FullRow)
            T.wgmma_gemm(do_sh[:, kc * 64:(kc + 1) * 64], kv_sh[:, kc * 64:(kc + 1) * 64], acc_dp, transpose_B=True,
                         policy=T.GemmWarpPolicy.FullRow)
        T.wait_wgmma(0)
        for h, j in T.Parallel(HB, BS):
            acc_p[h, j] = T.if_then_else(valid(Idx[b, s, i * BS + j], N), ex2(acc_p[h, j] * scale2 - lse_sh[h]), 0)
        for h, j in T.Parallel(HB, BS):
            acc_dp[h, j] = acc_p[h, j] * (acc_dp[h, j] - delta_sh[h]) * sm_scale
        T.copy(acc_dp, ds_loc)
        T.barrier_wait(pds_empty, ph ^ 1)             # warpgroup 1 is done with this buffer (block i-2)
        T.copy(acc_p, p_b)
        T.copy(ds_loc, ds_b)
        T.fence_proxy_async()                         # read by warpgroup 1's wgmma (async proxy)
        T.barrier_arrive(pds_full)
        T.gemm(ds_loc, kv_sh[:, 0:D2], acc_dq_l, policy=T.GemmWarpPolicy.FullRow)
        T.barrier_arrive(kv_empty)
        if i + 1 < n_blk:
            T.barrier_wait(kv_empty, i & 1)           # warpgroup 1's dq GEMM has read block i too
            fetch(KV, Idx, b, s, i + 1, kv_sh, kv_full, tx, 0)

    @T.macro
    def dkv_step(KV, Idx, N, b, s, i, tx, q_sh, do_sh, kv_sh, acc_dq_r, acc_dkv, dKV, p_b, ds_b, pds_full,
                 pds_empty, ph, kv_full, kv_empty):
        # warpgroup 1, block i: dq[:, D/2:], then dkv and its atomics while warpgroup 0 scores block i+1
        T.barrier_wait(kv_full, i & 1)
        T.barrier_wait(pds_full, ph)
        T.gemm(ds_b, kv_sh[:, D2:dim], acc_dq_r, policy=T.GemmWarpPolicy.FullRow)
        T.barrier_arrive(kv_empty)
        if i + 1 < n_blk:
            T.barrier_wait(kv_empty, i & 1)
            fetch(KV, Idx, b, s, i + 1, kv_sh, kv_full, tx, BS // 2)
        for c in T.unroll(dim // DC):
            T.gemm(ds_b, q_sh[:, c * DC:(c + 1) * DC], acc_dkv, transpose_A=True, clear_accum=True,
                   policy=T.GemmWarpPolicy.FullRow)
            T.gemm(p_b, do_sh[:, c * DC:(c + 1) * DC], acc_dkv, transpose_A=True, policy=T.GemmWarpPolicy.FullRow)
            # straight from the accumulators, 16 bytes a lane (DKV_RED4)
            T.call_extern("handle", f"v4_dkv_red4<{DC}>", acc_dkv.data, T.address_of(dKV[b, 0, 0]),
                          T.address_of(Idx[b, s, i * BS]), N, dim, c * DC)
        T.barrier_arrive(pds_empty)

    @T.prim_func
    def sparse_attn_bwd(
        Q: T.Tensor([B, S, heads, dim], bf16),
        KV: T.Tensor([B, N, dim], bf16),
        O: T.Tensor([B, S, heads, dim], bf16),
        dO: T.Tensor([B, S, heads, dim], bf16),
        Idx: T.Tensor([B, S, topk], T.int32),
        Lse: T.Tensor([B, S, heads], f32),
        Sink: T.Tensor([heads], f32),
        dKV: T.Tensor([B, N, dim], f32),
        dSink: T.Tensor([heads], f32),
        dQ: T.Tensor([B, S, heads, dim], bf16),
    ):
        with T.Kernel(S * rep, B, threads=256, prelude=DKV_RED4 + FAST_EX2) as (bx, b):
            s = bx // rep
            h0 = (bx % rep) * HB
            q_sh = T.alloc_shared([HB, dim], bf16)
            do_sh = T.alloc_shared([HB, dim], bf16)
            kv_sh = T.alloc_shared([BS, dim], bf16)
            p0 = T.alloc_shared([HB, BS], bf16)
            ds0 = T.alloc_shared([HB, BS], bf16)
            p1 = T.alloc_shared([HB, BS], bf16)
            ds1 = T.alloc_shared([HB, BS], bf16)
            acc_p = T.alloc_fragment([HB, BS], f32)
            acc_dp = T.alloc_fragment([HB, BS], f32)
            ds_loc = T.alloc_fragment([HB, BS], bf16)
            acc_dq_l = T.alloc_fragment([HB, D2], f32)
            acc_dq_r = T.alloc_fragment([HB, D2], f32)
            acc_dkv = T.alloc_fragment([BS, DC], f32)
            od = T.alloc_fragment([HB, DC], f32)
            o0 = T.alloc_fragment([HB, DC], bf16)
            o1 = T.alloc_fragment([HB, DC], bf16)
            o2 = T.alloc_fragment([HB, DC], bf16)
            o3 = T.alloc_fragment([HB, DC], bf16)
            od_sum = T.alloc_fragment([HB], f32)
            lse_sh = T.alloc_shared([HB], f32)
            delta_sh = T.alloc_shared([HB], f32)
            kv_full = T.alloc_barrier(arrive_count=256)
            in_full = T.alloc_barrier(arrive_count=256)
            kv_empty = T.alloc_barrier(arrive_count=256)
            pds_full0 = T.alloc_barrier(arrive_count=128)
            pds_full1 = T.alloc_barrier(arrive_count=128)
            pds_empty0 = T.alloc_barrier(arrive_count=128)
            pds_empty1 = T.alloc_barrier(arrive_count=128)
            tx = T.get_thread_binding()

            # Q and dO by TMA, 64-column boxes spread over the warps' leaders; O into registers and block 0's
            # rows (8 a warp) go out at the same time
            for cc in T.unroll(T.ceildiv(dim // 64, 8)):
                c = cc * 8 + tx // 32
                if c < dim // 64:
                    T.tma_copy(Q[b, s, h0:h0 + HB, c * 64:c * 64 + 64], q_sh[:, c * 64:c * 64 + 64], barrier=in_full,
                               leader_scope_threads=32)
                    T.tma_copy(dO[b, s, h0:h0 + HB, c * 64:c * 64 + 64], do_sh[:, c * 64:c * 64 + 64], barrier=in_full,
                               leader_scope_threads=32)
            T.barrier_arrive(in_full)
            T.copy(O[b, s, h0:h0 + HB, 0:DC], o0)
            if n_dc > 1:
                T.copy(O[b, s, h0:h0 + HB, DC:2 * DC], o1)
            if n_dc > 2:
                T.copy(O[b, s, h0:h0 + HB, 2 * DC:3 * DC], o2)
            if n_dc > 3:
                T.copy(O[b, s, h0:h0 + HB, 3 * DC:4 * DC], o3)
            fetch(KV, Idx, b, s, 0, kv_sh, kv_full, tx, (tx // 128) * (BS // 2))
            for h in T.Parallel(HB):
                lse_sh[h] = Lse[b, s, h0 + h]
            T.barrier_wait(in_full, 0)
            T.sync_threads()
            T.clear(od)                            # Delta = rowsum(O * dO) in fp32: the DC-column chunks' products
            delta_part(od, o0, do_sh, 0)           # summed in place first, then one row reduction (not one a chunk)
            if n_dc > 1:
                delta_part(od, o1, do_sh, 1)
            if n_dc > 2:
                delta_part(od, o2, do_sh, 2)
            if n_dc > 3:
                delta_part(od, o3, do_sh, 3)
            T.reduce_sum(od, od_sum, dim=1)
            for h in T.Parallel(HB):
                delta_sh[h] = od_sum[h]
            T.sync_threads()
            for h in T.Parallel(HB):
                T.atomic_add(dSink[h0 + h], -delta_sh[h] * T.exp2(Sink[h0 + h] * LOG2E - lse_sh[h]))
            if tx < 128:
                T.clear(acc_dq_l)
                for k in T.serial(n_blk // 2):
                    scores(KV, Idx, N, b, s, 2 * k, tx, q_sh, do_sh, kv_sh, lse_sh, delta_sh, acc_p, acc_dp, ds_loc,
                           acc_dq_l, p0, ds0, pds_full0, pds_empty0, k & 1, kv_full, kv_empty)
                    scores(KV, Idx, N, b, s, 2 * k + 1, tx, q_sh, do_sh, kv_sh, lse_sh, delta_sh, acc_p, acc_dp, ds_loc,
                           acc_dq_l, p1, ds1, pds_full1, pds_empty1, k & 1, kv_full, kv_empty)
            else:
                T.clear(acc_dq_r)
                for k in T.serial(n_blk // 2):
                    dkv_step(KV, Idx, N, b, s, 2 * k, tx, q_sh, do_sh, kv_sh, acc_dq_r, acc_dkv, dKV, p0, ds0,
                             pds_full0, pds_empty0, k & 1, kv_full, kv_empty)
                    dkv_step(KV, Idx, N, b, s, 2 * k + 1, tx, q_sh, do_sh, kv_sh, acc_dq_r, acc_dkv, dKV, p1, ds1,
                             pds_full1, pds_empty1, k & 1, kv_full, kv_empty)
            # dQ leaves through q_sh (every dkv GEMM has read it) as one TMA store
            T.sync_threads()
            if tx < 128:
                T.copy(acc_dq_l, q_sh[:, 0:D2])
            else:
                T.copy(acc_dq_r, q_sh[:, D2:dim])
            T.fence_proxy_async()
            T.sync_threads()
            T.copy(q_sh, dQ[b, s, h0:h0 + HB, :])

    return sparse_attn_bwd


# --------------------------------------------------------------------------------------------------
# Compiled kernels and the torch-facing functions
# --------------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _compile(kind: str, heads: int, dim: int, topk: int, sm_scale: float, cfg: tuple, num_ctas: int = H200_SMS):
    from . import tilelang_compile
    if kind == "fwd":
        return tilelang_compile(fwd_program(heads, dim, topk, sm_scale, num_ctas), [4, 5], dict(cfg))
    return tilelang_compile(bwd_program(heads, dim, topk, sm_scale), [9], dict(cfg))


@functools.lru_cache(maxsize=None)
def _sm_count(device: int) -> int:
    """The persistent forward's grid on a GPU: one CTA an SM."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def fwd_kernel(heads: int, dim: int, topk: int, sm_scale: float, pass_configs: dict | None = None):
    cfg = FWD_PASS_CONFIGS if pass_configs is None else pass_configs
    sms = _sm_count(torch.cuda.current_device()) if torch.cuda.is_available() else H200_SMS
    return _compile("fwd", heads, dim, topk, float(sm_scale), _frozen(cfg), sms)


def bwd_kernel(heads: int, dim: int, topk: int, sm_scale: float, pass_configs: dict | None = None):
    cfg = BWD_PASS_CONFIGS if pass_configs is None else pass_configs
    return _compile("bwd", heads, dim, topk, float(sm_scale), _frozen(cfg))


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def _pad_inputs(q, kv, attn_sink, topk_idxs):
    """bf16 contiguous operands, heads padded to a multiple of 64 (zero q, zero sink: their rows are
    discarded and, with dO = 0, add nothing to dkv) and top-k padded with -1 to the kernel's block."""
    if q.dim() != 4 or kv.dim() != 3 or topk_idxs.dim() != 3:
        raise ValueError(f"sparse_attn: expected q[B,S,H,D], kv[B,N,D], topk_idxs[B,S,K]; got {tuple(q.shape)}, "
                         f"{tuple(kv.shape)}, {tuple(topk_idxs.shape)}")
    B, S, H, D = q.shape
    if kv.shape[0] != B or kv.shape[2] != D or topk_idxs.shape[:2] != (B, S) or attn_sink.shape != (H,):
        raise ValueError(f"sparse_attn: shapes disagree: q {tuple(q.shape)}, kv {tuple(kv.shape)}, "
                         f"attn_sink {tuple(attn_sink.shape)}, topk_idxs {tuple(topk_idxs.shape)}")
    if not q.is_cuda:
        raise ValueError("sparse_attn(impl='tilelang') needs CUDA tensors; use impl='torch' on the CPU")
    Hp, Kp = _round_up(H, HEAD_BLOCK), _round_up(topk_idxs.shape[-1], TOPK_MULTIPLE)
    qp = torch.nn.functional.pad(q.to(torch.bfloat16), (0, 0, 0, Hp - H)).contiguous()
    idx = torch.nn.functional.pad(topk_idxs.to(torch.int32), (0, Kp - topk_idxs.shape[-1]), value=-1).contiguous()
    sink = torch.nn.functional.pad(attn_sink.detach().float(), (0, Hp - H)).contiguous()
    return qp, kv.to(torch.bfloat16).contiguous(), sink, idx


def _fwd(qp, kvb, sink, idx, sm_scale, pass_configs=None):
    _, _, Hp, D = qp.shape
    return fwd_kernel(Hp, D, idx.shape[-1], sm_scale, pass_configs)(qp, kvb, idx, sink)


def _bwd(qp, kvb, sink, idx, o, lse2, dop, sm_scale, pass_configs=None):
    """Returns dq (bf16, padded heads), dkv (fp32), dsink (fp32, padded heads)."""
    _, _, Hp, D = qp.shape
    grads = torch.zeros(kvb.numel() + Hp, dtype=torch.float32, device=kvb.device)   # one memset for both sums
    dkv, dsink = grads[:kvb.numel()].view(kvb.shape), grads[kvb.numel():]
    dq = bwd_kernel(Hp, D, idx.shape[-1], sm_scale, pass_configs)(qp, kvb, o, dop, idx, lse2, sink, dkv, dsink)
    return dq, dkv, dsink


def sparse_attn_fwd(q, kv, attn_sink, topk_idxs, softmax_scale: float, pass_configs: dict | None = None):
    """Forward only: (o[B,S,H,D] in q's dtype, lse[B,S,H] fp32, natural log, sink included)."""
    H = q.shape[2]
    qp, kvb, sink, idx = _pad_inputs(q, kv, attn_sink, topk_idxs)
    o, lse2 = _fwd(qp, kvb, sink, idx, softmax_scale, pass_configs)
    return o[:, :, :H].to(q.dtype), lse2[:, :, :H] * math.log(2.0)


class SparseAttnFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, kv, attn_sink, topk_idxs, softmax_scale):
        H = q.shape[2]
        qp, kvb, sink, idx = _pad_inputs(q, kv, attn_sink, topk_idxs)
        o, lse2 = _fwd(qp, kvb, sink, idx, softmax_scale)
        ctx.save_for_backward(qp, kvb, sink, idx, o, lse2)
        ctx.meta = (H, softmax_scale, q.dtype, kv.dtype, attn_sink.dtype)
        return o[:, :, :H].to(q.dtype)

    @staticmethod
    def backward(ctx, do):
        qp, kvb, sink, idx, o, lse2 = ctx.saved_tensors
        H, softmax_scale, q_dtype, kv_dtype, sink_dtype = ctx.meta
        dop = torch.nn.functional.pad(do.to(torch.bfloat16), (0, 0, 0, qp.shape[2] - H)).contiguous()
        dq, dkv, dsink = _bwd(qp, kvb, sink, idx, o, lse2, dop, softmax_scale)
        return dq[:, :, :H].to(q_dtype), dkv.to(kv_dtype), dsink[:H].to(sink_dtype), None, None


def sparse_attn(q, kv, attn_sink, topk_idxs, softmax_scale: float):
    """Differentiable sparse attention with sink (see the module docstring for the math)."""
    return SparseAttnFn.apply(q, kv, attn_sink, topk_idxs, softmax_scale)
