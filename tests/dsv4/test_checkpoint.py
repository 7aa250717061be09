"""Checkpoint names, the released-layout generator, the streaming dequantizer and loading."""
import json

import pytest
import torch

from dsv4 import checkpoint as ck
from dsv4 import quant
from dsv4.config import ModelConfig
from dsv4.model import Transformer

TINY = ModelConfig.preset("tiny")


@pytest.fixture(scope="module")
def bf16(generated, tmp_path_factory):
    d = tmp_path_factory.mktemp("bf16") / "tiny-bf16"
    ck.dequantize_checkpoint(generated, d, shard_bytes=900_000)
    return d


# ------------------------------------------------------------------------------------------- names
def test_name_map_round_trips_on_full_flash():
    cfg = ModelConfig.preset("flash")
    names = ck.name_map(cfg)
    assert len(names) == 69187 and len(cfg.param_shapes()) == 35020
    assert len(set(names.values())) == len(names)                      # aliases are unique
    bad = [n for n, h in names.items() if ck.alias_to_official(h, cfg.n_layers) != n]
    assert not bad, bad[:5]
    assert names["layers.0.attn.wq_a.scale"] == "model.layers.0.self_attn.wq_a.weight_scale_inv"
    assert names["layers.0.ffn.gate.tid2eid"] == "model.layers.0.mlp.topk.tid2eid"
    assert names["layers.3.ffn.gate.bias"] == "model.layers.3.mlp.gate.e_score_correction_bias"
    assert names["layers.5.ffn.experts.7.w2.weight"] == "model.layers.5.mlp.experts.7.down_proj.weight"
    assert names["layers.1.ffn_norm.weight"] == "model.layers.1.post_attention_layernorm.weight"
    assert names["mtp.0.norm.weight"] == "model.layers.43.shared_head.norm.weight"
    assert names["mtp.0.e_proj.scale"] == "model.layers.43.e_proj.weight_scale_inv"
    assert names["embed.weight"] == "model.embed_tokens.weight" and names["head.weight"] == "lm_head.weight"
    assert names["hc_head_fn"] == "model.hc_head_fn"


def test_flash_release_size():
    """The released Flash checkpoint is ~149 GiB (FP8 + MXFP4) and ~542 GiB in BF16."""
    cfg = ModelConfig.preset("flash")
    size = sum(ck._nbytes(d, s) for _, d, s in ck.checkpoint_entries(cfg))
    assert 147 << 30 < size < 151 << 30
    assert 535 << 30 < 2 * cfg.n_params() < 550 << 30


def test_unknown_names_raise():
    with pytest.raises(KeyError):
        ck.official_to_alias("foo.bar", 43)
    with pytest.raises(KeyError):
        ck.alias_to_official("model.foo", 43)


# ------------------------------------------------------------------------------------------- generator
def test_generated_layout_matches_release(generated):
    files = {p.name for p in generated.iterdir()}
    assert {"config.json", "tokenizer.json", "tokenizer_config.json", ck.INDEX}.issubset(files)
    assert (generated / "encoding" / "encoding_dsv4.py").is_file()
    index = json.loads((generated / ck.INDEX).read_text())
    assert len(set(index["weight_map"].values())) > 1                    # really sharded
    header = {}
    for f in set(index["weight_map"].values()):
        header.update(ck.read_header(generated / f)[0])
    assert set(header) == set(index["weight_map"])

    def dt(n):
        return header[n]["dtype"], header[n]["shape"]
    assert dt("layers.0.attn.wq_a.weight") == ("F8_E4M3", [64, 128])
    assert dt("layers.0.attn.wq_a.scale") == ("F8_E8M0", [1, 1])
    assert dt("layers.0.attn.wq_b.scale") == ("F8_E8M0", [4, 1])
    assert dt("layers.1.ffn.experts.3.w1.weight") == ("I8", [64, 64])     # [out, in/2]
    assert dt("layers.1.ffn.experts.3.w1.scale") == ("F8_E8M0", [64, 4])  # [out, in/32]
    assert dt("layers.1.ffn.shared_experts.w2.weight") == ("F8_E4M3", [128, 64])
    assert dt("layers.0.attn.attn_sink") == ("F32", [4])
    assert dt("layers.0.ffn.gate.tid2eid") == ("I32", [512, 2])
    assert dt("layers.1.attn.compressor.ape")[0] == "F32" and dt("hc_head_fn")[0] == "F32"
    assert dt("embed.weight") == ("BF16", [512, 128]) and dt("mtp.0.e_proj.weight")[0] == "F8_E4M3"
    hf = json.loads((generated / "config.json").read_text())
    assert hf["quantization_config"]["weight_block_size"] == [128, 128] and hf["expert_dtype"] == "fp4"
    assert ModelConfig.from_hf_config(hf, dtype="fp32") == TINY


