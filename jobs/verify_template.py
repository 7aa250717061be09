"""Pipeline step: check the DeepSeek-V4 chat encoding and loss mask on real samples before training.

    python -m jobs.verify_template --run-dir DIR      (alone, or as the entrypoint of a Ray job)

Uses the checkpoint's own encoder (encoding/encoding_dsv4.py in the BF16 or HF checkpoint dir)
when there is one, else the built-in equivalent (dsv4/encoding.py), and the checkpoint's
tokenizer when there is one, else the built-in. Encodes the first samples of V4_SFT_DATA with
PRESET_THINKING_MODE (chat | thinking, default chat) and PRESET_DROP_THINKING (default 0),
prints the token/mask table of the first sample on stdout, and fails (exit 1) when a sample's
mask is all 0 or all 1, an assistant turn that should train has no loss token or does not
contain its own content, the per-message pieces do not add up to the encoder's one-shot
encode_messages, or tokenizing piece by piece differs from tokenizing the whole prompt.
The findings go to steps/verify_template/summary.json.
"""
from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dsv4.data import read_jsonl
from dsv4.encoding import THINKING_MODES, ChatEncoder, Encoded
from jobs.common import RunContext, done, fingerprint, log, mark_done

NUM_SAMPLES = 64  # samples checked; the table shows the first
TABLE_ROWS = 400  # tokens of the first sample printed (the rest is summarized)
CKPT_KEYS = ("CKPT_BF16_DIR", "V4_BF16_DIR", "CKPT_HF_DIR", "V4_HF_DIR")  # where encoder/tokenizer may live


@dataclass
class SampleReport:
    index: int
    tokens: int
    trained: int
    assistant_turns: int
    problems: list[str] = field(default_factory=list)


def checkpoint_dirs(cfg: dict) -> list[Path]:
    return [Path(cfg[k]) for k in CKPT_KEYS if cfg.get(k)]


def load_tokenizer(dirs: list[Path]):
    """(tokenizer, where it came from): the first checkpoint dir holding tokenizer.json, else built-in."""
    from dsv4.tokenizer import Tokenizer

    for d in dirs:
        if (d / "tokenizer.json").is_file():
            return Tokenizer.load(d), str(d)
    return Tokenizer(), "built-in (dsv4/tokenizer.py)"


def load_encoder(dirs: list[Path]) -> ChatEncoder:
    for d in dirs:
        if (d / "encoding" / "encoding_dsv4.py").is_file():
            return ChatEncoder.for_checkpoint(d)
    return ChatEncoder.builtin()


def check_sample(index: int, row: dict, encoder: ChatEncoder, tokenizer, thinking_mode: str,
                 drop_thinking: bool) -> tuple[SampleReport, Encoded]:
    enc = encoder.encode(row["messages"], tokenizer, row.get("tools"), thinking_mode, drop_thinking)
    assistants = [p for p in enc.pieces if p.role == "assistant"]
    rep = SampleReport(index, len(enc.ids), sum(enc.mask), len(assistants))
    if rep.trained == 0:
        rep.problems.append("mask is all 0: no token would be trained")
    elif rep.trained == rep.tokens:
        rep.problems.append("mask is all 1: prompt tokens would be trained")
    sources = [m for m in row["messages"] if m.get("role") == "assistant"]
    if len(sources) != len(assistants):
        rep.problems.append(f"{len(sources)} assistant messages rendered as {len(assistants)} assistant pieces")
    spans = [s for p, s in zip(enc.pieces, enc.spans) if p.role == "assistant"]
    for turn, (piece, (a, b), msg) in enumerate(zip(assistants, spans, sources)):
        if piece.train and sum(enc.mask[a:b]) == 0:
            rep.problems.append(f"assistant turn {turn} has no loss tokens (rendered as {piece.text!r})")
        content = msg.get("content") or ""
        if content and content not in piece.text:
            rep.problems.append(f"assistant turn {turn}: its content {content[:60]!r} is not in its rendered piece")
    canonical = encoder.canonical_text(row["messages"], row.get("tools"), thinking_mode, drop_thinking)
    if canonical is not None and canonical != enc.text:
        at = next((i for i, (x, y) in enumerate(zip(canonical, enc.text)) if x != y), min(len(canonical), len(enc.text)))
        rep.problems.append(f"per-message pieces differ from encode_messages at char {at}: "
                            f"{enc.text[at:at + 40]!r} vs {canonical[at:at + 40]!r}")
    if not enc.whole_text_ids_match:
        rep.problems.append("tokenizing piece by piece differs from tokenizing the whole prompt: "
                            "trained token ids would not be the ids the model is served")
    return rep, enc


