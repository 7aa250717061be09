"""A self-contained byte-level tokenizer with the DeepSeek special tokens, so smoke pipelines need no download.

Ids 0..255 are the raw UTF-8 bytes; the special tokens follow from 256 in `SPECIAL_TOKENS` order. Special
tokens inside the text are matched as whole tokens (longest first), everything else becomes bytes, so
`encode(a + b) == encode(a) + encode(b)` whenever the cut does not split a special token.

`save(dir)` writes `tokenizer.json` in the Hugging Face `tokenizers` format (a byte-level BPE with no merges,
so HF loaders produce the same ids) plus `tokenizer_config.json`. `Tokenizer.load(dir)` reads those back; a
real BPE tokenizer.json (with merges) is handed to the `tokenizers` package when it is installed.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

__all__ = ["Tokenizer", "SPECIAL_TOKENS", "load_tokenizer"]

# (content, special): special=True tokens are dropped by decode(skip_special=True)
SPECIAL_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<｜begin▁of▁sentence｜>", True),
    ("<｜end▁of▁sentence｜>", True),
    ("<｜▁pad▁｜>", True),
    ("<｜User｜>", True),
    ("<｜Assistant｜>", True),
    ("<think>", False),
    ("</think>", False),
    ("<｜fim▁hole｜>", True),
    ("<｜fim▁begin｜>", True),
    ("<｜fim▁end｜>", True),
    ("<｜tool▁calls▁begin｜>", False),
    ("<｜tool▁calls▁end｜>", False),
    ("<｜tool▁call▁begin｜>", False),
    ("<｜tool▁call▁end｜>", False),
    ("<｜tool▁outputs▁begin｜>", False),
    ("<｜tool▁outputs▁end｜>", False),
    ("<｜tool▁output▁begin｜>", False),
    ("<｜tool▁output▁end｜>", False),
    ("<｜tool▁sep｜>", False),
)
ALIASES = {"bos": "<｜begin▁of▁sentence｜>", "eos": "<｜end▁of▁sentence｜>", "pad": "<｜▁pad▁｜>",
           "user": "<｜User｜>", "assistant": "<｜Assistant｜>", "think": "<think>", "/think": "</think>"}
MODEL_MAX_LENGTH = 1048576


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the ByteLevel alphabet of HF tokenizers)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


class Tokenizer:
    def __init__(self, special_tokens: tuple[tuple[str, bool], ...] = SPECIAL_TOKENS):
        self.specials = [s for s, _ in special_tokens]
        self._is_special = {256 + i: flag for i, (_, flag) in enumerate(special_tokens)}
        self._special_id = {s: 256 + i for i, s in enumerate(self.specials)}
        if len(self._special_id) != len(self.specials):
            raise ValueError("duplicate special tokens")
        pattern = "|".join(re.escape(s) for s in sorted(self.specials, key=len, reverse=True))
        self._split = re.compile(f"({pattern})") if pattern else None

    @property
    def vocab_size(self) -> int:
        return 256 + len(self.specials)

    def special(self, name: str) -> int:
        """Id of a special token, by content or alias (bos, eos, pad, user, assistant, think, /think)."""
        token = ALIASES.get(name, name)
        if token not in self._special_id:
            raise KeyError(f"no special token {name!r}; known: {', '.join(ALIASES)} or one of {self.specials}")
        return self._special_id[token]

    @property
    def bos_id(self) -> int:
        return self.special("bos")

    @property
    def eos_id(self) -> int:
        return self.special("eos")

    @property
    def pad_id(self) -> int:
        return self.special("pad")

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        ids = [self.bos_id] if add_bos else []
        for part in (self._split.split(text) if self._split else [text]):
            if part in self._special_id:
                ids.append(self._special_id[part])
            elif part:
                ids.extend(part.encode("utf-8"))
        return ids

    def decode(self, ids, skip_special: bool = False) -> str:
        """Bytes are joined and decoded as UTF-8 (invalid sequences -> U+FFFD); ids outside the vocabulary
        (a model's spare rows) also decode to U+FFFD."""
        out, buf = [], bytearray()
        for i in (int(x) for x in ids):
            if 0 <= i < 256:
                buf.append(i)
                continue
            out.append(buf.decode("utf-8", errors="replace"))
            buf = bytearray()
            if i in self._is_special:
                if not (skip_special and self._is_special[i]):
                    out.append(self.specials[i - 256])
            else:
                out.append("\ufffd")
        out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)

    # ------------------------------------------------------------------ files
    def to_hf_json(self) -> dict:
        b2u = _bytes_to_unicode()
        return {
            "version": "1.0", "truncation": None, "padding": None,
            "added_tokens": [{"id": 256 + i, "content": s, "single_word": False, "lstrip": False, "rstrip": False,
                              "normalized": False, "special": self._is_special[256 + i]}
                             for i, s in enumerate(self.specials)],
            "normalizer": None,
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
            "post_processor": None,
            "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
            "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                      "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                      "vocab": {b2u[b]: b for b in range(256)}, "merges": []},
        }

    def save(self, directory: str | Path) -> None:
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        (d / "tokenizer.json").write_text(json.dumps(self.to_hf_json(), ensure_ascii=False, indent=1) + "\n")
        cfg = {
            "tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": False, "add_eos_token": False,
            "bos_token": ALIASES["bos"], "eos_token": ALIASES["eos"], "pad_token": ALIASES["pad"],
            "model_max_length": MODEL_MAX_LENGTH, "clean_up_tokenization_spaces": False,
            "dsv4_byte_level": True,
        }
        (d / "tokenizer_config.json").write_text(json.dumps(cfg, ensure_ascii=False, indent=1) + "\n")

    @classmethod
    def load(cls, directory: str | Path):
        """Read tokenizer.json from `directory`. Byte-level files (ours) give a Tokenizer; a BPE file with
        merges gives an adapter over the `tokenizers` package with the same methods."""
        path = Path(directory) / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no tokenizer.json (write one with `v4 ckpt generate` or copy the "
                                    "checkpoint's tokenizer files)")
        data = json.loads(path.read_text())
        model = data.get("model", {})
        b2u = _bytes_to_unicode()
        if model.get("merges") or model.get("vocab") != {b2u[b]: b for b in range(256)}:
            return _HFTokenizer(path, data)
        added = sorted(data.get("added_tokens", []), key=lambda t: t["id"])
        if [t["id"] for t in added] != list(range(256, 256 + len(added))):
            raise ValueError(f"{path}: added token ids must run contiguously from 256")
        return cls(tuple((t["content"], bool(t.get("special", True))) for t in added))


