"""Cached decoding (dsv4/rl/decode.py) against a full recompute of the same model.

The sequences are long enough to cross the tiny model's window (8) many times and to complete several blocks
of every compression ratio (4 with the indexer's top-4 among up to 20 entries, and 16), so the ring, the
compressor's partial and overlapping blocks and the indexer's keys are all exercised. The step is the
sync-free one (position as a device tensor, masked writes, the grouped decode MoE), so these tests also hold it
to the full forward; further tests check what CUDA graphs rely on (a step repeated at one position, a cache
reused without a reset), the decode MoE against the model's, and the engine's static-shape path on a CPU.
"""
from __future__ import annotations

import pytest
import torch

from dsv4.config import ModelConfig
from dsv4.model import Transformer
from dsv4.rl import decode
from dsv4.rl.api import GenerateRequest, SamplingParams
from dsv4.rl.engine import BatchSampling, EmbeddedEngine, hash_uniform, sample, scaled_logprobs


def _incremental(model, ids):
    B, S = ids.shape
    cache = decode.DecodeCache(model, B, S)
    logits, routes = zip(*(decode.step(model, cache, ids[:, p], p) for p in range(S)))
    return torch.stack(logits, 1), torch.stack(routes, 1)


def _full(model, ids):
    with torch.no_grad():
        logits = model(ids).logits
    routes = torch.stack([layer.ffn.last_expert_idx.view(ids.shape[0], ids.shape[1], -1) for layer in model.layers], 2)
    return logits, routes


@pytest.mark.parametrize("S", [1, 5, 17, 80])
def test_cached_decoding_equals_full_recompute_fp32(S):
    cfg = ModelConfig.preset("tiny", seed=3)
    model = Transformer(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, S), generator=torch.Generator().manual_seed(S))
    inc, inc_routes = _incremental(model, ids)
    full, full_routes = _full(model, ids)
    assert torch.isfinite(inc).all()
    assert (inc - full).abs().max().item() < 5e-5, "cached logits drift from the full forward"
    # the same experts for every token (order within a top-k is free)
    assert torch.equal(inc_routes.sort(-1).values, full_routes.sort(-1).values)


