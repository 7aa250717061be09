import pytest

from dsv4.config import ModelConfig, parse_overrides


def test_flash_and_pro_presets():
    f = ModelConfig.preset("flash")
    assert len(f.compress_ratios) == 44 and f.compress_ratios[:4] == [0, 0, 4, 128] and f.compress_ratios[-2:] == [4, 0]
    assert [f.attn_kind(i) for i in (0, 1, 2, 3, 42, 43)] == ["window", "window", "csa", "hca", "csa", "window"]
    assert 283e9 < f.n_params() - 7e9 < 286e9 and 12e9 < f.n_params(active=True) < 15e9   # 284B / 13B (+ MTP)
    p = ModelConfig.preset("pro")
    assert len(p.compress_ratios) == 62 and p.compress_ratios[:2] == [128, 128] and p.n_layers == 61
    assert 1.5e12 < p.n_params() < 1.7e12 and p.compress_rope_theta == 160000.0


def test_4layer_and_tiny():
    four = ModelConfig.preset("4layer")
    assert four.n_layers == 4 and four.compress_ratios == [0, 0, 4, 128, 0] and four.dim == 4096
    tiny = ModelConfig.preset("tiny")
    assert tiny.vocab_size == 512 and set(tiny.compress_ratios) == {0, 4, 16} and tiny.n_hash_layers == 1
    assert tiny.dim % 128 == 0 and tiny.index_head_dim & (tiny.index_head_dim - 1) == 0


def test_hf_round_trip():
    for name in ("flash", "pro", "tiny"):
        cfg = ModelConfig.preset(name)
        hf = cfg.to_hf_config()
        assert hf["hidden_size"] == cfg.dim and hf["num_experts_per_tok"] == cfg.n_activated_experts
        assert hf["rope_scaling"]["factor"] == cfg.rope_factor and hf["sliding_window"] == cfg.window_size
        back = ModelConfig.from_hf_config(hf, dtype=cfg.dtype, max_seq_len=cfg.max_seq_len)
        assert back == cfg


def test_overrides():
    cfg = ModelConfig.preset("flash").with_overrides("n_routed_experts=16 n_layers=2", "qat_kv_fp8=true")
    assert cfg.n_routed_experts == 16 and cfg.n_layers == 2 and cfg.qat_kv_fp8 is True
    assert cfg.compress_ratios == [0, 0, 0]                                  # cut, MTP entry kept
    longer = ModelConfig.preset("4layer").with_overrides("n_layers=6")
    assert longer.compress_ratios == [0, 0, 4, 128, 4, 128, 0]
    assert ModelConfig.preset("tiny").with_overrides("compress_ratios=[0,4,0]", n_layers=2).compress_ratios == [0, 4, 0]
    assert parse_overrides("a=1 b=x") == {"a": "1", "b": "x"}
    with pytest.raises(KeyError, match="unknown model config field"):
        ModelConfig.preset("tiny").with_overrides("nope=1")
    with pytest.raises(ValueError, match="expected a int"):
        ModelConfig.preset("tiny").with_overrides("n_layers=two")
    with pytest.raises(ValueError, match="key=value"):
        parse_overrides("n_layers")
    with pytest.raises(ValueError, match="compress_ratios has 3 entries"):
        ModelConfig.preset("tiny").with_overrides(compress_ratios=[0, 4, 0])
    with pytest.raises(KeyError, match="unknown model preset"):
        ModelConfig.preset("huge")


def test_storage_formats():
    cfg = ModelConfig.preset("flash")
    assert cfg.storage_format("layers.0.attn.wq_a.weight") == "fp8"
    assert cfg.storage_format("layers.0.ffn.experts.3.w2.weight") == "fp4"
    assert cfg.storage_format("layers.0.ffn.shared_experts.w2.weight") == "fp8"
    assert cfg.storage_format("layers.2.attn.indexer.weights_proj.weight") == "bf16"
    assert cfg.storage_format("layers.2.attn.compressor.wkv.weight") == "bf16"
    assert cfg.storage_format("layers.0.attn.attn_sink") == "fp32"
    assert cfg.storage_format("mtp.0.e_proj.weight") == "fp8" and cfg.storage_format("head.weight") == "bf16"
