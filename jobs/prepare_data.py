"""Pipeline step: chat data (jsonl / json / parquet) -> normalized messages jsonl.

    python -m jobs.prepare_data --run-dir DIR      (alone, or as the entrypoint of a Ray job)

Reads PRESET_DATA, writes V4_SFT_DATA: one {"messages": [...], "tools": [...]?} per line, in
the OpenAI chat shape the DeepSeek-V4 encoder takes (roles system/user/assistant/tool; string
content; optional reasoning_content, tool_calls with JSON-string arguments, tool_call_id,
step_loss_mask). Accepted rows (see docs/data.md):

  * OpenAI style   {"messages": [{"role", "content", ...}]}  (also under conversation/dialog/turns)
  * ShareGPT       {"conversations": [{"from": "human"|"gpt"|..., "value": ...}]}
  * pairs          {"prompt"|"instruction"|"question", ["input"], "response"|"output"|"answer"|"completion", ["system"]}

A row is dropped, and counted under its reason, when it has no recognizable conversation, an
unknown role, a malformed tool call, no assistant turn, or an empty assistant turn. The output
gets a completion sentinel recording the source's content hash: a re-run with the same source
skips, a changed source re-runs. The counts go to stderr and steps/prepare_data/summary.json. More than
PRESET_DATA_MAX_DROP of the rows dropped fails the step (exit 1), leaving no output.
"""
from __future__ import annotations

import json
import os
import sys
from collections import Counter
from pathlib import Path

from jobs.common import RunContext, done, fingerprint, log, mark_done

FORMAT_VERSION = 1  # bump when the normalized output changes, so old outputs are rebuilt
ROLE_MAP = {
    "system": "system",
    "user": "user", "human": "user", "prompter": "user",
    "assistant": "assistant", "gpt": "assistant", "bot": "assistant", "model": "assistant", "chatgpt": "assistant",
    "tool": "tool", "function": "tool", "observation": "tool", "ipython": "tool",
}
CONVERSATION_KEYS = ("messages", "conversations", "conversation", "dialog", "turns")
PROMPT_KEYS = ("prompt", "instruction", "question", "query")
RESPONSE_KEYS = ("response", "output", "answer", "completion")
REASONING_KEYS = ("reasoning_content", "reasoning", "thinking")


class Drop(Exception):
    """A row that cannot become a training conversation; the message is the counted reason."""


def read_rows(path: Path):
    """Yield (line number or row index, row dict or None when the line is not JSON)."""
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            sys.exit(f"error: {path} is parquet, and reading parquet needs pyarrow, which is not a project "
                     "dependency: `pip install pyarrow` on the nodes, or convert the file to jsonl")
        yield from enumerate(pq.read_table(path).to_pylist(), 1)
    elif suffix == ".json":
        data = json.loads(path.read_text(encoding="utf-8"))
        yield from enumerate(data if isinstance(data, list) else [data], 1)
    else:
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    try:
                        yield n, json.loads(line)
                    except json.JSONDecodeError:
                        yield n, None


def _content(value) -> str:
    if value is None:
        return ""
    if isinstance(value, list):  # OpenAI content parts
        return "\n\n".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in value)
    return str(value)


def _tool_calls(calls) -> list[dict]:
    out = []
    for c in calls if isinstance(calls, list) else [calls]:
        fn = c.get("function", c) if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not fn.get("name"):
            raise Drop("malformed tool call")
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                json.loads(args or "{}")
            except json.JSONDecodeError:
                raise Drop("malformed tool call") from None
        else:
            args = json.dumps(args, ensure_ascii=False)
        call = {"type": "function", "function": {"name": fn["name"], "arguments": args or "{}"}}
        if c.get("id"):
            call["id"] = c["id"]
        out.append(call)
    return out


def _message(raw: dict) -> dict:
    sharegpt = "from" in raw and "role" not in raw
    name = str(raw.get("from") if sharegpt else raw.get("role", "")).strip().lower()
    role = ROLE_MAP.get(name)
    if role is None:
        raise Drop(f"unknown role {name!r}")
    msg = {"role": role, "content": _content(raw.get("value") if sharegpt else raw.get("content"))}
    reasoning = next((raw[k] for k in REASONING_KEYS if raw.get(k)), None)
    if role == "assistant":
        if reasoning:
            msg["reasoning_content"] = _content(reasoning)
        if raw.get("tool_calls"):
            msg["tool_calls"] = _tool_calls(raw["tool_calls"])
        if raw.get("step_loss_mask") == 0 or raw.get("weight") == 0:  # ShareGPT/axolotl "weight": 0
            msg["step_loss_mask"] = 0
    if role == "tool" and raw.get("tool_call_id"):
        msg["tool_call_id"] = raw["tool_call_id"]
    return msg