def test_the_gpu_hyper_connection_forms_equal_the_full_forward(monkeypatch):
    """The split-K mixes GEMM and the unrolled C^T R that the step takes on CUDA (decode.GPU_HC), forced on the
    CPU: the same logits as the full forward (reference forms) to fp32 summation-order round-off, the same routes."""
    calls = []

    def gpu_forms(X):
        calls.append(X.shape)
        return decode.GPU_HC
    monkeypatch.setattr(decode, "hc_forms", gpu_forms)
    cfg = ModelConfig.preset("tiny", seed=4)
    model = Transformer(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    inc, inc_routes = _incremental(model, ids)
    full, full_routes = _full(model, ids)
    assert len(calls) == 40 * (2 * cfg.n_layers + 1)           # both sub-blocks of every layer and the head
    assert torch.isfinite(inc).all()
    assert (inc - full).abs().max().item() < 5e-5
    assert torch.equal(inc_routes.sort(-1).values, full_routes.sort(-1).values)


def test_the_gpu_forms_run_at_few_rows_only():
    """GPU_HC where the H200 measured it faster (batch 1), the reference forms where they were (batch 64)."""
    from types import SimpleNamespace
    X = lambda rows, cuda=True: SimpleNamespace(is_cuda=cuda, shape=(rows, 1, 4, 4096))     # noqa: E731
    assert decode.hc_forms(X(1)) is decode.GPU_HC and decode.hc_forms(X(decode.HC_SPLIT_ROWS)) is decode.GPU_HC
    assert decode.hc_forms(X(64)) is decode.REFERENCE_HC and decode.hc_forms(X(1, cuda=False)) is decode.REFERENCE_HC


def test_cached_decoding_with_the_qat_points_on():
    cfg = ModelConfig.preset("tiny", seed=1, qat_kv_fp8=True, qat_indexer_fp4=True)
    model = Transformer(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    inc, _ = _incremental(model, ids)
    full, _ = _full(model, ids)
    assert torch.isfinite(inc).all()
    # FP8/FP4 rounding can flip a value at a quantisation boundary; almost every logit agrees to round-off
    close = ((inc - full).abs() < 1e-3).float().mean().item()
    assert close > 0.99, f"only {close:.3f} of the logits agree"


def test_cached_decoding_bf16_within_bf16_tolerance():
    cfg = ModelConfig.preset("tiny", seed=2, dtype="bf16")
    model = Transformer(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 48), generator=torch.Generator().manual_seed(1))
    inc, _ = _incremental(model, ids)
    full, _ = _full(model, ids)
    assert torch.isfinite(inc).all()
    err = (inc - full).abs().mean().item() / full.abs().mean().item()
    assert err < 2e-2, f"relative error {err:.3g} beyond bf16 noise"


def test_a_sample_dropped_from_the_batch_leaves_the_others_unchanged():
    cfg = ModelConfig.preset("tiny", seed=0)
    model = Transformer(cfg)
    ids = torch.randint(0, cfg.vocab_size, (3, 30), generator=torch.Generator().manual_seed(2))
    cache = decode.DecodeCache(model, 3, 30)
    out = []
    for p in range(30):
        if p == 12:                       # sample 1 finished: keep rows 0 and 2
            cache.select(torch.tensor([0, 2]))
            ids = ids[[0, 2]]
        out.append(decode.step(model, cache, ids[:, p], p)[0])
    full, _ = _full(model, ids)
    assert (out[-1] - full[:, -1]).abs().max().item() < 5e-5


def test_a_device_tensor_position_and_the_graphed_wrapper_on_cpu_equal_the_full_forward():
    """GraphedStep on a CPU is its eager fallback: static id/position buffers, then the same step."""
    cfg = ModelConfig.preset("tiny", seed=4)
    model = Transformer(cfg)
    ids = torch.randint(0, cfg.vocab_size, (3, 41), generator=torch.Generator().manual_seed(4))
    dec = decode.GraphedStep(model, decode.DecodeCache(model, 3, 41))
    cache = decode.DecodeCache(model, 3, 41)
    out, ref = [], []
    for p in range(41):
        logits, routes = dec(ids[:, p], torch.tensor(p))
        assert not dec.graphed
        out.append(logits)
        ref.append(decode.step(model, cache, ids[:, p], p)[0])
    assert torch.equal(torch.stack(out, 1), torch.stack(ref, 1))
    full, _ = _full(model, ids)
    assert (torch.stack(out, 1) - full).abs().max().item() < 5e-5


def test_a_step_repeated_at_one_position_and_a_reused_cache_change_nothing():
    """What a CUDA graph relies on: the capture's warm-up steps run at the position they precede (so a step
    repeated with the same tokens must leave the cache as once), and the engine reuses a captured cache for
    the next batch without clearing it (so every row read must have been written in the same sequence)."""
    cfg = ModelConfig.preset("tiny", seed=6)
    model = Transformer(cfg)
    g = torch.Generator().manual_seed(6)
    first, second = (torch.randint(0, cfg.vocab_size, (2, 37), generator=g) for _ in range(2))
    cache = decode.DecodeCache(model, 2, 37)
    for p in range(37):                       # a used cache: every row holds something of `first`
        decode.step(model, cache, first[:, p], p)
    fresh = decode.DecodeCache(model, 2, 37)
    for p in range(37):
        again = decode.step(model, cache, second[:, p], p)[0]
        twice = decode.step(model, cache, second[:, p], p)[0]
        ref = decode.step(model, fresh, second[:, p], p)[0]
        assert torch.equal(again, ref) and torch.equal(twice, ref), p


def test_a_cache_larger_than_the_sequence_changes_nothing():
    """The engine rounds cache capacities up (power of two) to reuse CUDA graphs: more compressed entries than
    the sequence fills, more indexer keys to mask, the same result (where no two entries tie at the top-k
    boundary: which one top-k keeps can depend on the number it ranks)."""
    cfg = ModelConfig.preset("tiny", seed=7)
    model = Transformer(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 30), generator=torch.Generator().manual_seed(7))
    cache = decode.DecodeCache(model, 2, 64)
    inc = torch.stack([decode.step(model, cache, ids[:, p], p)[0] for p in range(30)], 1)
    full, _ = _full(model, ids)
    assert (inc - full).abs().max().item() < 5e-5


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("experts,k", [(8, 2), (32, 6), (256, 6)])
def test_the_decode_moe_equals_the_models_moe(dtype, experts, k):
    """At the smoke's 8 experts, an EP-8 rank's 32 and Flash's 256 with its top-6, for one token and 64 (grouped
    GEMMs over the chosen experts, or at 64 tokens of 8 and 32 experts every expert, see dense_from): the same routes
    and, row by row, MoE.forward's sum (the grouped form in its expert order: on a CPU bit for bit; the bound allows
    GEMM round-off on another grouping of rows and the dense form's reduction over experts)."""
    cfg = ModelConfig.preset("tiny", seed=3, dtype=dtype, n_routed_experts=experts, n_activated_experts=k)
    model = Transformer(cfg)
    g = torch.Generator().manual_seed(0)
    act = model.embed.weight.dtype
    for layer in model.layers:                # layer 0 hash-routed, the others scored
        ffn = layer.ffn
        for B, S in ((1, 1), (64, 1), (2, 9)):            # a decode batch of 1 and of 64, a few positions
            x = torch.randn(B, S, cfg.dim, generator=g).to(act)
            ids = torch.randint(0, cfg.vocab_size, (B, S), generator=g)
            with torch.no_grad():
                ref, ref_idx = ffn(x, ids), ffn.last_expert_idx
                y, idx = decode.moe(ffn, x, ids)
            assert torch.isfinite(y).all() and torch.equal(idx, ref_idx)
            tol = 2e-6 if dtype == "fp32" else 2e-2
            assert (y.float() - ref.float()).abs().max().item() <= tol * ref.float().abs().max().item()


