"""jobs.dequantize: a re-run skips, and a release replaced in place (no sentinel of ours, as after a download) is redone."""
import hashlib
import json
from pathlib import Path

from dsv4 import checkpoint as ck
from dsv4.config import ModelConfig
from jobs.dequantize import main


def _run_dir(tmp_path: Path, hf: Path, bf16: Path) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"values": {
        "CKPT_HF_DIR": str(hf), "CKPT_BF16_DIR": str(bf16), "CKPT_TORCH_DIST": str(tmp_path / "dist"),
        "PRESET_DATA": "", "V4_SFT_DATA": str(tmp_path / "sft.jsonl"), "V4_SOCKET_IFNAME": ""}}))
    return run


def _digest(d: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(d.glob("*.safetensors")):
        h.update(p.read_bytes())
    return h.hexdigest()


def test_a_replaced_release_is_dequantized_again(tmp_path, capsys):
    tiny = ModelConfig.preset("tiny")
    hf, bf16 = tmp_path / "release", tmp_path / "bf16"
    ck.generate_checkpoint(tiny, hf, seed=1)
    run = _run_dir(tmp_path, hf, bf16)
    assert main(["--run-dir", str(run)]) == 0
    first = _digest(bf16)
    assert main(["--run-dir", str(run)]) == 0
    assert "already complete" in capsys.readouterr().err          # same release: skipped
    ck.generate_checkpoint(tiny, hf, seed=2, force=True)           # another release in the same place
    assert main(["--run-dir", str(run)]) == 0
    assert "already complete" not in capsys.readouterr().err
    assert _digest(bf16) != first
