import json

import pytest

from dsv4.config import ModelConfig
from dsv4.tokenizer import Tokenizer


def test_bytes_and_specials_round_trip():
    tok = Tokenizer()
    text = "<｜begin▁of▁sentence｜>sys<｜User｜>héllo 世界 🙂<｜Assistant｜><think>r</think>ok<｜end▁of▁sentence｜>"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_id == 256 and ids[-1] == tok.eos_id
    assert tok.special("<think>") in ids and tok.special("/think") in ids
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special=True) == "syshéllo 世界 🙂<think>r</think>ok"
    assert tok.encode("ab") == [97, 98] and tok.encode("x", add_bos=True) == [256, 120]


def test_concatenation_property():
    tok = Tokenizer()
    a, b = "hi <｜User｜> there", "<think>x</think>"
    assert tok.encode(a + b) == tok.encode(a) + tok.encode(b)


def test_decode_odd_ids():
    tok = Tokenizer()
    assert tok.decode([0xE4, 0xB8]) == "\ufffd"            # a cut UTF-8 sequence
    assert tok.decode([tok.vocab_size + 3]) == "\ufffd"     # a model's spare vocabulary row


def test_tiny_model_has_room():
    assert Tokenizer().vocab_size <= ModelConfig.preset("tiny").vocab_size


def test_save_load_hf_format(tmp_path):
    tok = Tokenizer()
    tok.save(tmp_path)
    data = json.loads((tmp_path / "tokenizer.json").read_text())
    assert data["model"]["type"] == "BPE" and len(data["model"]["vocab"]) == 256 and data["model"]["merges"] == []
    assert [t["id"] for t in data["added_tokens"]] == list(range(256, tok.vocab_size))
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert cfg["eos_token"] == "<｜end▁of▁sentence｜>"
    back = Tokenizer.load(tmp_path)
    text = "a<｜User｜>b</think>ü"
    assert back.encode(text) == tok.encode(text) and back.vocab_size == tok.vocab_size


def test_load_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.load(tmp_path)


def test_unknown_special():
    with pytest.raises(KeyError, match="no special token"):
        Tokenizer().special("nope")