def test_a_batch_that_reads_nearly_every_expert_runs_them_all():
    """From the batch at which top-k routing reads 90 % of the experts in expectation, the dense form (every expert
    on every row, weighted 0 where not chosen) runs instead of the grouped GEMMs; both are MoE.forward's sum."""
    assert [decode.dense_from(e, k) for e, k in ((8, 6), (8, 2), (32, 6), (256, 6))] == [2, 9, 12, 98]
    cfg = ModelConfig.preset("tiny", seed=5, n_routed_experts=32, n_activated_experts=6)
    model = Transformer(cfg)
    ffn = model.layers[2].ffn
    stack = decode.ExpertStack(ffn)
    g = torch.Generator().manual_seed(3)
    for T in (11, 12):                                    # the grouped form below dense_from, the dense one from it
        x = torch.randn(T, cfg.dim, generator=g)
        ids = torch.zeros(T, dtype=torch.long)
        with torch.no_grad():
            ref = ffn(x, ids)
            w, idx = ffn.gate(x, ids)
            sums = [f(x, w, idx, ffn.experts[0].swiglu_limit) + ffn.shared_experts(x) for f in
                    (stack.grouped_sum, stack.dense)]
            y, _ = decode.moe(ffn, x, ids, stack)
        assert torch.isfinite(y).all() and (y - ref).abs().max().item() <= 2e-6 * ref.abs().max().item()
        for z in sums:
            assert (z - ref).abs().max().item() <= 2e-6 * ref.abs().max().item()


def test_the_decode_moe_reads_only_the_chosen_experts():
    """Every expert no row chose holds NaN weights: had the step multiplied them by a zero routing weight (the
    decode MoE once ran every expert on every row), the output would be NaN. It is finite and MoE.forward's."""
    cfg = ModelConfig.preset("tiny", seed=3, n_routed_experts=256, n_activated_experts=6)
    model = Transformer(cfg)
    ffn = model.layers[1].ffn
    x = torch.randn(3, 1, cfg.dim, generator=torch.Generator().manual_seed(2))
    ids = torch.zeros(3, 1, dtype=torch.long)
    with torch.no_grad():
        ref = ffn(x, ids)
        chosen = set(ffn.last_expert_idx.flatten().tolist())
        assert len(chosen) <= 18
        for e, ex in enumerate(ffn.experts):
            if e not in chosen:
                for lin in (ex.w1, ex.w2, ex.w3):
                    lin.weight.fill_(float("nan"))
        for stack in (None, decode.ExpertStack(ffn)):
            y, _ = decode.moe(ffn, x, ids, stack)
            assert torch.isfinite(y).all()
            assert (y - ref).abs().max().item() <= 2e-6 * ref.abs().max().item()


def test_the_decode_moe_sums_a_repeated_expert_like_the_models_moe():
    """A row routed twice to one expert (here by a replay) passes through it twice, in MoE.forward and here."""
    cfg = ModelConfig.preset("tiny", seed=3)
    model = Transformer(cfg)
    ffn = model.layers[1].ffn
    x = torch.randn(5, 1, cfg.dim, generator=torch.Generator().manual_seed(1))
    ids = torch.zeros(5, 1, dtype=torch.long)
    ffn.gate.replay = (torch.tensor([[3, 3], [0, 5], [7, 7], [1, 2], [6, 6]]), torch.ones(5, dtype=torch.bool))
    try:
        with torch.no_grad():
            ref = ffn(x, ids)
            y, idx = decode.moe(ffn, x, ids)
    finally:
        ffn.gate.replay = None
    assert torch.equal(idx, ffn.last_expert_idx)
    assert torch.isfinite(y).all() and (y - ref).abs().max().item() <= 2e-6 * ref.abs().max().item()


