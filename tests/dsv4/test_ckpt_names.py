"""Checkpoint naming: `v4 ckpt dequantize --names` writes the official (Hub) names, which transformers and SGLang
load; every reader here (the load path, the convert job's reader, the engine's disk update) detects a checkpoint's
naming with `detect_naming` and reads official names and the HF-style aliases of older output alike; the RL
weight sync sends SGLang the official names."""
import json

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from dsv4 import checkpoint as ck
from dsv4 import quant
from dsv4.config import ModelConfig
from dsv4.model import Transformer
from jobs.convert_ckpt import BF16Reader
from launcher.commands.ckpt import ckpt

TINY = ModelConfig.preset("tiny")


@pytest.fixture(scope="module")
def reference(generated):
    return ck.load_state_dict(generated)


def _as_aliases(src, dst):
    """A copy of a BF16 checkpoint under the HF-style aliases (what `--names hf` wrote before it wrote the
    official names)."""
    dst.mkdir()
    rename = lambda n: ck.official_to_alias(n, TINY.n_layers)        # noqa: E731
    for f in src.glob("model-*.safetensors"):
        save_file({rename(n): t for n, t in load_file(f).items()}, str(dst / f.name))
    index = json.loads((src / ck.INDEX).read_text())
    index["weight_map"] = {rename(n): f for n, f in index["weight_map"].items()}
    (dst / ck.INDEX).write_text(json.dumps(index))
    (dst / "config.json").write_bytes((src / "config.json").read_bytes())
    return dst


@pytest.fixture(scope="module", params=["hf", "official", "older aliases"])
def written(request, generated, tmp_path_factory):
    """(naming the readers must detect, directory) for each `--names` value, and for alias-named older output."""
    d = tmp_path_factory.mktemp("bf16")
    names = "hf" if request.param == "older aliases" else request.param
    r = CliRunner().invoke(ckpt, ["dequantize", str(generated), str(d / "out"), "--names", names, "--shard-gb",
                                  str(900_000 / (1 << 30)), "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["names"] == names
    if request.param == "older aliases":
        return ck.ALIASES, _as_aliases(d / "out", d / "aliases")
    return ck.OFFICIAL, d / "out"


def test_dequantize_writes_the_official_names_for_either_value(written, generated):
    naming, d = written
    keys = json.loads((d / ck.INDEX).read_text())["weight_map"]
    assert ck.detect_naming(keys) == naming
    if naming == ck.OFFICIAL:        # exactly the release's parameter names, no scales
        assert set(keys) == set(TINY.param_shapes())
        assert set(keys) <= set(json.loads((generated / ck.INDEX).read_text())["weight_map"])


def test_the_load_path_reads_each_naming(written, reference):
    _, d = written
    got = ck.load_state_dict(d)
    assert got.keys() == reference.keys() and all(torch.equal(got[n], reference[n]) for n in got)


def test_the_convert_jobs_reader_reads_each_naming(written, reference):
    naming, d = written
    reader = BF16Reader(d, TINY.n_layers)
    assert reader.naming == naming
    for name, t in reference.items():
        rows = slice(0, max(1, t.shape[0] // 2))
        assert torch.equal(reader(name, (rows,)), t[rows]), name
    with pytest.raises(KeyError, match="layers.9.attn.wq_a.weight"):
        reader("layers.9.attn.wq_a.weight", (slice(None),))


def test_the_engine_reads_each_naming_from_disk(written, reference):
    from dsv4.rl.engine import EmbeddedEngine
    _, d = written
    eng = EmbeddedEngine.from_preset("tiny", seed=5)
    res = eng.update_weights_from_disk(str(d), weight_version="2")
    assert res["success"], res["message"]
    got = dict(eng.model.named_parameters())
    assert all(torch.equal(got[n], reference[n].to(got[n].dtype)) for n in got)


def test_detect_naming():
    assert ck.detect_naming(["embed.weight", "layers.0.attn.wq_a.weight", "mtp.0.e_proj.scale"]) == ck.OFFICIAL
    assert ck.detect_naming(["model.embed_tokens.weight", "lm_head.weight"]) == ck.ALIASES
    assert ck.detect_naming(["lm_head.weight"]) == ck.ALIASES
    with pytest.raises(ck.CheckpointError, match=r"mixes official tensor names \(head.weight\) with HF-style "
                                                 r"aliases \(model.norm.weight\)"):
        ck.detect_naming(["model.norm.weight", "head.weight"], "d")


def test_a_checkpoint_mixing_namings_is_refused(generated, tmp_path):
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    for f in generated.iterdir():
        if f.is_file():
            (mixed / f.name).write_bytes(f.read_bytes())
    extra = mixed / "model-extra.safetensors"
    alias = ck.official_to_alias("mtp.0.emb.tok_emb.weight", TINY.n_layers)
    save_file({alias: torch.zeros(TINY.vocab_size, TINY.dim, dtype=torch.bfloat16)}, str(extra))
    index = json.loads((mixed / ck.INDEX).read_text())
    index["weight_map"][alias] = extra.name
    (mixed / ck.INDEX).write_text(json.dumps(index))
    for read in (ck.load_state_dict, lambda p: BF16Reader(p, TINY.n_layers)):
        with pytest.raises(ck.CheckpointError, match="mixes official tensor names"):
            read(mixed)


def test_a_bad_names_value_is_refused(generated, tmp_path):
    with pytest.raises(ValueError, match=r"names='sglang': use 'hf' or 'official'"):
        ck.dequantize_checkpoint(generated, tmp_path / "x", names="sglang")
    assert not (tmp_path / "x").exists()
    r = CliRunner().invoke(ckpt, ["dequantize", str(generated), str(tmp_path / "y"), "--names", "aliases"])
    assert r.exit_code == 2 and "Invalid value for '--names'" in r.output and "'hf', 'official'" in r.output
    assert not (tmp_path / "y").exists()


def test_the_rl_sync_sends_sglang_the_official_names_and_scales():
    """SGLang's loader takes the Hub names and renames them itself; its FP8 wo_a pre-pass looks for `.wo_a.scale`
    in the same call. The loop sends those names (weight and scale in one bucket) and our engine takes them."""
    from dsv4.rl.engine import EmbeddedEngine
    from dsv4.rl.loop import RLConfig, push_weights

    class SGLangLike(EmbeddedEngine):
        calls: list

        def is_ours(self):
            return False

        def update_weights_from_tensor(self, named, **kw):
            self.calls.append([n for n, _ in named])
            return super().update_weights_from_tensor(named, **kw)

    cfg = ModelConfig.preset("tiny", seed=9)
    trainer = Transformer(cfg)
    eng = SGLangLike(Transformer(cfg.with_overrides(seed=0)))
    eng.calls = []
    push_weights(eng, {n: p.detach() for n, p in trainer.named_parameters()}, cfg,
                 RLConfig(sync_format="fp8", bucket_mb=1), "1")
    sent = [n for c in eng.calls for n in c]
    assert ck.detect_naming(sent) == ck.OFFICIAL and len(eng.calls) > 1
    wo_a = [(n, c) for c in eng.calls for n in c if n.endswith(".wo_a.weight")]
    assert len(wo_a) == cfg.n_layers + cfg.n_mtp_layers
    assert all(n[:-len("weight")] + "scale" in c for n, c in wo_a)
    name = "layers.1.attn.wo_a.weight"
    w = dict(trainer.named_parameters())[name].detach()
    assert torch.allclose(dict(eng.model.named_parameters())[name], quant.weight_dequant_fp8(
        *quant.weight_quant_fp8(w, 128, ue8m0=True), dtype=torch.float32))
