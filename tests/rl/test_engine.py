"""The embedded rollout engine (dsv4/rl/engine.py) on the tiny model, fp32 on CPU: what it returns equals what
the training model computes for the same tokens, sampling is reproducible, and weight updates are atomic."""
from __future__ import annotations

import math
import threading
import time

import pytest
import torch

from dsv4 import quant
from dsv4.megatron.launch import free_port
from dsv4.checkpoint import generate_checkpoint, official_to_alias
from dsv4.config import ModelConfig
from dsv4.model import Transformer
from dsv4.rl import decode, sync
from dsv4.rl.api import GenerateRequest, RequestError, SamplingParams
from dsv4.rl.engine import EmbeddedEngine, hash_uniform, scaled_logprobs

DIGITS = list(range(48, 58))


@pytest.fixture(scope="module")
def engine():
    return EmbeddedEngine.from_preset("tiny", seed=5)


def _req(prompt, n=6, **sp):
    return GenerateRequest(prompt, SamplingParams(max_new_tokens=n, **sp), return_logprob=True,
                           return_routed_experts=True)


def _training_view(model, prompt, output):
    """The training model's full forward over prompt + output: per-position log-softmax and native routes."""
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(ids).logits[0]
    routes = torch.stack([layer.ffn.last_expert_idx for layer in model.layers], 1)    # [S, L, k]
    return logits, routes


@pytest.mark.parametrize("sp", [dict(temperature=1.0), dict(temperature=0.7, allowed_token_ids=DIGITS),
                                dict(temperature=0.0)])
def test_logprobs_and_routes_equal_the_training_model(engine, sp):
    prompts = [list(range(40, 40 + n)) for n in (3, 11, 26)]      # crosses the window and compression blocks
    reqs = [_req(p, n=9 + i, sampling_seed=i, **sp) for i, p in enumerate(prompts)]
    for req, res in zip(reqs, engine.generate(reqs)):
        p, out = req.input_ids, res.output_ids
        assert len(out) == req.sampling_params.max_new_tokens and res.meta_info["finish_reason"]["type"] == "length"
        logits, routes = _training_view(engine.model, p, out)
        temp = torch.tensor([req.sampling_params.temperature])
        allowed = None
        if req.sampling_params.allowed_token_ids:
            allowed = torch.zeros(1, logits.shape[-1], dtype=torch.bool)
            allowed[0, DIGITS] = True
            assert set(out) <= set(DIGITS)
        lp = scaled_logprobs(logits[len(p) - 1:-1], temp, allowed).gather(-1, torch.tensor(out)[:, None])[:, 0]
        got = torch.tensor(res.logprobs)
        assert torch.isfinite(got).all()
        assert (got - lp).abs().max().item() <= 1e-5
        rec = torch.from_numpy(res.routed_experts)
        assert rec.shape == (len(p) + len(out) - 1, engine.cfg.n_layers, engine.cfg.n_activated_experts)
        assert torch.equal(rec.sort(-1).values, routes[:-1].sort(-1).values.int())
        if sp.get("temperature") == 0.0:    # greedy picks the argmax of the training logits
            assert out == logits[len(p) - 1:-1].argmax(-1).tolist()


def test_routed_experts_start_len_and_hash_layers(engine):
    req = _req(list(range(60, 75)), n=4, sampling_seed=3)
    req.routed_experts_start_len = 10
    full = engine.generate([_req(list(range(60, 75)), n=4, sampling_seed=3)])[0].routed_experts
    cut = engine.generate([req])[0].routed_experts
    assert cut.shape[0] == 15 + 4 - 1 - 10 and (cut == full[10:]).all()
    info = engine.model_info()
    assert info["hash_layers"] == [0]
    hashed = engine.model.layers[0].ffn.gate.tid2eid[torch.arange(60, 75)]
    assert torch.equal(torch.from_numpy(full[:15, 0]).sort(-1).values, hashed.sort(-1).values)