def test_sampling_takes_the_position_as_a_device_tensor():
    seeds = torch.tensor([11, 12, 13])
    assert torch.equal(hash_uniform(seeds, torch.tensor(9), 512), hash_uniform(seeds, 9, 512))
    sp = BatchSampling([SamplingParams(temperature=1.0, top_p=0.9), SamplingParams(temperature=0.0),
                        SamplingParams(temperature=0.5, top_k=5)], [11, 12, 13], 512, "cpu")
    logp = torch.log_softmax(torch.randn(3, 512, generator=torch.Generator().manual_seed(2)), -1)
    assert torch.equal(sample(logp, sp, torch.tensor(9)), sample(logp, sp, 9))


def test_the_engines_static_shape_path_on_cpu_equals_the_default():
    """cuda_graphs=True on a CPU: what the GPU path does around the graph (rows rounded up to a power of two,
    the capacity too, finished rows decoding on, the decoder kept and reused for the next call), eagerly.
    index_topk is raised past the entry count: the tiny indexer's 4 ReLU heads often score entries exactly 0,
    and which of two tied entries top-k keeps depends on how many entries it ranks, i.e. on the capacity (the
    full forward ranks S // 4): with every visible entry selected the comparison is free of that."""
    plain = EmbeddedEngine.from_preset("tiny", ["index_topk=64"], seed=5)
    static = EmbeddedEngine.from_preset("tiny", ["index_topk=64"], seed=5, cuda_graphs=True)
    reqs = [GenerateRequest(list(range(40, 40 + n)), SamplingParams(max_new_tokens=m, sampling_seed=i, **sp),
                            return_logprob=True, return_routed_experts=True)
            for i, (n, m, sp) in enumerate([(3, 12, {}), (17, 5, {"temperature": 0.0}), (9, 9, {"top_k": 4}),
                                            (1, 1, {"temperature": 0.5})])]
    greedy = plain.generate([GenerateRequest([20, 21, 22], SamplingParams(max_new_tokens=8, temperature=0.0))])
    stop = greedy[0].output_ids[3]
    reqs.append(GenerateRequest([20, 21, 22], SamplingParams(max_new_tokens=8, temperature=0.0,
                                                             stop_token_ids=[stop]), return_logprob=True))
    decoders = []
    for attempt in range(2):                  # the second call reuses the first call's decoder
        a, b = plain.generate(reqs), static.generate(reqs)
        assert list(static._decoders) == [(8, 32)]          # 5 samples -> 8 rows, 22 tokens -> 32
        decoders.append(static._decoders[(8, 32)])
        for x, y in zip(a, b):
            assert x.output_ids == y.output_ids
            assert x.meta_info["finish_reason"] == y.meta_info["finish_reason"]
            assert (torch.tensor(x.logprobs) - torch.tensor(y.logprobs)).abs().max().item() <= 1e-5
            if x.routed_experts is not None:
                assert (x.routed_experts == y.routed_experts).all()
    assert decoders[0] is decoders[1] and not plain._decoders
    assert b[4].meta_info["finish_reason"] == {"type": "stop", "matched": stop}
    assert b[4].output_ids == greedy[0].output_ids[:greedy[0].output_ids.index(stop) + 1]


def test_a_failed_capture_warns_and_decodes_eagerly():
    """Forced onto the capture path on a CPU, the capture fails (no CUDA): a warning, then the eager step, whose
    result is the reference's; while the failure is recorded no new decoder tries to capture."""
    cfg = ModelConfig.preset("tiny", seed=8)
    model = Transformer(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(8))
    dec = decode.GraphedStep(model, decode.DecodeCache(model, 2, 12))
    ref = decode.DecodeCache(model, 2, 12)
    dec.use_graph = True
    try:
        with pytest.warns(RuntimeWarning, match="capture of the decode step failed"):
            first = dec(ids[:, 0], 0)[0]
        assert decode.GraphedStep.capture_failed and not dec.use_graph and not dec.graphed
        assert not decode.GraphedStep(model, decode.DecodeCache(model, 2, 12)).use_graph
        out = [first] + [dec(ids[:, p], p)[0] for p in range(1, 12)]
    finally:
        decode.GraphedStep.capture_failed = None
    expect = [decode.step(model, ref, ids[:, p], p)[0] for p in range(12)]
    assert torch.equal(torch.stack(out), torch.stack(expect))