def print_table(enc: Encoded, tokenizer, out=None) -> None:
    out = out or sys.stdout
    print(f"{'IDX':>5} | {'TOK_ID':>7} | MASK | PIECE", file=out)
    for i, (t, m) in enumerate(zip(enc.ids[:TABLE_ROWS], enc.mask)):
        print(f"{i:>5} | {t:>7} | {m:>4} | {tokenizer.decode([t])!r}", file=out)
    if len(enc.ids) > TABLE_ROWS:
        print(f"... {len(enc.ids) - TABLE_ROWS} more tokens, {sum(enc.mask[TABLE_ROWS:])} of them trained", file=out)


def chat_settings(cfg: dict) -> tuple[str, bool]:
    """(thinking_mode, drop_thinking) of a run; train_sft must render with the same settings."""
    mode = str(cfg.get("PRESET_THINKING_MODE", "chat"))
    if mode not in THINKING_MODES:
        raise ValueError(f"PRESET_THINKING_MODE={mode!r}: expected one of {THINKING_MODES}")
    return mode, str(cfg.get("PRESET_DROP_THINKING", 0)).strip().lower() in ("1", "true", "yes", "on")


def main(argv: list[str] | None = None) -> int:
    ctx = RunContext.from_argv(argv, description=__doc__.splitlines()[0])
    data = Path(ctx.cfg["V4_SFT_DATA"])
    if not data.is_file():
        log(f"error: V4_SFT_DATA={data} does not exist; run the prepare_data step first")
        return 1
    try:
        thinking_mode, drop_thinking = chat_settings(ctx.cfg)
    except ValueError as e:
        log(f"error: {e}")
        return 2
    dirs = checkpoint_dirs(ctx.cfg)
    encoder = load_encoder(dirs)
    tokenizer, tok_source = load_tokenizer(dirs)
    step = ctx.step_dir("verify_template")
    inputs = {"data": fingerprint(data), "encoder": encoder.source, "tokenizer": tok_source,
              "encoder_hash": fingerprint(Path(encoder.module.__file__)), "thinking_mode": thinking_mode,
              "drop_thinking": drop_thinking}
    if done(step, inputs):
        log(f"verify_template: already verified for these inputs; skipping (see {step / 'summary.json'})")
        return 0
    log(f"verify_template: encoder {encoder.source}, tokenizer {tok_source}, "
        f"thinking_mode={thinking_mode}, drop_thinking={int(drop_thinking)}")
    rows = read_jsonl(data)[:NUM_SAMPLES]
    reports = []
    for i, row in enumerate(rows):
        try:
            rep, enc = check_sample(i, row, encoder, tokenizer, thinking_mode, drop_thinking)
        except Exception as e:  # an encoder that raises on real data is a finding, not a crash
            rep, enc = SampleReport(i, 0, 0, 0, [f"encoding failed: {type(e).__name__}: {e}"]), None
        if i == 0 and enc is not None:
            print(f"# sample 0 of {data}: {rep.tokens} tokens, {rep.trained} trained")
            print_table(enc, tokenizer)
        reports.append(rep)
    failed = [r for r in reports if r.problems]
    for r in failed:
        for p in r.problems:
            log(f"  FAIL sample {r.index}: {p}")
    summary = {"ok": not failed and bool(reports), "encoder": encoder.source, "tokenizer": tok_source,
               "thinking_mode": thinking_mode, "drop_thinking": drop_thinking, "data": str(data),
               "samples": len(reports), "failed_samples": len(failed),
               "tokens": sum(r.tokens for r in reports), "trained_tokens": sum(r.trained for r in reports),
               "reports": [asdict(r) for r in reports]}
    (step / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if not reports:
        log(f"error: {data} has no samples")
        return 1
    if failed:
        log(f"verify_template: {len(failed)} of {len(reports)} samples failed; the chat encoder or the data is "
            f"wrong (encoder: {encoder.source}); fix it before training")
        return 1
    log(f"verify_template: {len(reports)} samples OK, {summary['trained_tokens']} of {summary['tokens']} tokens trained")
    mark_done(step, inputs, samples=len(reports))
    return 0


if __name__ == "__main__":
    sys.exit(main())