def test_sampling_is_seeded_and_batch_invariant(engine):
    a = _req([50, 51, 52], n=12, sampling_seed=7)
    alone = engine.generate([a])[0].output_ids
    crowd = engine.generate([_req([9] * 20, n=3, sampling_seed=1), a, _req([70, 71], n=15)])[1].output_ids
    other = engine.generate([_req([50, 51, 52], n=12, sampling_seed=8)])[0].output_ids
    assert alone == crowd and alone != other


def test_hash_uniform_is_uniform_and_deterministic():
    u = hash_uniform(torch.tensor([1, 2]), 5, 4096)
    assert torch.equal(u, hash_uniform(torch.tensor([1, 2]), 5, 4096))
    assert 0 < u.min() and u.max() < 1 and abs(u.mean().item() - 0.5) < 0.02
    assert not torch.equal(u[0], u[1])


def test_top_k_one_is_greedy_and_stops_end_a_sample(engine):
    greedy = engine.generate([_req([20, 21, 22], n=8, temperature=0.0)])[0].output_ids
    topk1 = engine.generate([_req([20, 21, 22], n=8, top_k=1, sampling_seed=4)])[0].output_ids
    assert greedy == topk1
    stop = greedy[3]
    res = engine.generate([_req([20, 21, 22], n=8, temperature=0.0, stop_token_ids=[stop])])[0]
    k = greedy.index(stop)
    assert res.output_ids == greedy[:k + 1]                    # the stop token is part of the output, as in SGLang
    assert res.meta_info["finish_reason"] == {"type": "stop", "matched": stop}
    assert len(res.meta_info["output_token_logprobs"]) == k + 1


def test_zero_new_tokens_and_the_context_limit(engine):
    res = engine.generate([_req([1, 2, 3], n=0)])[0]
    assert res.output_ids == [] and res.meta_info["finish_reason"] == {"type": "length", "length": 0}
    with pytest.raises(RequestError) as e:
        engine.generate([_req(list(range(250)), n=10)])
    assert e.value.field == "sampling_params.max_new_tokens" and "256" in str(e.value)
    with pytest.raises(RequestError) as e:
        engine.generate([_req([1, 600], n=1)])
    assert e.value.field == "input_ids"


def test_update_from_tensor_official_hf_and_fp8_names():
    eng = EmbeddedEngine.from_preset("tiny", seed=0)
    target = Transformer(ModelConfig.preset("tiny", seed=9))
    sd = dict(target.named_parameters())
    name = "layers.1.attn.wq_a.weight"
    q, s = quant.weight_quant_fp8(sd[name].detach())
    named = [(n, t.detach()) for n, t in sd.items() if n != name and not n.startswith("layers.2.")]
    named += [(official_to_alias(n, 4), t.detach()) for n, t in sd.items() if n.startswith("layers.2.")]
    named += [(official_to_alias(name, 4), q), (official_to_alias(name, 4).replace("weight", "weight_scale_inv"), s)]
    res = eng.update_weights_from_tensor(named, weight_version="3")
    assert res["success"], res["message"]
    got = dict(eng.model.named_parameters())
    for n, p in sd.items():
        if n != name:
            assert torch.equal(got[n], p), n
    assert torch.allclose(got[name], quant.weight_dequant_fp8(q, s, dtype=torch.float32))
    assert not torch.equal(got[name], sd[name])                  # it really went through FP8
    out = eng.generate([_req([5, 6, 7], n=2)])[0]
    assert out.meta_info["weight_version"] == "3" and eng.model_info()["weight_version"] == "3"


