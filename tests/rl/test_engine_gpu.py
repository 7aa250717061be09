"""The embedded engine on a GPU with the TileLang attention: cached decoding against the full forward at bf16
tolerance, on the tiny model and on the smoke's Flash-width 4-layer model (8 routed experts), and the engine's
logprobs against the training model's."""
import pytest
import torch

from dsv4.config import ModelConfig
from dsv4.model import Transformer
from dsv4.rl import decode
from dsv4.rl.api import GenerateRequest, SamplingParams
from dsv4.rl.engine import EmbeddedEngine, scaled_logprobs

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


def _compare(cfg, S, B=2):
    torch.manual_seed(0)
    model = Transformer(cfg).cuda()
    ids = torch.randint(0, cfg.vocab_size, (B, S), device="cuda")
    cache = decode.DecodeCache(model, B, S)
    inc = torch.stack([decode.step(model, cache, ids[:, p], p)[0] for p in range(S)], 1)
    with torch.no_grad():
        full = model(ids).logits
    assert torch.isfinite(inc).all() and torch.isfinite(full).all()
    rel = (inc - full).norm(dim=-1) / full.norm(dim=-1)            # per position
    return rel


def test_cached_decoding_tiny_bf16_tilelang():
    rel = _compare(ModelConfig.preset("tiny", dtype="bf16", attn_impl="tilelang"), 80)
    assert rel.median().item() < 2e-2 and (rel < 0.1).float().mean().item() > 0.95, rel


def test_cached_decoding_4layer_bf16_tilelang():
    """300 positions: across the 128-token window, 75 ratio-4 blocks (the indexer's top-512 among them) and two
    ratio-128 entries."""
    cfg = ModelConfig.preset("4layer", n_routed_experts=8, attn_impl="tilelang", max_seq_len=512)
    rel = _compare(cfg, 300, B=2)
    assert rel.median().item() < 2e-2 and (rel < 0.1).float().mean().item() > 0.95, rel


def test_engine_logprobs_match_the_training_model_bf16():
    eng = EmbeddedEngine.from_preset("4layer", ["n_routed_experts=8", "attn_impl=tilelang"], device="cuda")
    reqs = [GenerateRequest(list(range(100, 100 + n)), SamplingParams(max_new_tokens=16, temperature=0.8,
                                                                      sampling_seed=i), return_logprob=True)
            for i, n in enumerate((5, 140))]
    diffs = []
    for req, res in zip(reqs, eng.generate(reqs)):
        ids = torch.tensor([req.input_ids + res.output_ids], device="cuda")
        with torch.no_grad():
            logits = eng.model(ids).logits[0]
        p = len(req.input_ids)
        lp = scaled_logprobs(logits[p - 1:-1], torch.tensor([0.8], device="cuda"), None)
        ref = lp.gather(-1, torch.tensor(res.output_ids, device="cuda")[:, None])[:, 0]
        got = torch.tensor(res.logprobs, device="cuda")
        assert torch.isfinite(got).all()
        diffs.append((got - ref).abs())
    d = torch.cat(diffs)
    print(f"engine vs training logprobs (bf16, tilelang): mean |d| {d.mean().item():.4f}, max {d.max().item():.4f}")
    assert d.mean().item() < 0.03          # miles' rollout-vs-train threshold for bf16 runs
