"""CPU tests of the DeepSeek-V4 reference model (tiny preset, fp32)."""
import pytest
import torch
import torch.nn.functional as F

from dsv4.config import ModelConfig
from dsv4.model import (Transformer, compress, compress_topk_idxs, hc_post, hc_pre, rope_cos_sin, rope_freqs,
                        rope_tail, sinkhorn, window_topk_idxs, layer_rope_freqs, route)

S = 48  # >= window (8) and the largest ratio (16); 12 ratio-4 entries, so top-4 selection is non-trivial


@pytest.fixture(scope="module")
def cfg():
    return ModelConfig.preset("tiny")


@pytest.fixture(scope="module")
def model(cfg):
    torch.manual_seed(0)
    return Transformer(cfg).eval()


@pytest.fixture(scope="module")
def ids(cfg):
    return torch.randint(0, cfg.vocab_size, (2, S), generator=torch.Generator().manual_seed(1))


def test_tiny_exercises_every_path(cfg, model):
    kinds = {cfg.attn_kind(i) for i in range(cfg.n_layers + cfg.n_mtp_layers)}
    assert kinds == {"window", "csa", "hca"}
    hashed = [blk.ffn.gate.hash for blk in model.layers]
    assert any(hashed) and not all(hashed) and not model.mtp[0].ffn.gate.hash
    assert model.layers[2].attn.ratio not in (0, 4) and not hasattr(model.layers[2].attn, "indexer")
    assert hasattr(model.layers[1].attn, "indexer")


def test_state_dict_matches_config_inventory(cfg, model):
    assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == cfg.param_shapes()


def test_official_param_dtypes():
    m = Transformer(ModelConfig.preset("tiny", dtype="bf16"), init=False)
    sd = dict(m.named_parameters())
    fp32 = ["layers.0.attn.attn_sink", "layers.0.hc_attn_fn", "layers.1.attn.compressor.ape",
            "layers.1.attn.compressor.wkv.weight", "layers.0.attn_norm.weight", "head.weight", "layers.1.ffn.gate.bias"]
    assert all(sd[n].dtype == torch.float32 for n in fp32)
    assert sd["layers.0.attn.wq_a.weight"].dtype == torch.bfloat16 and sd["embed.weight"].dtype == torch.bfloat16
    assert sd["layers.0.ffn.gate.tid2eid"].dtype == torch.int32 and not sd["layers.0.ffn.gate.tid2eid"].requires_grad


def test_forward_shapes_and_finite(cfg, model, ids):
    out = model(ids)
    assert out.logits.shape == (2, S, cfg.vocab_size) and out.logits.dtype == torch.float32
    assert len(out.mtp_logits) == 1 and out.mtp_logits[0].shape == (2, S - 1, cfg.vocab_size)
    assert torch.isfinite(out.logits).all() and torch.isfinite(out.mtp_logits[0]).all()
    assert out.indexer_loss is None
    assert 0.3 < out.logits.std() < 10  # neither collapsed nor exploded at init


def test_init_is_deterministic(cfg):
    a, b = Transformer(cfg).state_dict(), Transformer(cfg).state_dict()
    c = Transformer(cfg.with_overrides(seed=1)).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["layers.0.attn.wq_a.weight"], c["layers.0.attn.wq_a.weight"])


@pytest.mark.parametrize("layer", [0, 1, 2], ids=["window", "csa-ratio4-indexer", "hca-ratio16"])
def test_attention_is_causal_per_type(cfg, model, layer):
    attn = model.layers[layer].attn
    x = torch.randn(2, S, cfg.dim, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        base = attn(x)
        for t in (0, 3, 7, 14, 15, 16, 31, S - 2):
            x2 = x.clone()
            x2[:, t + 1] += torch.randn(cfg.dim, generator=torch.Generator().manual_seed(t))
            out = attn(x2)
            assert torch.isfinite(out).all()
            torch.testing.assert_close(out[:, :t + 1], base[:, :t + 1], rtol=0, atol=1e-5)
            assert (out[:, t + 1] - base[:, t + 1]).abs().max() > 1e-4   # the change is seen at t+1


def test_model_and_mtp_are_causal(cfg, model, ids):
    with torch.no_grad():
        base = model(ids)
        for t in (2, 15, 33):
            ids2 = ids.clone()
            ids2[:, t + 1] = (ids2[:, t + 1] + 7) % cfg.vocab_size
            out = model(ids2)
            torch.testing.assert_close(out.logits[:, :t + 1], base.logits[:, :t + 1], rtol=0, atol=1e-5)
            # MTP position p reads token p+1, so a change at t+1 may reach MTP position t but not t-1
            torch.testing.assert_close(out.mtp_logits[0][:, :t], base.mtp_logits[0][:, :t], rtol=0, atol=1e-5)
            assert (out.logits[:, t + 1] - base.logits[:, t + 1]).abs().max() > 1e-4


def test_every_parameter_gets_a_finite_nonzero_gradient(cfg, ids):
    model = Transformer(cfg)
    out = model(ids, indexer_loss=True)
    V = cfg.vocab_size
    loss = F.cross_entropy(out.logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1)) \
        + F.cross_entropy(out.mtp_logits[0][:, :-1].reshape(-1, V), ids[:, 2:].reshape(-1)) + out.indexer_loss
    loss.backward()
    frozen = sorted(n for n, p in model.named_parameters() if not p.requires_grad)
    assert all(n.endswith(("gate.tid2eid", "gate.bias")) for n in frozen) and frozen
    bad = [n for n, p in model.named_parameters() if p.requires_grad
           and (p.grad is None or not torch.isfinite(p.grad).all() or p.grad.abs().max() == 0)]
    assert not bad, f"parameters without a finite non-zero gradient: {bad}"