def test_a_bad_update_changes_nothing():
    eng = EmbeddedEngine.from_preset("tiny", seed=0)
    before = {n: p.clone() for n, p in eng.model.named_parameters()}
    bad = [("embed.weight", torch.zeros_like(before["embed.weight"])), ("layers.0.attn.nope.weight", torch.zeros(2))]
    res = eng.update_weights_from_tensor(bad, weight_version="1")
    assert not res["success"] and "layers.0.attn.nope.weight" in res["message"]
    res = eng.update_weights_from_tensor([("head.weight", torch.zeros(3, 3))])
    assert not res["success"] and "shape" in res["message"]
    res = eng.update_weights_from_tensor([("layers.1.attn.wq_a.weight", torch.zeros(64, 128, dtype=torch.float8_e4m3fn))])
    assert not res["success"] and "scale" in res["message"]
    assert all(torch.equal(p, before[n]) for n, p in eng.model.named_parameters())
    assert eng.weight_version == "default"


def test_update_from_disk(tmp_path):
    cfg = ModelConfig.preset("tiny", seed=4)
    generate_checkpoint(cfg, tmp_path / "ckpt")
    eng = EmbeddedEngine.from_preset("tiny", seed=0)
    res = eng.update_weights_from_disk(str(tmp_path / "ckpt"), weight_version="7")
    assert res["success"], res["message"]
    fresh = EmbeddedEngine.from_checkpoint(tmp_path / "ckpt", overrides={"dtype": "fp32"})
    for (n, p), (_, q) in zip(eng.model.named_parameters(), fresh.model.named_parameters()):
        assert torch.equal(p, q.to(p.dtype)), n
    assert eng.model_info()["model_path"] == str(tmp_path / "ckpt")
    res = eng.update_weights_from_disk(str(tmp_path / "nothing"))
    assert not res["success"] and "config.json" in res["message"]


def test_generation_waits_for_a_weight_update_and_sees_the_new_version():
    eng = EmbeddedEngine.from_preset("tiny", seed=0)
    eng.begin_weight_update()
    results = []
    t = threading.Thread(target=lambda: results.append(eng.generate([_req([1, 2], n=2)])[0]))
    t.start()
    time.sleep(0.3)
    assert t.is_alive() and not results, "generation ran during a weight update"
    eng.update_weights_from_tensor([("head.weight", torch.zeros_like(eng.model.head.weight))], weight_version="2")
    eng.end_weight_update()
    t.join(10)
    assert results[0].meta_info["weight_version"] == "2"
    # zero head: all logits 0, uniform distribution over the vocabulary
    assert abs(results[0].logprobs[0] + torch.log(torch.tensor(512.0)).item()) < 1e-5


def test_pause_abort_ends_the_batch_in_flight():
    eng = EmbeddedEngine.from_preset("tiny", seed=0)
    results = []
    t = threading.Thread(target=lambda: results.append(eng.generate([_req([1], n=250, ignore_eos=True)])[0]))
    t.start()
    time.sleep(0.3)
    eng.pause_generation(mode="abort")
    t.join(10)
    assert results[0].meta_info["finish_reason"]["type"] == "abort"
    assert 0 < len(results[0].output_ids) < 250
    eng.continue_generation()
    assert eng.health_generate()


def test_update_from_distributed_over_a_gloo_group():
    """The trainer side (rank 0) broadcasts from a thread of this process; the group is a real gloo group."""
    eng = EmbeddedEngine.from_preset("tiny", seed=0)
    port = free_port()
    new = torch.randn_like(eng.model.head.weight)
    q, s = quant.weight_quant_fp8(eng.model.layers[0].attn.wkv.weight.detach() * 2)

    def trainer():
        g = sync.weight_group("127.0.0.1", port, 0, 2, "gloo")
        for t in (new, q, s):
            sync.broadcast(g, t.contiguous())

    t = threading.Thread(target=trainer)
    t.start()
    assert eng.init_weights_update_group("127.0.0.1", port, 1, 2, backend="gloo")["success"]
    res = eng.update_weights_from_distributed(
        ["head.weight", "layers.0.attn.wkv.weight", "layers.0.attn.wkv.scale"],
        ["float32", "float8_e4m3fn", "float32"], [list(new.shape), list(q.shape), list(s.shape)],
        weight_version="5")
    t.join(10)
    assert res["success"], res["message"]
    assert torch.equal(eng.model.head.weight, new)
    assert torch.allclose(eng.model.layers[0].attn.wkv.weight, quant.weight_dequant_fp8(q, s, dtype=torch.float32))
    assert eng.weight_version == "5"