def test_the_hadamard_matrix_is_cached_per_device():
    import dsv4.model as M
    x = torch.randn(3, 64)
    assert M._hadamard_matrix(64, x.device) is M._hadamard_matrix(64, x.device)   # no copy per call
    h = M._hadamard_matrix(64, x.device)
    assert torch.allclose(h @ h.t(), torch.eye(64), atol=1e-6)
    assert torch.allclose(M.hadamard(M.hadamard(x)), x, atol=1e-5)


def test_a_step_and_sampling_use_no_op_that_waits_for_the_device():
    """On a GPU these ops make the host wait (a value read back, a data-dependent shape) or copy host memory in
    (a tensor built from Python data), which a CUDA graph capture refuses; on a CPU the dispatcher still
    names them. Traced: one decode step past the window and a block end, with every sampling filter on."""
    from torch.utils._python_dispatch import TorchDispatchMode

    waits = {"_local_scalar_dense", "nonzero", "_unique2", "unique_dim", "unique_consecutive", "masked_select",
             "lift_fresh", "repeat_interleave", "_assert_async", "equal"}

    class Trace(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(func.__name__.split(".")[0])
            return func(*args, **(kwargs or {}))

    cfg = ModelConfig.preset("tiny", seed=9)
    model = Transformer(cfg)
    ids = torch.randint(0, cfg.vocab_size, (3, 16), generator=torch.Generator().manual_seed(9))
    cache = decode.DecodeCache(model, 3, 16)
    for p in range(15):
        decode.step(model, cache, ids[:, p], p)
    sp = BatchSampling([SamplingParams(temperature=1.0, top_p=0.9, top_k=7, min_p=0.01, allowed_token_ids=[1, 2, 3]),
                        SamplingParams(temperature=0.0), SamplingParams(temperature=0.6)], [1, 2, 3], 512, "cpu")
    pos = decode.as_position(15, "cpu")
    with Trace() as trace:                    # position 15: ends a block of 4 and of 16
        logits, _ = decode.step(model, cache, ids[:, 15], pos)
        lp = scaled_logprobs(logits, sp.temperature, sp.allowed)
        sample(lp, sp, pos + 1)
    assert trace.seen and not waits & set(trace.seen), waits & set(trace.seen)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_stack_shares_the_experts_storage_and_follows_their_updates(dtype):
    """The engine's stacked experts (its `Prepared` weights) give the decode MoE's result, and an expert changed in
    place is decoded with its new values: at once where the experts' parameters are views of the stack (no QAT
    point: no second copy), after `refresh` where the stack is a copy through the MXFP4 QAT point."""
    for qat in (False, True):
        cfg = ModelConfig.preset("tiny", seed=3, dtype=dtype, mxfp4_experts=qat)
        model = Transformer(cfg)
        g = torch.Generator().manual_seed(0)
        act = model.embed.weight.dtype
        tol = 2e-6 if dtype == "fp32" else 2e-2
        for layer in model.layers:
            ffn = layer.ffn
            ref_x = torch.randn(7, 1, cfg.dim, generator=g).to(act)
            ids = torch.randint(0, cfg.vocab_size, (7, 1), generator=g)
            with torch.no_grad():
                ref, ref_idx = decode.moe(ffn, ref_x, ids)
                stack = decode.ExpertStack(ffn)
                assert stack.shared() == (not qat)
                y, idx = decode.moe(ffn, ref_x, ids, stack)
                assert torch.isfinite(y).all() and torch.equal(idx, ref_idx)
                assert (y.float() - ref.float()).abs().max().item() <= tol * ref.float().abs().max().item()
                for e in ffn.experts:
                    e.w2.weight.mul_(-3.0)
                before = decode.moe(ffn, ref_x, ids, stack)[0]
                stack.refresh()
                after, ref2 = decode.moe(ffn, ref_x, ids, stack)[0], decode.moe(ffn, ref_x, ids)[0]
            scale = ref2.float().abs().max().item()
            stale = (before.float() - ref2.float()).abs().max().item()
            assert stale > 0.5 * scale if qat else stale <= tol * scale      # a copy lags until refreshed
            assert (after.float() - ref2.float()).abs().max().item() <= tol * scale
            ffn.experts[0].w1.weight.data = ffn.experts[0].w1.weight.detach().clone()   # new storage: no view
            assert not stack.shared()
            stack.refresh()
            assert stack.shared() == (not qat)