def test_generator_refuses_to_overwrite(generated):
    with pytest.raises(FileExistsError, match="--force"):
        ck.generate_checkpoint(TINY, generated)


# ------------------------------------------------------------------------------------------- dequantize + load
def _release_roundtrip(cfg, name, w):
    fmt = cfg.storage_format(name)
    if fmt == "fp8":
        return quant.weight_dequant_fp8(*quant.weight_quant_fp8(w), dtype=torch.bfloat16).float()
    if fmt == "fp4":
        return quant.mxfp4_dequant(*quant.mxfp4_quant(w), torch.bfloat16).float()
    if fmt == "bf16":
        return w.bfloat16().float()
    return w


def test_dequantized_model_is_exactly_the_release_rounding(bf16):
    loaded = ck.load_model_from_bf16(bf16, dtype="fp32")
    ref = Transformer(TINY)
    with torch.no_grad():
        for n, p in ref.named_parameters():
            p.copy_(_release_roundtrip(TINY, n, p.detach()))
    a, b = loaded.state_dict(), ref.state_dict()
    assert all(torch.equal(a[n], b[n]) for n in b), [n for n in b if not torch.equal(a[n], b[n])][:5]
    header = ck.read_header(next(bf16.glob("model-00001-*")))[0]
    assert all(h["dtype"] in ("BF16", "F32", "I32") for h in header.values())
    assert "layers.0.attn.wq_a.weight" in header and not any(n.startswith("model.") for n in header)  # official