class _HFTokenizer:
    """The same interface over a real BPE tokenizer.json, through the `tokenizers` package."""

    def __init__(self, path: Path, data: dict):
        try:
            from tokenizers import Tokenizer as HFTok
        except ImportError:
            raise ValueError(f"{path} is a BPE tokenizer with merges; the built-in byte-level tokenizer cannot read "
                             "it. Install the `tokenizers` package (pip install tokenizers) to use it") from None
        self._tok = HFTok.from_file(str(path))
        self.specials = [t["content"] for t in data.get("added_tokens", [])]
        self._special_flag = {t["id"]: bool(t.get("special")) for t in data.get("added_tokens", [])}

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def special(self, name: str) -> int:
        i = self._tok.token_to_id(ALIASES.get(name, name))
        if i is None:
            raise KeyError(f"no token {name!r} in this tokenizer")
        return i

    bos_id = property(lambda self: self.special("bos"))
    eos_id = property(lambda self: self.special("eos"))
    pad_id = property(lambda self: self.special("pad"))

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return ([self.bos_id] if add_bos else []) + ids

    def decode(self, ids, skip_special: bool = False) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special)


def load_tokenizer(directory: str | Path | None = None):
    """The tokenizer saved in `directory`, or the built-in one when directory is None."""
    return Tokenizer() if directory is None else Tokenizer.load(directory)
