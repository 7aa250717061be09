"""CPU/CI: the fused Sinkhorn kernels (dsv4/kernels/triton_sinkhorn.py), forward and backward, in Triton's
interpreter against autograd through dsv4.model.sinkhorn in fp64, and compiled for sm_90 (no GPU needed for either);
and the config switch that puts them into training's compiled hyper-connections. On a GPU:
tests/kernels/test_sinkhorn_gpu.py."""
import importlib.util

import pytest

from dsv4.config import ModelConfig
from tests.kernels.triton_interpreter import interpret

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

_RUN = r"""
import json, sys, torch
from dsv4.kernels import triton_sinkhorn as ts
from dsv4.model import sinkhorn

case = json.loads(sys.argv[1])
g = torch.Generator().manual_seed(case["seed"])
x = torch.randn(*case["shape"], generator=g) * case["scale"]
dy = torch.randn(*case["shape"], generator=g)
ref = x.double().requires_grad_()
want = sinkhorn(ref, case["iters"], 1e-6)
want.backward(dy.double())
got_x = x.clone().requires_grad_()
got = ts.sinkhorn(got_x, case["iters"], 1e-6)
got.backward(dy)
print(json.dumps({"out_err": (got.double() - want).abs().max().item(),
                  "grad_err": ((got_x.grad.double() - ref.grad).abs().max() / ref.grad.abs().max()).item(),
                  "finite": bool(torch.isfinite(got).all() and torch.isfinite(got_x.grad).all()),
                  "col_sums": (got.sum(-2) - 1).abs().max().item()}))
"""


@needs_triton
@pytest.mark.parametrize("shape, scale, iters", [
    ((3, 5, 4, 4), 8.0, 20),           # large logits: near-one-hot softmax rows; the model's hc = 4, 20 iterations
    ((70, 4, 4), 1.0, 20),             # more matrices than one program's block of 64
    ((2, 2, 2), 3.0, 1),               # one iteration: softmax and the column normalisation alone
    ((9, 2, 2), 0.5, 3),
])
def test_forward_and_backward_match_autograd_in_fp64(shape, scale, iters):
    res = interpret(_RUN, {"seed": 0, "shape": shape, "scale": scale, "iters": iters})
    assert res["finite"]
    assert res["out_err"] < 2e-6, res
    assert res["col_sums"] < 1e-5, res
    # fp32 arithmetic against fp64 through the same 2*iters - 1 normalisations: round-off, not a wrong Jacobian
    assert res["grad_err"] < 1e-5, res


@needs_triton
def test_backward_compiles_for_sm90():
    """The interpreter runs the loops in Python; this is Triton's compiler on the same kernel (runtime loop bounds,
    a data-dependent branch in the normalisation), for the H200/H100's target."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from dsv4.kernels import triton_sinkhorn as ts
    sig = {"x_ptr": "*fp32", "g_ptr": "*fp32", "dx_ptr": "*fp32", "n_mat": "i32", "eps": "fp32",
           "STEPS": "constexpr", "HC": "constexpr", "BLOCK": "constexpr"}
    k = triton.compile(ASTSource(ts._sinkhorn_bwd_kernel, sig, {"STEPS": 39, "HC": 4, "BLOCK": 64}),
                       target=GPUTarget("cuda", 90, 32))
    assert "_sinkhorn_bwd_kernel" in k.asm["ptx"]


def test_the_switch_is_a_compiled_region():
    cfg = ModelConfig.preset("tiny").with_overrides(compiled="hc+attn+moe+norm+sinkhorn")
    assert cfg.compiled_regions == ("hc", "attn", "moe", "norm", "sinkhorn")
    with pytest.raises(ValueError, match="compiled="):
        ModelConfig.preset("tiny").with_overrides(compiled="hc+sinkhorns")
    with pytest.raises(ValueError, match="add hc"):                 # alone it would change nothing
        ModelConfig.preset("tiny").with_overrides(compiled="attn+sinkhorn")
