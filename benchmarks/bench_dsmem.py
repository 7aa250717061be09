"""What swapping a score block between the two SMs of a CTA pair costs (Hopper distributed shared memory).

The measurement behind a forward layout that docs/kernels.md rules out: D split over a cluster of 2 CTAs, each SM
holding half of Q, of every KV row and of O, would swap its 64 x 64 fp32 partial scores (16 KiB) with its peer every
block. Here each CTA of a pair (128 threads, one wgmma accumulator's worth of registers) sends its fragment to the
peer, waits for the peer's and adds it in, round after round, three ways (HOW): `st.async` onto the peer's mbarrier
(complete_tx); plain remote stores (`st.shared::cluster`) and a release-arrive on the peer's mbarrier; the fragment
into local shared memory and one bulk copy (`cp.async.bulk`) to the peer. The baseline, in the same run: each way
aimed at the CTA's own shared memory. Printed: cycles a round by size, for one pair alone and for a pair on every SM,
and with W cycles of other work between the send and the wait (how much of the swap hides). Needs a Hopper GPU.

    .venv/bin/python benchmarks/bench_dsmem.py [--rounds 2000]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# Thread t keeps its 32 floats as 8 vectors of 4 and stores vector k at float4 index k * 128 + t, so a warp's
# store (and the peer's read) is 512 contiguous bytes. The receiver's mbarrier counts one arrive (its own thread 0,
# with the bytes it expects) plus the bytes the peer's stores complete.
PRELUDE = r"""
#include <cstdint>
__device__ __forceinline__ unsigned bd_sa(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void bd_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(bd_sa(bar)), "r"(count) : "memory");
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(bd_sa(bar + 1)), "r"(count) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
__device__ __forceinline__ void bd_expect(uint64_t* bar, int bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bd_sa(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bd_wait(uint64_t* bar, int parity) {
  unsigned ok = 0;
  while (!ok)
    asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                 : "=r"(ok) : "r"(bd_sa(bar)), "r"(parity) : "memory");
}
// How: 0 = st.async onto the peer's mbarrier (complete_tx, 16 bytes at a time); 1 = plain remote stores
// (st.shared::cluster), then each thread's release-arrive on the peer's mbarrier; 2 = the vectors into a local staging
// buffer, then one bulk copy (cp.async.bulk shared::cta -> shared::cluster) onto the peer's mbarrier (complete_tx).
template <int NK, int HOW>
__device__ __forceinline__ void bd_send(const float* acc, float* buf, float* stage, uint64_t* bar, int to) {
  unsigned rb, rbar;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(rb) : "r"(bd_sa(buf)), "r"(to));
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(rbar) : "r"(bd_sa(bar)), "r"(to));
  const unsigned t = threadIdx.x & 127;
  if constexpr (HOW == 0) {
    #pragma unroll
    for (int k = 0; k < NK; ++k)
      asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [%0], {%1, %2, %3, %4}, [%5];"
                   :: "r"(rb + (k * 128 + t) * 16), "f"(acc[4 * k]), "f"(acc[4 * k + 1]), "f"(acc[4 * k + 2]),
                      "f"(acc[4 * k + 3]), "r"(rbar) : "memory");
  } else if constexpr (HOW == 1) {
    #pragma unroll
    for (int k = 0; k < NK; ++k)
      asm volatile("st.shared::cluster.v4.f32 [%0], {%1, %2, %3, %4};"
                   :: "r"(rb + (k * 128 + t) * 16), "f"(acc[4 * k]), "f"(acc[4 * k + 1]), "f"(acc[4 * k + 2]),
                      "f"(acc[4 * k + 3]) : "memory");
    asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];" :: "r"(rbar) : "memory");
  } else {
    #pragma unroll
    for (int k = 0; k < NK; ++k)
      reinterpret_cast<float4*>(stage)[k * 128 + t] = make_float4(acc[4 * k], acc[4 * k + 1], acc[4 * k + 2], acc[4 * k + 3]);
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");   // the bulk copy reads through the async proxy
    asm volatile("bar.sync 1, 128;" ::: "memory");
    if (t == 0)
      asm volatile("cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                   :: "r"(rb), "r"(bd_sa(stage)), "r"(NK * 2048), "r"(rbar) : "memory");
  }
}
template <int NK>
__device__ __forceinline__ void bd_add(float* acc, const float* buf) {
  const unsigned t = threadIdx.x & 127;
  #pragma unroll
  for (int k = 0; k < NK; ++k) {
    float4 v = reinterpret_cast<const float4*>(buf)[k * 128 + t];
    acc[4 * k] = 0.5f * (acc[4 * k] + v.x); acc[4 * k + 1] = 0.5f * (acc[4 * k + 1] + v.y);
    acc[4 * k + 2] = 0.5f * (acc[4 * k + 2] + v.z); acc[4 * k + 3] = 0.5f * (acc[4 * k + 3] + v.w);
  }
}
__device__ __forceinline__ void bd_spin(long long cycles) {
  long long t0 = clock64();
  while (clock64() - t0 < cycles) {}
}
"""


HOW = ("st.async", "st.shared::cluster", "bulk copy")   # bd_send's HOW 0, 1, 2


def swap_kernel(ctas: int, vectors: int, work: int, rounds: int, remote: bool, how: int = 0):
    """CTA pairs swapping `vectors` x 2 KiB (16-byte vectors, 128 threads) a round; Out[cta] = (cycles a round, a value
    of the result, which both CTAs of a pair must agree on when they swap: a + b == b + a)."""
    import tilelang.language as T
    from tilelang.cuda.language import cluster

    from dsv4.kernels import tilelang_compile

    @T.prim_func
    def swap(Out: T.Tensor([ctas, 2], T.float32)):
        with T.Kernel(ctas, threads=128, cluster_dims=2, prelude=PRELUDE) as cta:
            buf = T.alloc_shared([2 * 4096], T.float32)     # two slots: round r lands in slot r % 2
            stage = T.alloc_shared([2 * 4096], T.float32)   # HOW 2: round r leaves from stage slot r % 2
            bars = T.alloc_shared([2], T.uint64)
            acc = T.alloc_local([32], T.float32)
            clk = T.alloc_local([2], T.int64)
            tx = T.get_thread_binding()
            rank = cluster.block_rank_in_cluster()
            to = rank ^ 1 if remote else rank
            for j in T.unroll(32):
                acc[j] = T.cast(tx * 32 + j, T.float32) * (1.0 + rank)
            if tx == 0:
                T.call_extern("handle", "bd_init", T.address_of(bars[0]), 128 if how == 1 else 1)
            cluster.cluster_sync()                            # the peer's barriers exist before anything lands
            clk[0] = T.call_extern("int64", "clock64")
            for r in T.serial(rounds):
                if how != 1 and tx == 0:
                    T.call_extern("handle", "bd_expect", T.address_of(bars[r % 2]), vectors * 2048)
                T.call_extern("handle", f"bd_send<{vectors}, {how}>", acc.data, T.address_of(buf[r % 2 * 4096]),
                              T.address_of(stage[r % 2 * 4096]), T.address_of(bars[r % 2]), to)
                if work > 0:
                    T.call_extern("handle", "bd_spin", work)
                T.call_extern("handle", "bd_wait", T.address_of(bars[r % 2]), r // 2 % 2)
                T.call_extern("handle", f"bd_add<{vectors}>", acc.data, T.address_of(buf[r % 2 * 4096]))
            clk[1] = T.call_extern("int64", "clock64")
            if tx == 0:
                Out[cta, 0] = T.cast(clk[1] - clk[0], T.float32) / rounds
                Out[cta, 1] = acc[0]
            cluster.cluster_sync()                            # nobody leaves while its peer may still write to it

    passes = {"tl.disable_thread_storage_sync": True, "tl.disable_warp_specialized": True,
              "tl.disable_safe_memory_legalize": True}
    return tilelang_compile(swap, [0], passes)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2000)
    args = ap.parse_args()
    import torch
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        print("bench_dsmem: needs a Hopper (sm_90) GPU; none here", file=sys.stderr)
        return 2
    sms = torch.cuda.get_device_properties(0).multi_processor_count // 2 * 2
    print(f"{torch.cuda.get_device_name(0)}, {sms} CTAs = {sms // 2} pairs; cycles a round (median over the CTAs)")
    print(f"{'CTAs':>5} {'KiB each way':>12} {'other work':>10} {'how':>22} {'local':>7} {'peer':>7} {'peer / local':>12}")
    cases = [(2, v, 0) for v in (1, 2, 4, 8)] + [(sms, v, 0) for v in (1, 2, 4, 8)] + [(sms, 8, w) for w in (1000, 2000)]
    for ctas, vectors, work in cases:
        for how, name in enumerate(HOW):
            cycles = {}
            for remote in (False, True):
                out = swap_kernel(ctas, vectors, work, args.rounds, remote, how)()
                torch.cuda.synchronize()
                if remote and not bool((out[0::2, 1] == out[1::2, 1]).all()):
                    print(f"bench_dsmem: {name}: the two CTAs of a pair added up different results", file=sys.stderr)
                    return 1
                cycles[remote] = out[:, 0].median().item()
            print(f"{ctas:>5} {vectors * 2:>12} {work:>10} {name:>22} {cycles[False]:>7.0f} {cycles[True]:>7.0f} "
                  f"{cycles[True] / cycles[False]:>12.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
