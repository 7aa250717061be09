"""The routed experts' weight gradients accumulated into fp32 main_grad by one grouped GEMM (Triton).

Training's grouped expert path (dsv4/megatron/layers.py `_ExpertGemm`) needs, for every local expert e and
micro-batch, main_grad_e [out, in] += dY_e^T @ X_e over the e-th group of rows (rows sorted by expert; `offs`
holds each group's end). torch has no grouped GEMM that writes fp32 (`torch._grouped_mm`'s output dtype is its
input's) and none that accumulates, so `moe_impl=grouped` runs one cuBLAS `addmm(out_dtype=float32, beta=1)` per
expert. At a V4-Flash EP-8 rank's ~768 rows an expert those are 3 x 32 small GEMMs a layer and micro-batch, which
the H200 ran at ~314 TFLOP/s (3,033 of them: 124.8 ms of a 1.23 s step at 32 experts x 4 layers), about half the
grouped GEMM's rate; a bf16 grouped wgrad and a separate fp32 add measured slower still (the add alone moves
10 bytes an element).

This kernel is both at once: one launch per weight and micro-batch over (output tile, expert), each program
looping over its expert's rows with a bf16 x bf16 -> fp32 tensor-core dot and adding its tile into that expert's
main_grad in the epilogue (read + write of the fp32 tile once). The groups' bounds are read on the device from
`offs`, so unlike the per-expert loop the backward needs no host copy of them; an expert with no rows returns at
once and leaves its main_grad untouched. The experts' main_grads are separate views in megatron's gradient
buffer, reached through a device array of their addresses (cached: the buffer lives as long as the model).

Numerics: the products of bf16 values are exact in fp32 and accumulate in fp32, then add once into main_grad, as
the cuBLAS path does; only the summation order differs. No autotuning: the kernel adds into its output, so a
tuner's trial runs would add several times (`benchmarks/bench_grouped_wgrad.py` times the configurations side by
side against the per-expert loop instead; `CONFIG` is the chosen one).

Tested on the CPU through Triton's interpreter (tests/kernels/test_triton_grouped_wgrad.py: CPU tensors have their
tiles upcast to fp32 before the dot, since the interpreter's dot does not take bf16; everything else, the
bounds, masks, tile order and epilogue, is the same code), and compiled for sm_90 there too; on a GPU by
tests/kernels/test_triton_grouped_wgrad_gpu.py (passes on an H100). Slower than the per-expert cuBLAS GEMMs it would
replace: at 32 experts x ~768 rows, 2048 x 4096 weights, its best configuration took 4.49 ms a layer against
addmm's 4.32 on an H100 (0.96x; benchmarks/records/kernels.jsonl, `grouped_wgrad_*`), so `moe_impl=grouped_triton`
stays a switch, not the default.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:                                         # the CPU-only torch wheels come without Triton
    triton = None

# the launch configuration (block sizes over out, in and rows; warps; pipeline stages): the fastest of
# benchmarks/bench_grouped_wgrad.py's 12 on an H100 (4.49 ms a layer; the other 8-warp 128 x 128 x 64 one 4.67, the
# 4-warp and 256-wide ones 4.8-9.5)
CONFIG = {"BN": 128, "BK": 128, "BT": 64, "GROUP": 8, "num_warps": 8, "num_stages": 4}


def available(t: torch.Tensor) -> bool:
    return triton is not None and t.is_cuda


if triton is not None:
    @triton.jit
    def _wgrad_kernel(dy_ptr, x_ptr, offs_ptr, out_ptrs, N, K, stride_dy, stride_x,
                      BN: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr, GROUP: tl.constexpr,
                      UPCAST: tl.constexpr):
        e = tl.program_id(1)
        start = tl.load(offs_ptr + e - 1, mask=e > 0, other=0).to(tl.int64)
        end = tl.load(offs_ptr + e).to(tl.int64)
        if end > start:
            # tiles in groups of GROUP rows of tiles, so that programs running together share dY and X columns in L2
            pid = tl.program_id(0)
            tiles_n, tiles_k = (N + BN - 1) // BN, (K + BK - 1) // BK
            per_group = GROUP * tiles_k
            first_n = (pid // per_group) * GROUP
            group_n = tl.minimum(tiles_n - first_n, GROUP)
            pid_n = first_n + (pid % per_group) % group_n
            pid_k = (pid % per_group) // group_n
            rn = pid_n * BN + tl.arange(0, BN)
            rk = pid_k * BK + tl.arange(0, BK)
            rt = tl.arange(0, BT)
            acc = tl.zeros((BN, BK), dtype=tl.float32)
            for t0 in range(start, end, BT):
                t = t0 + rt
                live = t < end
                a = tl.load(dy_ptr + t[:, None] * stride_dy + rn[None, :],
                            mask=live[:, None] & (rn[None, :] < N), other=0.0)          # [BT, BN]
                b = tl.load(x_ptr + t[:, None] * stride_x + rk[None, :],
                            mask=live[:, None] & (rk[None, :] < K), other=0.0)          # [BT, BK]
                if UPCAST:
                    a = a.to(tl.float32)
                    b = b.to(tl.float32)
                acc = tl.dot(tl.trans(a), b, acc)
            base = tl.load(out_ptrs + e).to(tl.pointer_type(tl.float32))
            c = base + rn[:, None].to(tl.int64) * K + rk[None, :]
            keep = (rn[:, None] < N) & (rk[None, :] < K)
            tl.store(c, tl.load(c, mask=keep) + acc, mask=keep)


_ADDRESSES: dict[tuple, torch.Tensor] = {}


def _addresses(outs: list[torch.Tensor]) -> torch.Tensor:
    """A device int64 array of the outputs' addresses, made once per set of outputs: building it is a host-to-device
    copy, which from pageable memory would wait for the stream."""
    key = tuple(o.data_ptr() for o in outs) + (outs[0].device,)
    arr = _ADDRESSES.get(key)
    if arr is None:
        if len(_ADDRESSES) > 1024:                          # models rebuilt in one process (tests, benches)
            _ADDRESSES.clear()
        host = torch.tensor(key[:-1], dtype=torch.int64, pin_memory=outs[0].is_cuda)
        arr = _ADDRESSES[key] = host.to(outs[0].device, non_blocking=True)
    return arr


def accumulate(dy: torch.Tensor, x: torch.Tensor, offs: torch.Tensor, outs: list[torch.Tensor],
               config: dict | None = None) -> None:
    """outs[e] += dy[rows of e]^T @ x[rows of e] for every group e (rows start..offs[e], start = offs[e-1] or 0):
    dy [T, N] and x [T, K] bf16 (rows contiguous), offs [E] int32 group ends, outs E fp32 [N, K] contiguous tensors.
    CPU tensors run in Triton's interpreter (a process started with TRITON_INTERPRET=1: the tests)."""
    E = len(outs)
    N, K = outs[0].shape
    if dy.shape[1] != N or x.shape[1] != K or dy.shape[0] != x.shape[0] or offs.numel() != E:
        raise ValueError(f"grouped wgrad: dy {tuple(dy.shape)}, x {tuple(x.shape)}, offs {tuple(offs.shape)}, "
                         f"{E} outputs of {tuple(outs[0].shape)}")
    if dy.stride(1) != 1 or x.stride(1) != 1 or any(o.shape != (N, K) or not o.is_contiguous()
                                                     or o.dtype != torch.float32 for o in outs):
        raise ValueError("grouped wgrad: dy and x need contiguous rows, outputs contiguous fp32 of one shape")
    cfg = {**CONFIG, **(config or {})}
    tiles = triton.cdiv(N, cfg["BN"]) * triton.cdiv(K, cfg["BK"])
    interpret = not dy.is_cuda
    launch = {} if interpret else {k: cfg[k] for k in ("num_warps", "num_stages")}
    _wgrad_kernel[(tiles, E)](dy, x, offs, _addresses(outs), N, K, dy.stride(0), x.stride(0),
                              BN=cfg["BN"], BK=cfg["BK"], BT=cfg["BT"], GROUP=cfg["GROUP"], UPCAST=interpret,
                              **launch)
