"""The reference model on a GPU: same numbers as on CPU, and a Flash-width 4-layer model trains a step."""
import pytest
import torch
import torch.nn.functional as F

from dsv4.config import ModelConfig
from dsv4.model import Transformer

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


def test_tiny_cuda_matches_cpu():
    """Continuous pieces agree to fp32 rounding. (Whole-model logits do not: a rounding-level difference
    flips some router/indexer top-k choices, which a random tiny model amplifies.)"""
    from dsv4.model import rope_cos_sin
    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = ModelConfig.preset("tiny")
    cpu, gpu = Transformer(cfg), Transformer(cfg).cuda()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 64, cfg.dim, generator=g)
    with torch.no_grad():
        for layer in (0, 2):                                        # window-only, heavily compressed
            a, b = cpu.layers[layer].attn(x), gpu.layers[layer].attn(x.cuda())
            torch.testing.assert_close(b.cpu(), a, rtol=1e-4, atol=1e-4)
        X = torch.randn(2, 64, cfg.hc_mult, cfg.dim, generator=g)
        a = cpu.layers[1]._hc_pre(X, "attn")
        b = gpu.layers[1]._hc_pre(X.cuda(), "attn")
        for u, v in zip(a, b):
            torch.testing.assert_close(v.cpu(), u, rtol=1e-4, atol=1e-4)
        attn_c, attn_g = cpu.layers[1].attn, gpu.layers[1].attn
        qr = torch.randn(2, 64, cfg.q_lora_rank, generator=g)
        cos, sin = rope_cos_sin(attn_c.freqs, torch.arange(64))
        _, la = attn_c.indexer(x, qr, cos, sin, attn_c.freqs)
        _, lb = attn_g.indexer(x.cuda(), qr.cuda(), cos.cuda(), sin.cuda(), attn_g.freqs)
        torch.testing.assert_close(lb.cpu(), la, rtol=1e-4, atol=1e-4)
        out = gpu(torch.randint(0, cfg.vocab_size, (2, 64), device="cuda"))
    assert torch.isfinite(out.logits).all() and torch.isfinite(out.mtp_logits[0]).all()


def test_flash_width_4layer_bf16_train_step():
    cfg = ModelConfig.preset("4layer").with_overrides("n_routed_experts=8 vocab_size=16384", qat_kv_fp8=True,
                                                      qat_indexer_fp4=True, fp8_gemm_inputs=True, mxfp4_experts=True)
    model = Transformer(cfg).cuda()
    ids = torch.randint(0, cfg.vocab_size, (1, 1024), device="cuda")
    out = model(ids, indexer_loss=True)
    V = cfg.vocab_size
    loss = F.cross_entropy(out.logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1)) \
        + F.cross_entropy(out.mtp_logits[0][:, :-1].reshape(-1, V), ids[:, 2:].reshape(-1)) + out.indexer_loss
    loss.backward()
    assert torch.isfinite(loss)
    grads = [p.grad for p in model.parameters() if p.requires_grad and p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    assert model.layers[2].attn.indexer.wq_b.weight.grad.abs().max() > 0