def test_indexer_gets_gradient_only_from_its_loss(cfg, ids):
    model = Transformer(cfg)
    out = model(ids, indexer_loss=True)
    assert torch.isfinite(out.indexer_loss) and out.indexer_loss >= 0
    out.indexer_loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert grads["layers.1.attn.indexer.wq_b.weight"].abs().max() > 0
    assert grads["layers.1.attn.indexer.compressor.wkv.weight"].abs().max() > 0
    assert grads["layers.1.attn.wq_a.weight"] is None       # x and qr are detached into the indexer
    model.zero_grad()
    model(ids).logits.sum().backward()                     # LM loss: nothing reaches the indexer via top-k
    assert model.layers[1].attn.indexer.wq_b.weight.grad is None


def test_sinkhorn_is_doubly_stochastic():
    """Columns are exact after the final column step; rows converge with the iteration count (20 official
    iterations bring unit-scale logits to ~1e-4; strongly skewed logits need more)."""
    logits = torch.randn(256, 4, 4, generator=torch.Generator().manual_seed(0))
    for scale, iters, row_tol in ((1.0, 20, 5e-4), (2.0, 500, 1e-4)):
        c = sinkhorn(logits * scale, iters=iters, eps=1e-6)
        assert torch.isfinite(c).all() and (c > 0).all()
        torch.testing.assert_close(c.sum(-2), torch.ones(256, 4), rtol=0, atol=1e-5)
        torch.testing.assert_close(c.sum(-1), torch.ones(256, 4), rtol=0, atol=row_tol)


def test_hc_post_orientation_is_comb_transposed():
    g = torch.Generator().manual_seed(0)
    f, R = torch.randn(1, 1, 8, generator=g), torch.randn(1, 1, 4, 8, generator=g)
    post = torch.rand(1, 1, 4, generator=g)
    comb = torch.rand(1, 1, 4, 4, generator=g)
    out = hc_post(f, R, post, comb)
    for k in range(4):
        want = post[0, 0, k] * f[0, 0] + sum(comb[0, 0, j, k] * R[0, 0, j] for j in range(4))
        torch.testing.assert_close(out[0, 0, k], want)
    assert not torch.allclose(out, hc_post(f, R, post, comb.transpose(-1, -2)))


def test_hc_pre_identity_streams():
    """With identical streams the layer input is (sum_j pre_j) x and post is 2*sigmoid(...) in (0, 2)."""
    d, hc = 16, 4
    X = torch.randn(1, 3, 1, d).repeat(1, 1, hc, 1)
    fn, scale, base = torch.randn(24, hc * d), torch.ones(3), torch.zeros(24)
    x, post, comb = hc_pre(X, fn, scale, base, hc, 20, 1e-6, 1e-6)
    mix = (X.flatten(2) @ fn.T) * torch.rsqrt(X.flatten(2).pow(2).mean(-1, keepdim=True) + 1e-6)
    pre = torch.sigmoid(mix[..., :hc]) + 1e-6
    torch.testing.assert_close(x, pre.sum(-1, keepdim=True) * X[:, :, 0])
    assert ((post > 0) & (post < 2)).all() and comb.shape == (1, 3, 4, 4)


def test_rope_interleaved_and_inverse():
    freqs = rope_freqs(8, 10000.0)
    cos, sin = rope_cos_sin(freqs, torch.arange(5))
    x = torch.randn(5, 12)
    y = rope_tail(x.unsqueeze(0), cos, sin)[0]
    assert torch.equal(y[:, :4], x[:, :4])                          # nope dims untouched
    z = torch.view_as_complex(x[:, 4:].reshape(5, 4, 2).contiguous()) * torch.polar(torch.ones(5, 4), torch.outer(torch.arange(5.), freqs))
    torch.testing.assert_close(y[:, 4:], torch.view_as_real(z).flatten(-2))
    torch.testing.assert_close(rope_tail(rope_tail(x[None], cos, sin), cos, sin, inverse=True)[0], x, atol=1e-6, rtol=0)


def test_yarn_only_on_compressed_layers(cfg):
    window, compressed = layer_rope_freqs(cfg, 0), layer_rope_freqs(cfg, 1)
    torch.testing.assert_close(window, rope_freqs(cfg.rope_head_dim, cfg.rope_theta))
    plain = rope_freqs(cfg.rope_head_dim, cfg.compress_rope_theta)
    assert compressed[0] == plain[0] and compressed[-1] < plain[-1]   # high frequencies kept, low ones stretched
    torch.testing.assert_close(compressed[-1], plain[-1] / cfg.rope_factor)