def normalize(row) -> dict:
    """One source row -> {"messages": [...], "tools": [...]?}; raises Drop(reason)."""
    if not isinstance(row, dict):
        raise Drop("not a JSON object")
    key = next((k for k in CONVERSATION_KEYS if isinstance(row.get(k), list)), None)
    if key is not None:
        if not all(isinstance(m, dict) for m in row[key]):
            raise Drop("malformed message")
        messages = [_message(m) for m in row[key]]
    else:
        p = next((k for k in PROMPT_KEYS if row.get(k)), None)
        r = next((k for k in RESPONSE_KEYS if row.get(k)), None)
        if p is None or r is None:
            raise Drop("no conversation found (expected messages, conversations or prompt/response fields)")
        prompt = _content(row[p])
        if p == "instruction" and row.get("input"):  # Alpaca: the input is part of the prompt
            prompt += "\n\n" + _content(row["input"])
        messages = ([{"role": "system", "content": _content(row["system"])}] if row.get("system") else []) + [
            {"role": "user", "content": prompt}, {"role": "assistant", "content": _content(row[r])}]
    assistants = [m for m in messages if m["role"] == "assistant"]
    if not assistants:
        raise Drop("no assistant turn")
    if any(not (m["content"] or m.get("tool_calls") or m.get("reasoning_content")) for m in assistants):
        raise Drop("empty assistant turn")
    out = {"messages": messages}
    tools = row.get("tools")
    if isinstance(tools, str) and tools.strip():
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError:
            raise Drop("malformed tools list") from None
    if tools:
        if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
            raise Drop("malformed tools list")
        out["tools"] = [t if "function" in t else {"type": "function", "function": t} for t in tools]
    return out


def prepare(source: Path, output: Path) -> dict:
    """Normalize source into output (atomically); returns the counts."""
    kept, dropped = 0, Counter()
    examples: dict[str, int] = {}  # first row number of each drop reason, to point people at it
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_name(f"{output.name}.{os.getpid()}.tmp")      # two runs preparing at once write apart
    with open(tmp, "w", encoding="utf-8") as out:
        for n, row in read_rows(source):
            try:
                if row is None:
                    raise Drop("invalid JSON")
                out.write(json.dumps(normalize(row), ensure_ascii=False) + "\n")
                kept += 1
            except Drop as e:
                dropped[str(e)] += 1
                examples.setdefault(str(e), n)
    tmp.replace(output)
    return {"source": str(source), "output": str(output), "kept": kept, "dropped": sum(dropped.values()),
            "dropped_by_reason": dict(dropped.most_common()), "first_row_by_reason": examples}


def main(argv: list[str] | None = None) -> int:
    ctx = RunContext.from_argv(argv, description=__doc__.splitlines()[0])
    source, output = Path(ctx.cfg["PRESET_DATA"]), Path(ctx.cfg["V4_SFT_DATA"])
    if not source.is_file():
        log(f"error: PRESET_DATA={source} does not exist; point PRESET_DATA at a jsonl/json/parquet chat file "
            "(the smoke preset uses data/sft_smoke.jsonl)")
        return 1
    inputs = {"source": str(source), "fingerprint": fingerprint(source), "format_version": FORMAT_VERSION}
    if output.is_file() and done(output, inputs):
        log(f"prepare_data: {output} is up to date with {source}; skipping")
        return 0
    log(f"prepare_data: {source} -> {output}")
    summary = prepare(source, output)
    (ctx.step_dir("prepare_data") / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    for reason, count in summary["dropped_by_reason"].items():
        log(f"  dropped {count:>6}  {reason}  (first at row {summary['first_row_by_reason'][reason]})")
    log(f"prepare_data: kept {summary['kept']}, dropped {summary['dropped']}")
    if summary["kept"] == 0:
        log(f"error: no usable conversation in {source}; see the drop reasons above and docs/data.md")
        output.unlink(missing_ok=True)
        return 1
    share, limit = summary["dropped"] / (summary["kept"] + summary["dropped"]), float(ctx.cfg["PRESET_DATA_MAX_DROP"])
    if share > limit:
        # a data set that is mostly dropped trains on what is left and passes the gates: fail it here
        log(f"error: {summary['dropped']} of {summary['kept'] + summary['dropped']} rows of {source} dropped "
            f"({share:.0%}, more than PRESET_DATA_MAX_DROP={limit:g}); see the reasons above and docs/data.md, fix the "
            "data, or raise PRESET_DATA_MAX_DROP if those rows are meant to go")
        output.unlink(missing_ok=True)
        return 1
    mark_done(output, inputs, kept=summary["kept"], dropped=summary["dropped"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