def test_logits_within_quantization_budget(bf16):
    """Budget: the logit error of the FP8/MXFP4 checkpoint is compared with the error caused by Gaussian noise
    of the same per-tensor relative size (the quantization errors are ~2.7% for FP8 and ~12% for MXFP4 weights;
    this random tiny model amplifies any weight noise into ~30% logit error through routing and top-k flips).
    Quantization error behaves like such noise, so it must stay within 1.5x of it; a layout bug (a swapped nibble,
    a misplaced block scale) gives errors several times larger."""
    loaded = ck.load_model_from_bf16(bf16, dtype="fp32")
    ref = Transformer(TINY)
    noisy = Transformer(TINY)
    la, lr = loaded.state_dict(), ref.state_dict()
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for n, p in noisy.named_parameters():
            if p.is_floating_point():
                p.add_(torch.randn(p.shape, generator=g) * (la[n] - lr[n]).norm() / p.numel() ** 0.5)
        ids = torch.randint(0, TINY.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
        out_q, out_r, out_n = loaded(ids), ref(ids), noisy(ids)
    assert torch.isfinite(out_q.logits).all() and torch.isfinite(out_q.mtp_logits[0]).all()
    err_q = ((out_q.logits - out_r.logits).norm() / out_r.logits.norm()).item()
    err_n = ((out_n.logits - out_r.logits).norm() / out_r.logits.norm()).item()
    assert 0 < err_q < 1.5 * err_n, (err_q, err_n)
    fp8_only = (la["layers.0.attn.wq_b.weight"] - lr["layers.0.attn.wq_b.weight"]).norm() / lr["layers.0.attn.wq_b.weight"].norm()
    assert 0.01 < fp8_only < 0.04


def test_load_released_layout_directly(generated, bf16):
    a = ck.load_state_dict(generated)
    b = ck.load_state_dict(bf16)
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def test_official_names_output_is_the_hf_output(generated, bf16, tmp_path):
    ck.dequantize_checkpoint(generated, tmp_path / "off", names="official", shard_bytes=900_000)
    for f in bf16.glob("model-*.safetensors"):                               # `--names official` is a synonym
        assert (tmp_path / "off" / f.name).read_bytes() == f.read_bytes()
    assert (tmp_path / "off" / ck.INDEX).read_text() == (bf16 / ck.INDEX).read_text()
    cfg = json.loads((tmp_path / "off" / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["torch_dtype"] == "bfloat16"


def test_dequantizer_resumes_after_interruption_and_refuses_overwrite(generated, bf16, tmp_path):
    dst = tmp_path / "out"
    calls = []

    class Interrupt(Exception):
        pass

    def stop_late(done, total, name):
        calls.append(name)
        if done > total * 0.6:
            raise Interrupt

    with pytest.raises(Interrupt):
        ck.dequantize_checkpoint(generated, dst, shard_bytes=900_000, progress=stop_late)
    assert not (dst / ck.INDEX).exists() and (dst / ck.PLAN).exists()
    assert not list(dst.glob("*.tmp"))                                       # the shard in flight is removed
    finished = sorted(p.name for p in dst.glob("model-*.safetensors"))
    assert finished
    mtimes = {n: (dst / n).stat().st_mtime_ns for n in finished}

    with pytest.raises(FileExistsError):                                    # a different layout is not resumed
        ck.dequantize_checkpoint(generated, dst, shard_bytes=400_000)
    s = ck.dequantize_checkpoint(generated, dst, shard_bytes=900_000)
    assert s.shards_skipped == len(finished) and s.shards_written == s.n_shards - len(finished)
    assert all((dst / n).stat().st_mtime_ns == mtimes[n] for n in finished)  # untouched
    assert not list(dst.glob("*.tmp")) and not (dst / ck.PLAN).exists()
    for f in bf16.glob("model-*.safetensors"):                               # same bytes as an uninterrupted run
        assert (dst / f.name).read_bytes() == f.read_bytes()

    with pytest.raises(FileExistsError, match="finished conversion"):
        ck.dequantize_checkpoint(generated, dst, shard_bytes=900_000)
    s = ck.dequantize_checkpoint(generated, dst, shard_bytes=900_000, force=True)
    assert s.shards_written == s.n_shards


def test_dequantizer_refuses_unrelated_destination(generated, tmp_path):
    (tmp_path / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not empty"):
        ck.dequantize_checkpoint(generated, tmp_path)
    assert (tmp_path / "notes.txt").read_text() == "keep me"


def test_truncated_shard_is_not_taken_as_complete(generated, tmp_path):
    """A shard file that exists but is shorter than its header says (a torn copy) is rewritten on resume."""
    dst = tmp_path / "out"
    ck.dequantize_checkpoint(generated, dst, shard_bytes=900_000)      # source of known-good shards
    plan_dst = tmp_path / "out2"
    with pytest.raises(RuntimeError):                                  # leaves only the plan behind
        ck.dequantize_checkpoint(generated, plan_dst, shard_bytes=900_000,
                                 progress=lambda d, t, n: (_ for _ in ()).throw(RuntimeError("stop")))
    first = sorted(dst.glob("model-*.safetensors"))
    for f in first:
        (plan_dst / f.name).write_bytes(f.read_bytes())
    data = first[-1].read_bytes()
    (plan_dst / first[-1].name).write_bytes(data[:-10])
    s = ck.dequantize_checkpoint(generated, plan_dst, shard_bytes=900_000)
    assert s.shards_skipped == len(first) - 1 and s.shards_written == 1
    assert (plan_dst / first[-1].name).read_bytes() == data


def test_shape_check_against_config(generated, tmp_path):
    src = tmp_path / "bad"
    src.mkdir()
    for p in generated.iterdir():
        if p.is_file():
            (src / p.name).write_bytes(p.read_bytes())
    hf = json.loads((generated / "config.json").read_text())
    hf["moe_intermediate_size"] = 96
    (src / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ck.CheckpointError, match=r"experts\.0\.w1\.weight: shape \[64, 64\].*expects \[96, 64\]"):
        ck.dequantize_checkpoint(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()                                   # nothing written before the check
    hf["moe_intermediate_size"], hf["n_routed_experts"] = 64, 6
    (src / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ck.CheckpointError, match="unexpected tensor layers.0.ffn.experts.6"):
        ck.dequantize_checkpoint(src, tmp_path / "out")


def test_mtp_copies_of_shared_embedding_pass_through(generated, tmp_path):
    """A release may carry the MTP block's copies of the shared embedding/head; they are kept, not rejected."""
    from safetensors.torch import save_file
    src = tmp_path / "src"
    src.mkdir()
    for p in generated.iterdir():
        if p.is_file():
            (src / p.name).write_bytes(p.read_bytes())
    extra = torch.randn(TINY.vocab_size, TINY.dim).bfloat16()
    save_file({"mtp.0.emb.tok_emb.weight": extra}, str(src / "model-extra.safetensors"))
    index = json.loads((src / ck.INDEX).read_text())
    index["weight_map"]["mtp.0.emb.tok_emb.weight"] = "model-extra.safetensors"
    (src / ck.INDEX).write_text(json.dumps(index))
    s = ck.dequantize_checkpoint(src, tmp_path / "out")
    assert s.n_tensors == len(TINY.param_shapes()) + 1
    out_index = json.loads((tmp_path / "out" / ck.INDEX).read_text())["weight_map"]
    assert "mtp.0.emb.tok_emb.weight" in out_index
    assert ck.load_model_from_bf16(tmp_path / "out", dtype="fp32") is not None     # the model ignores the copy


def test_a_truncated_shard_or_a_broken_config_is_named_before_anything_is_written(generated, tmp_path):
    import shutil
    src = tmp_path / "src"
    shutil.copytree(generated, src)
    shard = sorted(src.glob("*.safetensors"))[-1]
    whole = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[: whole // 2])
    with pytest.raises(ck.CheckpointError, match=rf"{shard.name}: truncated: {whole // 2} bytes where its header "
                                                 rf"describes {whole}"):
        ck.dequantize_checkpoint(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    shutil.copy(generated / shard.name, shard)
    (src / "config.json").write_text('{"vocab_size": 512,\n')
    with pytest.raises(ck.CheckpointError, match=r"config.json: not valid JSON \(.* at line 2, column 1\)"):
        ck.dequantize_checkpoint(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_transformers_loads_the_hf_names_with_nothing_missing_or_unexpected(tmp_path):
    """HF transformers' own DeepSeek-V4 model (5.x) loads the Hub layout, whose tensor names are the official ones
    (it renames and fuses them on load): `--names hf` output (the default), from_pretrained, every key accounted
    for, none mismatched. Its config knows compression ratios 4 and 128 only, hence the tiny model with 128 in
    place of 16."""
    pytest.importorskip("transformers.models.deepseek_v4")
    import warnings

    from transformers import AutoModelForCausalLM
    cfg = ModelConfig.preset("tiny", compress_ratios=[0, 4, 128, 4, 0])
    ck.generate_checkpoint(cfg, tmp_path / "released")
    ck.dequantize_checkpoint(tmp_path / "released", tmp_path / "bf16", names="hf")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, info = AutoModelForCausalLM.from_pretrained(str(tmp_path / "bf16"), output_loading_info=True)
    assert info["missing_keys"] == set() or info["missing_keys"] == []
    assert not info["unexpected_keys"] and not info["mismatched_keys"], info
    ours = Transformer(cfg)
    sd = dict(ours.named_parameters())
    # the loaded values are ours: the embedding, and an expert fused from our w1/w3 (MXFP4 in the release)
    assert torch.equal(model.model.embed_tokens.weight.float(), sd["embed.weight"].bfloat16().float())
    fused = model.model.layers[1].mlp.experts.gate_up_proj[2].float()
    w1 = sd["layers.1.ffn.experts.2.w1.weight"]
    assert fused.shape[0] == 2 * w1.shape[0] and torch.isfinite(fused).all()
    assert torch.allclose(fused[: w1.shape[0]], quant.mxfp4_weight_qdq(w1.detach()).float(), atol=1e-2)


def test_workers_write_the_same_shards(generated, bf16, tmp_path):
    """Shards converted in two processes at once are the bytes one process writes."""
    s = ck.dequantize_checkpoint(generated, tmp_path / "par", shard_bytes=900_000, workers=2)
    assert s.shards_written == s.n_shards > 1
    for f in bf16.glob("model-*.safetensors"):
        assert (tmp_path / "par" / f.name).read_bytes() == f.read_bytes()
    assert (tmp_path / "par" / ck.INDEX).read_text() == (bf16 / ck.INDEX).read_text()


def test_shard_writer_reports_a_failed_write_and_leaves_nothing(tmp_path):
    """The writer thread's failure reaches the caller (at its next write or at close) and no .tmp stays behind.
    The failure is real: the shard's file handle is swapped for one opened read-only, so the write raises."""
    from dsv4.checkpoint import ShardWriter
    entries = [(f"t{i}", "BF16", (256, 256)) for i in range(4)]
    final = tmp_path / "model-00001-of-00001.safetensors"
    import io
    with pytest.raises(io.UnsupportedOperation):
        with ShardWriter(final, entries) as w:
            good = w.f
            w.f = open(good.name, "rb")
            good.close()
            for name, _, shape in entries:
                w.write(name, torch.ones(shape, dtype=torch.bfloat16))
    assert list(tmp_path.iterdir()) == []


def test_shard_writer_writes_what_safetensors_reads(tmp_path):
    from safetensors.torch import load_file
    from dsv4.checkpoint import ShardWriter
    ts = {f"t{i}": torch.randn(64 + i, 32).to(torch.bfloat16) for i in range(5)}
    final = tmp_path / "s.safetensors"
    with ShardWriter(final, [(n, "BF16", tuple(t.shape)) for n, t in ts.items()]) as w:
        for n, t in ts.items():
            w.write(n, t)
    back = load_file(str(final))
    assert back.keys() == ts.keys() and all(torch.equal(back[n], ts[n]) for n in ts)
    assert [p.name for p in tmp_path.iterdir()] == ["s.safetensors"]


def test_output_buffers_are_reused_within_their_bounds():
    """The dequantizer's buffer pool gives back a written tensor of the same shape, and holds at most `keep` a shape
    and `max_bytes` in all (a shard of many shapes must not keep a copy of each)."""
    pool = ck._Buffers(keep=2, max_bytes=3000)
    a = [torch.empty(10, 50, dtype=torch.bfloat16) for _ in range(3)]          # 1000 bytes each
    for t in a:
        pool.put(t)
    assert pool.held == 2000                                                     # the third: over `keep`
    pool.put(torch.empty(5, 100, dtype=torch.bfloat16))
    pool.put(torch.empty(5, 100, dtype=torch.bfloat16))                          # over max_bytes: dropped
    assert pool.held == 3000
    assert pool.get((10, 50), torch.bfloat16) is a[1] and pool.held == 2000
    fresh = pool.get((7, 7), torch.bfloat16)
    assert fresh.shape == (7, 7) and pool.held == 2000
