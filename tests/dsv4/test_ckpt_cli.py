"""`v4 ckpt` through click's runner: exit codes, stdout summary, stderr progress, errors."""
import json
import subprocess
import sys

import torch

from click.testing import CliRunner

from launcher.commands.ckpt import ckpt


def test_generate_dequantize_names(tmp_path):
    r = CliRunner()
    gen = r.invoke(ckpt, ["generate", "--model", "tiny", "--out", str(tmp_path / "g"), "--seed", "3",
                          "--set", "n_layers=2", "--json"])
    assert gen.exit_code == 0, gen.output
    info = json.loads(gen.stdout)
    assert info["seed"] == 3 and info["shards"] == 1 and (tmp_path / "g" / "config.json").is_file()
    assert json.loads((tmp_path / "g" / "config.json").read_text())["num_hidden_layers"] == 2

    again = r.invoke(ckpt, ["generate", "--model", "tiny", "--out", str(tmp_path / "g")])
    assert again.exit_code == 2 and "--force" in again.output

    deq = r.invoke(ckpt, ["dequantize", str(tmp_path / "g"), str(tmp_path / "b"), "--json"])
    assert deq.exit_code == 0, deq.output
    s = json.loads(deq.stdout)
    assert s["shards_written"] == 1 and s["bytes_out"] > s["bytes_in"]
    assert "dequantize:" in deq.stderr                                     # progress goes to stderr

    twice = r.invoke(ckpt, ["dequantize", str(tmp_path / "g"), str(tmp_path / "b")])
    assert twice.exit_code == 2 and "finished conversion" in twice.output

    names = r.invoke(ckpt, ["names", "--model", "tiny", "--json"])
    assert names.exit_code == 0 and json.loads(names.stdout)["embed.weight"] == "model.embed_tokens.weight"


def test_dequantize_in_parts_then_finish(tmp_path):
    """Two parts (as two machines sharing the destination would run them) write disjoint shards and no index; the
    run without --part writes none again and finishes; the result equals a one-call conversion's, byte for byte."""
    from safetensors.torch import load_file
    r = CliRunner()
    assert r.invoke(ckpt, ["generate", "--model", "tiny", "--out", str(tmp_path / "g")]).exit_code == 0
    shard = ["--shard-gb", "0.001", "--workers", "1"]                  # ~1 MB shards: several of them
    whole = r.invoke(ckpt, ["dequantize", str(tmp_path / "g"), str(tmp_path / "one"), *shard, "--json"])
    n = json.loads(whole.stdout)["shards"]
    assert n >= 3, whole.output
    written, part_bytes = [], []
    for i in range(2):
        p = r.invoke(ckpt, ["dequantize", str(tmp_path / "g"), str(tmp_path / "two"), *shard, "--part", f"{i}/2",
                            "--json"])
        assert p.exit_code == 0, p.output
        s = json.loads(p.stdout)
        assert not s["complete"] and not (tmp_path / "two" / "model.safetensors.index.json").exists()
        written.append(s["shards_written"])
        part_bytes.append(s["bytes_out"])                             # each part counts its own shards' bytes
    assert written == [(n + 1) // 2, n // 2]
    assert sum(part_bytes) == json.loads(whole.stdout)["bytes_out"] and all(b > 0 for b in part_bytes)
    text = r.invoke(ckpt, ["dequantize", str(tmp_path / "g"), str(tmp_path / "two"), *shard, "--part", "1/2"])
    assert text.exit_code == 0 and f"v4 ckpt dequantize {tmp_path / 'g'} {tmp_path / 'two'}" in text.stdout
    fin = r.invoke(ckpt, ["dequantize", str(tmp_path / "g"), str(tmp_path / "two"), *shard, "--json"])
    s = json.loads(fin.stdout)
    assert fin.exit_code == 0 and s["complete"] and s["shards_written"] == 0 and s["shards_skipped"] == n
    for f in sorted((tmp_path / "one").glob("*.safetensors")):
        a, b = load_file(str(f)), load_file(str(tmp_path / "two" / f.name))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert (tmp_path / "two" / "model.safetensors.index.json").read_text() == \
        (tmp_path / "one" / "model.safetensors.index.json").read_text()
    bad = r.invoke(ckpt, ["dequantize", str(tmp_path / "g"), str(tmp_path / "x"), "--part", "2/2"])
    assert bad.exit_code == 2 and "0 <= I < N" in bad.output
    forced = r.invoke(ckpt, ["dequantize", str(tmp_path / "g"), str(tmp_path / "x"), "--part", "0/2",
                             "--force"])
    assert forced.exit_code == 2 and "clear DST once" in forced.output


def test_bad_input_is_a_usage_error(tmp_path):
    r = CliRunner()
    assert r.invoke(ckpt, ["generate", "--model", "nope", "--out", str(tmp_path / "x")]).exit_code == 2
    bad = r.invoke(ckpt, ["generate", "--set", "n_layers=x", "--out", str(tmp_path / "x")])
    assert bad.exit_code == 2 and "n_layers" in bad.output
    missing = r.invoke(ckpt, ["dequantize", str(tmp_path / "none"), str(tmp_path / "y")])
    assert missing.exit_code == 2 and "not a directory" in missing.output
    (tmp_path / "empty").mkdir()
    no_cfg = r.invoke(ckpt, ["dequantize", str(tmp_path / "empty"), str(tmp_path / "y")])
    assert no_cfg.exit_code == 2 and "config.json" in no_cfg.output


def test_module_import_is_cheap():
    code = "import sys, launcher.commands.ckpt; print('torch' in sys.modules, 'dsv4.checkpoint' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_config_module_does_not_import_torch():
    code = "import sys, dsv4.config; dsv4.config.ModelConfig.preset('flash').n_params(); print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"
