"""CPU/CI: the Triton grouped weight-gradient kernel (dsv4/kernels/triton_grouped_wgrad.py) in Triton's interpreter
against an fp64 reference, and compiled for sm_90 to a pipelined tensor-core kernel (no GPU needed for either).

The interpreter runs in a subprocess: it must be chosen (TRITON_INTERPRET=1) before Triton is imported. Its dot
does not take bf16, so CPU tensors have their tiles upcast to fp32 first (exact: bf16 values are fp32 values);
bounds, masks, the tile order and the epilogue are the GPU's code."""
import importlib.util

import pytest

from tests.kernels.triton_interpreter import interpret

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

_RUN = r"""
import json, sys, torch
from dsv4.kernels import triton_grouped_wgrad as tw

case = json.loads(sys.argv[1])
g = torch.Generator().manual_seed(case["seed"])
counts, N, K = case["counts"], case["N"], case["K"]
offs = torch.tensor(counts).cumsum(0).to(torch.int32)
T = int(offs[-1])
dy = torch.randn(T, N, generator=g).bfloat16()
x = torch.randn(T, K, generator=g).bfloat16()
# the outputs are views into one buffer with a sentinel gap between them: nothing outside a view is written
gap = 37
buf = torch.full((len(counts) * (N * K + gap),), 7.0)
outs = [buf[e * (N * K + gap):e * (N * K + gap) + N * K].view(N, K) for e in range(len(counts))]
for o in outs:
    o.copy_(torch.randn(N, K, generator=g))
before = buf.clone()
tw.accumulate(dy, x, offs, outs, config=case.get("config"))
b = [0] + offs.tolist()
res = {"err": [], "untouched": [], "finite": bool(torch.isfinite(buf).all())}
for e, o in enumerate(outs):
    start = e * (N * K + gap)
    ref = before[start:start + N * K].view(N, K).double() + dy[b[e]:b[e + 1]].double().t() @ x[b[e]:b[e + 1]].double()
    res["err"].append(((o.double() - ref).abs().max() / ref.abs().max()).item())
    res["untouched"].append(bool(torch.equal(o, before[start:start + N * K].view(N, K))))
mask = torch.ones_like(buf, dtype=torch.bool)
for e in range(len(counts)):
    mask[e * (N * K + gap):e * (N * K + gap) + N * K] = False
res["gaps_kept"] = bool(torch.equal(buf[mask], before[mask]))
print(json.dumps(res))
"""


def _interpret(case: dict) -> dict:
    return interpret(_RUN, case)


SMALL = {"BN": 32, "BK": 32, "BT": 16, "GROUP": 2}


@pytest.mark.parametrize("counts, N, K", [
    ([20, 0, 70, 5], 48, 80),          # an empty expert; tiles and row chunks that do not divide the sizes
    ([0, 33, 16, 0], 64, 32),          # empty first and last experts; a group of exactly one row chunk
    ([1, 1, 1], 32, 96),               # one row an expert
])
def test_matches_fp64_and_writes_only_its_outputs(counts, N, K):
    res = _interpret({"seed": 0, "counts": counts, "N": N, "K": K, "config": SMALL})
    assert res["finite"]
    assert res["gaps_kept"], "wrote outside the experts' outputs"
    for e, c in enumerate(counts):
        if c == 0:
            assert res["untouched"][e], f"expert {e} has no rows but its output changed"
        else:
            assert not res["untouched"][e]
            # exact bf16 products summed in fp32, then one fp32 add: fp32 round-off of the sum
            assert res["err"][e] < 1e-5, (e, res["err"][e])


def test_group_order_covers_every_tile():
    """GROUP larger than the tile rows, tile rows not a multiple of GROUP: the grouped program order must still
    map the programs one to one onto the tiles (a missed tile keeps its old value, a doubled one adds twice)."""
    res = _interpret({"seed": 1, "counts": [40, 9], "N": 160, "K": 64,
                      "config": {"BN": 32, "BK": 32, "BT": 16, "GROUP": 3}})
    assert res["finite"] and res["gaps_kept"]
    assert max(res["err"]) < 1e-5, res["err"]


def test_rejects_bad_shapes():
    import torch

    from dsv4.kernels import triton_grouped_wgrad as tw
    offs = torch.tensor([2, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="grouped wgrad"):
        tw.accumulate(torch.zeros(4, 8).bfloat16(), torch.zeros(4, 16).bfloat16(), offs, [torch.zeros(16, 8)] * 2)
    with pytest.raises(ValueError, match="fp32"):
        tw.accumulate(torch.zeros(4, 8).bfloat16(), torch.zeros(4, 16).bfloat16(), offs,
                      [torch.zeros(8, 16).bfloat16()] * 2)


def test_compiles_for_sm90_to_a_pipelined_tensor_core_kernel():
    """What the GPU runs: wgmma dots fed by cp.async copies over the configured stages (a config or a kernel
    change that loses the pipelining, e.g. a load Triton cannot vectorise, fails here first). The integer and
    pointer arguments are compiled as 16-divisible, as Triton specialises them at launch for the trainer's
    aligned buffers and 2048/4096-wide rows."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from dsv4.kernels import triton_grouped_wgrad as tw
    c = tw.CONFIG
    sig = {"dy_ptr": "*bf16", "x_ptr": "*bf16", "offs_ptr": "*i32", "out_ptrs": "*i64", "N": "i32", "K": "i32",
           "stride_dy": "i32", "stride_x": "i32", "BN": "constexpr", "BK": "constexpr", "BT": "constexpr",
           "GROUP": "constexpr", "UPCAST": "constexpr"}
    consts = {"BN": c["BN"], "BK": c["BK"], "BT": c["BT"], "GROUP": c["GROUP"], "UPCAST": False}
    k = triton.compile(ASTSource(tw._wgrad_kernel, sig, consts,
                                 attrs={(i,): [["tt.divisibility", 16]] for i in range(8)}),
                       target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": c["num_warps"], "num_stages": c["num_stages"]})
    ptx = k.asm["ptx"]
    assert "wgmma.mma_async" in ptx, "the dot is not on Hopper's tensor cores"
    assert "cp.async.cg.shared.global" in ptx, "the tile loads are not pipelined"
    assert k.metadata.shared <= 228 * 1024, k.metadata.shared
