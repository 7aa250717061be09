"""jobs.verify_template: passes on the built-in encoder, fails (exit 1) on broken checkpoint encoders."""
import json
import subprocess
import sys
from pathlib import Path

from jobs.verify_template import main

ROOT = Path(__file__).resolve().parents[2]
SMOKE = ROOT / "data" / "sft_smoke.jsonl"

# Renders every assistant reply inside the preceding user turn: the text is right, the mask is all 0.
MASKS_NOTHING = '''
from dsv4.encoding import bos_token, merge_tool_messages
from dsv4 import encoding as _e

def render_message(index, messages, thinking_mode, drop_thinking=True):
    if messages[index]["role"] == "assistant":
        return ""
    text = _e.render_message(index, messages, thinking_mode, drop_thinking)
    if index + 1 < len(messages) and messages[index + 1]["role"] == "assistant":
        text += _e.render_message(index + 1, messages, thinking_mode, drop_thinking)
    return text

def encode_messages(messages, thinking_mode, drop_thinking=True, add_default_bos_token=True):
    return _e.encode_messages(messages, thinking_mode, drop_thinking, add_default_bos_token)
'''
# Turns every message into an assistant turn and has no BOS: the mask is all 1.
MASKS_EVERYTHING = '''
bos_token = ""

def merge_tool_messages(messages):
    return [dict(m, role="assistant") for m in messages]

def render_message(index, messages, thinking_mode, drop_thinking=True):
    return messages[index]["content"] + "<｜end▁of▁sentence｜>"
'''


def _run_dir(tmp_path: Path, data: Path, ckpt: Path | None = None, **extra) -> Path:
    run = tmp_path / "run"
    run.mkdir(exist_ok=True)
    values = {"V4_SFT_DATA": str(data), "V4_SOCKET_IFNAME": "", **extra}
    if ckpt is not None:
        values["CKPT_BF16_DIR"] = str(ckpt)
    (run / "config.json").write_text(json.dumps({"values": values}))
    return run


def _planted(tmp_path: Path, source: str) -> Path:
    ckpt = tmp_path / "ckpt"
    (ckpt / "encoding").mkdir(parents=True)
    (ckpt / "encoding" / "encoding_dsv4.py").write_text(source)
    return ckpt


def _summary(run: Path) -> dict:
    return json.loads((run / "steps" / "verify_template" / "summary.json").read_text())


def test_builtin_encoder_passes_and_prints_the_table(tmp_path, capsys):
    run = _run_dir(tmp_path, SMOKE, ckpt=tmp_path / "no-such-ckpt")
    assert main(["--run-dir", str(run)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].split("|")[0].strip() == "IDX" and "MASK" in out[1]
    rows = [[c.strip() for c in line.split("|")] for line in out[2:]]
    assert rows[0][2] == "0" and {r[2] for r in rows} == {"0", "1"}  # BOS is prompt; some tokens train
    s = _summary(run)
    assert s["ok"] and s["encoder"].startswith("built-in") and s["samples"] == 64 and s["failed_samples"] == 0
    assert 0 < s["trained_tokens"] < s["tokens"]
    # a second run with the same inputs skips; a different thinking mode re-checks
    assert main(["--run-dir", str(run)]) == 0
    assert capsys.readouterr().out == ""
    run = _run_dir(tmp_path, SMOKE, PRESET_THINKING_MODE="thinking")
    assert main(["--run-dir", str(run)]) == 0
    assert _summary(run)["thinking_mode"] == "thinking"


def test_checkpoint_encoder_that_masks_nothing_fails(tmp_path, capsys):
    run = _run_dir(tmp_path, SMOKE, ckpt=_planted(tmp_path, MASKS_NOTHING))
    assert main(["--run-dir", str(run)]) == 1
    s = _summary(run)
    assert not s["ok"] and s["encoder"].endswith("encoding/encoding_dsv4.py") and s["failed_samples"] == 64
    problems = s["reports"][0]["problems"]
    assert "mask is all 0: no token would be trained" in problems
    assert any(p.startswith("assistant turn 0 has no loss tokens") for p in problems)
    assert not (run / "steps" / "verify_template" / ".v4-done.json").exists()


def test_checkpoint_encoder_that_masks_everything_fails(tmp_path):
    run = _run_dir(tmp_path, SMOKE, ckpt=_planted(tmp_path, MASKS_EVERYTHING))
    assert main(["--run-dir", str(run)]) == 1
    problems = _summary(run)["reports"][0]["problems"]
    assert "mask is all 1: prompt tokens would be trained" in problems


def test_missing_data_fails(tmp_path):
    assert main(["--run-dir", str(_run_dir(tmp_path, tmp_path / "none.jsonl"))]) == 1


def test_runs_as_a_module_and_fails_with_exit_1(tmp_path):
    run = _run_dir(tmp_path, SMOKE, ckpt=_planted(tmp_path, MASKS_NOTHING))
    r = subprocess.run([sys.executable, "-m", "jobs.verify_template", "--run-dir", str(run)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stderr
    assert "FAIL sample 0: mask is all 0" in r.stderr


def test_unknown_thinking_mode_is_a_config_error(tmp_path):
    assert main(["--run-dir", str(_run_dir(tmp_path, SMOKE, PRESET_THINKING_MODE="deep"))]) == 2


def test_tokenizer_comes_from_the_checkpoint_when_it_has_one(tmp_path):
    from dsv4.tokenizer import Tokenizer

    ckpt = tmp_path / "ckpt"
    Tokenizer().save(ckpt)
    run = _run_dir(tmp_path, SMOKE, ckpt=ckpt)
    assert main(["--run-dir", str(run)]) == 0
    s = _summary(run)
    assert s["tokenizer"] == str(ckpt) and s["encoder"].startswith("built-in")
