"""The RL loop's parts that need no megatron process: the training batch's alignment, bucketing, and the three
weight-sync paths into a real embedded engine, read back after the sync.

The trainer's side here is a reference model's parameters by official name, what `full_weights` assembles from
the megatron stage (the full loop runs in tests/pipeline/test_rl_pipeline.py and tests/rl/test_loop_http.py)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from dsv4.config import ModelConfig
from dsv4.model import Transformer
from dsv4.rl.api import GenerateRequest, GenerateResult, SamplingParams
from dsv4.rl.engine import EmbeddedEngine
from dsv4.rl.loop import RLConfig, _atomic_key, _read_back, buckets, build_batch, push_weights, sync_tensors
from dsv4.rl.tasks import Sample


def weights_of(model) -> dict[str, torch.Tensor]:
    return {name: p.detach() for name, p in model.named_parameters()}


def _probe(engine):
    reqs = [GenerateRequest([40, 41, 42, 43], SamplingParams(max_new_tokens=6, sampling_seed=i), return_logprob=True)
            for i in range(3)]
    return [r.logprobs for r in engine.generate(reqs)]


@pytest.mark.parametrize("path", ["inproc", "broadcast", "disk"])
def test_every_sync_path_makes_the_engine_equal_the_trainer(path, tmp_path):
    cfg = ModelConfig.preset("tiny", seed=9)
    trainer = Transformer(cfg)
    engine = EmbeddedEngine.from_preset("tiny", seed=0)
    rl = RLConfig(sync_path=path, sync_format="full", bucket_mb=1, scratch=tmp_path)
    rep = push_weights(engine, weights_of(trainer), cfg, rl, "4")
    assert rep.bound_ok and rep.max_err == 0.0 and rep.version == "4"
    assert engine.weight_version == "4"
    for (n, p), (_, q) in zip(trainer.named_parameters(), engine.model.named_parameters()):
        assert torch.equal(p, q), n
    # all three paths leave the same engine: the same next rollout, token for token and logprob for logprob
    reference = EmbeddedEngine(Transformer(cfg))
    assert _probe(engine) == _probe(reference)


def test_fp8_sync_is_within_its_bound_and_the_check_can_fail():
    cfg = ModelConfig.preset("tiny", seed=9)
    trainer = Transformer(cfg)
    engine = EmbeddedEngine.from_preset("tiny", seed=0)
    rep = push_weights(engine, weights_of(trainer), cfg, RLConfig(sync_format="fp8"), "1")
    assert rep.bound_ok and 0 < rep.max_err < 0.1
    name = "layers.1.attn.wq_a.weight"
    assert not torch.equal(dict(engine.model.named_parameters())[name], dict(trainer.named_parameters())[name])
    with torch.no_grad():
        dict(engine.model.named_parameters())[name].mul_(1.2)              # outside e4m3's rounding
    assert _read_back(engine, weights_of(trainer), "fp8")[1] is False
    assert _read_back(engine, weights_of(trainer), "full")[1] is False


def test_the_trainer_through_fp8_qat_computes_what_the_fp8_engine_computes():
    """With FP8 sync the engine holds dequantised FP8 weights; the trainer's qat_rollout_fp8 forward (run_grpo turns
    it on for FP8 sync) quant-dequantises the same tensors the same way, so both produce the same logits. Without
    it the two differ by the quantisation error: the point is needed."""
    cfg = ModelConfig.preset("tiny", seed=9, dtype="fp32")
    trainer = Transformer(cfg)
    engine = EmbeddedEngine(Transformer(cfg.with_overrides(seed=0)))
    push_weights(engine, weights_of(trainer), cfg, RLConfig(sync_format="fp8"), "1")
    ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        served = engine.model(ids).logits
        plain = trainer(ids).logits
        qat = Transformer(cfg.with_overrides(qat_rollout_fp8=True), init=False)
        qat.load_state_dict(trainer.state_dict())
        through = qat(ids).logits
    assert torch.isfinite(served).all() and torch.isfinite(through).all()
    assert (through - served).abs().max() <= 1e-5
    assert (plain - served).abs().max() > 1e-3


def test_fp8_covers_exactly_the_release_fp8_and_fp4_weights():
    cfg = ModelConfig.preset("tiny")
    named = dict(sync_tensors(weights_of(Transformer(cfg)), cfg, "fp8"))
    for n, t in named.items():
        if n.endswith(".scale"):
            continue
        quantised = t.dtype == torch.float8_e4m3fn
        assert quantised == (cfg.storage_format(n) in ("fp8", "fp4")), n
        if quantised:
            assert n[:-len("weight")] + "scale" in named


def test_buckets_keep_fused_pairs_and_scales_together():
    cfg = ModelConfig.preset("tiny")
    named = sync_tensors(weights_of(Transformer(cfg)), cfg, "fp8")
    parts = buckets(named, 1)                     # every atomic group alone
    where = {n: i for i, b in enumerate(parts) for n, _ in b}
    assert where["layers.1.attn.wq_a.weight"] == where["layers.1.attn.wkv.weight"] == where["layers.1.attn.wq_a.scale"]
    assert where["layers.1.attn.compressor.wkv.weight"] == where["layers.1.attn.compressor.wgate.weight"]
    assert where["layers.1.attn.indexer.compressor.wkv.weight"] == where["layers.1.attn.indexer.compressor.wgate.weight"]
    assert where["layers.1.attn.compressor.wkv.weight"] != where["layers.1.attn.indexer.compressor.wkv.weight"]
    assert sorted(n for b in parts for n, _ in b) == sorted(n for n, _ in named)
    assert len(buckets(named, 1 << 40)) == 1
    assert _atomic_key("layers.0.ffn.experts.3.w1.weight") == "layers.0.ffn.experts.3.w1"


def test_the_training_batch_aligns_with_the_rollout():
    cfg = ModelConfig.preset("tiny")
    samples = [Sample([48, 49, 50], [50]), Sample([51, 52], [52])]
    routes = [np.full((3 + 2 - 1, 4, 2), 7, np.int32), np.full((2 + 1 - 1, 4, 2), 5, np.int32)]
    results = [GenerateResult([53, 54], {"output_token_logprobs": [[-1.0, 53, None], [-2.0, 54, None]],
                                         "routed_experts": routes[0], "prompt_tokens": 3}),
               GenerateResult([55], {"output_token_logprobs": [[-3.0, 55, None]], "routed_experts": routes[1],
                                     "prompt_tokens": 2})]
    b = build_batch(samples, results, torch.tensor([1.0, -1.0]), 5, cfg, replay=True)
    assert b["tokens"][0].tolist() == [48, 49, 50, 53, 54, 0] and b["tokens"][1].tolist() == [51, 52, 55, 0, 0, 0]
    # label position t predicts token t + 1: the response tokens sit at label positions p-1 .. p+n-2
    assert b["loss_mask"][0].tolist() == [False, False, True, True, False]
    assert b["loss_mask"][1].tolist() == [False, True, False, False, False]
    assert b["rollout_logp"][0, 2:4].tolist() == [-1.0, -2.0] and b["rollout_logp"][1, 1].item() == -3.0
    assert b["replay_mask"][0].tolist() == [True, True, True, True, False]
    assert b["replay_mask"][1].tolist() == [True, True, False, False, False]
    assert (b["routes"][0, :4] == 7).all() and (b["routes"][1, :2] == 5).all()
    with pytest.raises(ValueError, match="sample 0"):
        build_batch(samples, results, torch.tensor([1.0, -1.0]), 3, cfg, replay=False)


def test_the_metrics_max_lets_nan_through_in_any_order():
    from dsv4.rl.loop import _nanmax
    nan = float("nan")
    assert _nanmax([0.0, nan]) != _nanmax([0.0, nan])          # NaN, whichever comes first
    assert _nanmax([nan, 0.0]) != _nanmax([nan, 0.0])
    assert _nanmax([1.0, 3.0, 2.0]) == 3.0
