"""The decode MoE on a GPU: the grouped GEMMs over the chosen experts (CUTLASS `torch._grouped_mm` in bf16 on Hopper,
a gather and batched GEMM otherwise) and the dense form against MoE.forward at 8, 32 and 256 experts, and a step
with them captured in a CUDA graph against the eager step. Checked on an H200 with the same script (2026-12-03):
bf16 equal (0.0), fp32 within 2.5e-7, the graphed step equal to the eager one."""
import pytest
import torch

from dsv4.config import ModelConfig
from dsv4.model import Transformer
from dsv4.rl import decode

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("experts,k", [(8, 2), (32, 6), (256, 6)])
def test_the_decode_moe_equals_the_models_moe_on_the_gpu(dtype, experts, k):
    cfg = ModelConfig.preset("tiny", seed=3, dtype=dtype, n_routed_experts=experts, n_activated_experts=k)
    model = Transformer(cfg).cuda()
    g = torch.Generator().manual_seed(0)
    for layer in model.layers:
        stack = decode.ExpertStack(layer.ffn)
        assert stack.grouped == (dtype == "bf16" and torch.cuda.get_device_capability()[0] >= 9)
        for B in (1, 64):
            x = torch.randn(B, 1, cfg.dim, generator=g).to(model.embed.weight.dtype).cuda()
            ids = torch.randint(0, cfg.vocab_size, (B, 1), generator=g).cuda()
            with torch.no_grad():
                ref = layer.ffn(x, ids)
                y, idx = decode.moe(layer.ffn, x, ids, stack)
            assert torch.isfinite(y).all() and torch.equal(idx, layer.ffn.last_expert_idx)
            tol = 1e-6 if dtype == "fp32" else 2e-2
            assert (y.float() - ref.float()).abs().max().item() <= tol * ref.float().abs().max().item()


def test_a_graphed_step_with_the_grouped_moe_equals_the_eager_step():
    cfg = ModelConfig.preset("tiny", seed=4, dtype="bf16", n_routed_experts=256, n_activated_experts=6)
    model = Transformer(cfg).cuda().eval()
    prepared = decode.Prepared(model)
    B, S = 8, 40                                  # 8 tokens of 256 experts: the grouped form
    assert B < prepared.experts[0].dense_from
    ids = torch.randint(0, cfg.vocab_size, (B, S), device="cuda")
    dec = decode.GraphedStep(model, decode.DecodeCache(model, B, S), compiled=False, prepared=prepared)
    ref = decode.DecodeCache(model, B, S)
    for p in range(S):
        got = dec(ids[:, p], p)[0].clone()
        want = decode.step(model, ref, ids[:, p], p, prepared)[0]
        assert dec.graphed and torch.isfinite(got).all()
        assert torch.equal(got, want), p