def test_window_and_compressed_indices():
    w = window_topk_idxs(6, 3)
    assert w.tolist() == [[0, -1, -1], [0, 1, -1], [0, 1, 2], [1, 2, 3], [2, 3, 4], [3, 4, 5]]
    c = compress_topk_idxs(9, 4, offset=100)
    assert c[2].tolist() == [-1, -1] and c[3].tolist() == [100, -1] and c[8].tolist() == [100, 101]


def test_compressor_overlap_and_ape():
    """Ratio 4 pools 8 slots: the first channel-half of the previous block and the second of the current one."""
    B, m, d = 1, 4, 3
    a = torch.randn(B, 3 * m, 2 * d)
    g = torch.zeros(B, 3 * m, 2 * d)
    out = compress(a, g, torch.zeros(m, 2 * d), m, d)               # zero gates: plain means
    blocks = a.view(B, 3, m, 2 * d)
    torch.testing.assert_close(out[:, 0], blocks[:, 0, :, d:].mean(1))   # block 0: previous half is masked
    torch.testing.assert_close(out[:, 1], torch.cat([blocks[:, 0, :, :d], blocks[:, 1, :, d:]], 1).mean(1))
    out16 = compress(a[..., :d], g[..., :d], torch.zeros(6, d), 6, d)   # no overlap for other ratios
    torch.testing.assert_close(out16[:, 1], a[:, 6:12, :d].mean(1))


def test_router_bias_steers_selection_not_weights():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    w, idx = route(logits, "sqrtsoftplus", 2, 1.5)
    assert sorted(idx[0].tolist()) == [2, 3]
    torch.testing.assert_close(w.sum(-1), torch.tensor([1.5]))
    w2, idx2 = route(logits, "sqrtsoftplus", 2, 1.5, bias=torch.tensor([10.0, 10.0, 0, 0]))
    assert sorted(idx2[0].tolist()) == [0, 1]
    s = F.softplus(logits[0, :2]).sqrt()
    torch.testing.assert_close(w2[0].sort().values, (s / s.sum() * 1.5).sort().values)
    _, idx3 = route(logits, "sqrtsoftplus", 2, 1.5, hash_idx=torch.tensor([[0, 1]]))
    assert idx3.tolist() == [[0, 1]]


def test_hash_layer_routes_by_token_id(model, ids):
    moe = model.layers[0].ffn
    x = torch.randn(2, S, model.cfg.dim)
    moe(x, ids)
    assert torch.equal(moe.last_expert_idx, model.layers[0].ffn.gate.tid2eid[ids.reshape(-1)].long())


def test_shared_expert_clamp_flag(cfg):
    on = Transformer(cfg)
    off = Transformer(cfg.with_overrides(shared_expert_clamp=False))
    x = torch.randn(5, cfg.dim) * 50                                # big enough to hit the +-10 clamp
    with torch.no_grad():
        assert not torch.allclose(on.layers[0].ffn.shared_experts(x), off.layers[0].ffn.shared_experts(x))
    assert off.layers[0].ffn.experts[0].swiglu_limit == cfg.swiglu_limit   # routed experts always clamp


@pytest.mark.parametrize("flag", ["qat_kv_fp8", "qat_indexer_fp4", "fp8_gemm_inputs", "mxfp4_experts"])
def test_each_qat_point_switches_and_passes_gradients(cfg, model, ids, flag):
    m = Transformer(cfg.with_overrides(**{flag: True}))
    out = m(ids, indexer_loss=True)
    assert torch.isfinite(out.logits).all()
    with torch.no_grad():
        ref = model(ids)
    diff = (out.logits - ref.logits).abs().max()
    if flag == "qat_indexer_fp4":   # changes only which compressed entries are selected (may coincide)
        assert torch.isfinite(out.indexer_loss)
    else:
        assert diff > 1e-4, f"{flag} had no effect"
    (out.logits.sum() + out.indexer_loss).backward()
    assert torch.isfinite(m.layers[1].attn.wq_b.weight.grad).all() and m.layers[1].attn.wq_b.weight.grad.abs().max() > 0


def test_bf16_model_runs(cfg, ids):
    m = Transformer(cfg.with_overrides(dtype="bf16"))
    out = m(ids)
    assert torch.isfinite(out.logits).all()


@pytest.mark.parametrize("seq", [1, 2, 3, 5, 17])
def test_short_sequences(cfg, model, seq):
    """Fewer tokens than the window or a compression block: no compressed entries yet, still finite."""
    ids = torch.randint(0, cfg.vocab_size, (1, seq), generator=torch.Generator().manual_seed(seq))
    out = model(ids, indexer_loss=True)
    assert out.logits.shape == (1, seq, cfg.vocab_size) and torch.isfinite(out.logits).all()
    assert len(out.mtp_logits) == (1 if seq > 1 else 0)
    assert out.indexer_loss is None or torch.isfinite(out.indexer_loss)