def test_a_reused_static_decoder_sees_each_weight_update():
    """The GPU path's shapes and reuse (cuda_graphs=True decodes the same way, eagerly, on a CPU): a decoder kept
    from a call before an update must decode the next call on the new weights, with no stale cache rows."""
    static = EmbeddedEngine.from_preset("tiny", ["index_topk=64"], seed=5, cuda_graphs=True)
    plain = EmbeddedEngine.from_preset("tiny", ["index_topk=64"], seed=5)
    reqs = [_req(list(range(50, 50 + n)), n=6, sampling_seed=i) for i, n in enumerate((4, 9, 13))]
    for version in ("1", "2", "3"):
        new = Transformer(ModelConfig.preset("tiny", seed=20 + int(version), index_topk=64))
        named = [(n, p.detach()) for n, p in new.named_parameters()]
        for eng in (static, plain):
            assert eng.update_weights_from_tensor(named, weight_version=version)["success"]
        a, b = plain.generate(reqs), static.generate(reqs)
        assert len(static._decoders) == 1                      # the same decoder, reused after each update
        for x, y in zip(a, b):
            assert x.output_ids == y.output_ids and y.meta_info["weight_version"] == version
            assert (torch.tensor(x.logprobs) - torch.tensor(y.logprobs)).abs().max().item() <= 1e-5
            assert (x.routed_experts == y.routed_experts).all()


def test_the_prepared_weights_follow_each_weight_update():
    """The GPU engine decodes from prepared weight forms (the routed experts stacked, `decode.Prepared`) that it
    refreshes after every update. Given the same forms on a CPU (fp32 head: the split head needs CUDA), it must
    decode each version's weights as the engine that reads the parameters does."""
    kw = dict(seed=5, cuda_graphs=True)
    prepared = EmbeddedEngine.from_preset("tiny", ["index_topk=64", "dtype=fp32", "fp32_gemm=fp32"], **kw)
    prepared._prepared = decode.Prepared(prepared.model)
    plain = EmbeddedEngine.from_preset("tiny", ["index_topk=64", "dtype=fp32", "fp32_gemm=fp32"], **kw)
    reqs = [_req(list(range(50, 50 + n)), n=6, sampling_seed=i) for i, n in enumerate((4, 9))]
    before = plain.generate(reqs)
    for version in ("1", "2"):
        new = Transformer(ModelConfig.preset("tiny", seed=20 + int(version), index_topk=64, dtype="fp32"))
        named = [(n, p.detach()) for n, p in new.named_parameters()]
        for eng in (prepared, plain):
            assert eng.update_weights_from_tensor(named, weight_version=version)["success"]
        a, b = plain.generate(reqs), prepared.generate(reqs)
        for x, y in zip(a, b):
            assert all(math.isfinite(v) for v in y.logprobs)
            assert x.output_ids == y.output_ids
            assert (torch.tensor(x.logprobs) - torch.tensor(y.logprobs)).abs().max().item() <= 1e-5
    assert [r.output_ids for r in before] != [r.output_ids for r in a]       # the updates changed the decoding


@pytest.mark.parametrize("field,value", [("temperature", float("nan")), ("temperature", float("inf")),
                                         ("temperature", -1.0), ("top_p", float("nan")), ("min_p", float("nan"))])
def test_non_finite_or_negative_sampling_values_are_refused(field, value):
    with pytest.raises(RequestError) as e:
        SamplingParams.parse({field: value})
    assert e.value.field == f"sampling_params.{field}"
