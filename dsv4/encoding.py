"""DeepSeek-V4 chat encoding: messages -> prompt text, and -> (token ids, loss mask) for SFT.

DeepSeek-V4 ships no jinja chat template; the released checkpoints carry a Python encoder,
`encoding/encoding_dsv4.py` (with `encoding/README.md` and golden tests under `encoding/tests/`),
in deepseek-ai/DeepSeek-V4-Flash and -Pro on Hugging Face. This module is an independent
re-implementation of the part of that format SFT needs, with the same module-level API
(`bos_token`, `merge_tool_messages`, `render_message`, `encode_messages`, a drop-thinking helper),
so `ChatEncoder` can drive either this module or the checkpoint's own file the same way.

The format (`B`=<｜begin▁of▁sentence｜>, `E`=<｜end▁of▁sentence｜>, `U`=<｜User｜>, `A`=<｜Assistant｜>):

    B {system}  U {user}  A </think> {answer} E  U {user}  A </think> {answer} E        chat mode
    B {system}  U {user}  A <think> {reasoning} </think> {answer} E                     thinking mode

  * The system prompt is raw text right after BOS (no role token); tool schemas are appended to it.
  * A user turn is `U` + text. When an assistant turn follows (or the conversation ends there) the
    user turn is closed by `A` and a think token: `</think>` in chat mode (the reasoning block is
    closed at once), `<think>` in thinking mode.
  * An assistant turn is `{reasoning}</think>` (thinking mode only) + content + tool calls + `E`.
  * drop_thinking (thinking mode): assistant turns before the last user turn lose their reasoning
    and their user turn ends in `A</think>`, as if answered in chat mode. It is switched off when
    any message carries tools (the official encoder does the same). The official default is on;
    for SFT we default to off (keep every turn's reasoning), as the prior miles runs did.
  * Tool calls (DSML): "\\n\\n<｜DSML｜tool_calls>\\n" + invokes joined by "\\n" + "\\n</｜DSML｜tool_calls>",
    an invoke being `<｜DSML｜invoke name="N">\\n{params joined by \\n}\\n</｜DSML｜invoke>` and a
    parameter `<｜DSML｜parameter name="K" string="true|false">V</｜DSML｜parameter>` (strings as is,
    anything else as JSON). There is no tool role: consecutive tool/user messages merge into one
    user turn whose parts (`<tool_result>{output}</tool_result>` or plain text) are joined by "\\n\\n".

Loss mask (same rule as the miles `deepseek_v4` mask): 1 on every token an assistant message
renders — reasoning, `</think>`, content, tool calls and its `E` — and 0 elsewhere: BOS, system,
user and tool text, and the `A<think>` / `A</think>` transition that ends each user turn (it is
prompt, not something the model must produce). `step_loss_mask: 0` on an assistant message
excludes that turn.

Not built in (use the checkpoint's encoder when you need them): the reasoning-effort prefixes,
quick-instruction `task` tokens, `developer` / `latest_reminder` roles, `response_format`, `wo_eos`.
"""
from __future__ import annotations

import copy
import importlib.util
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_START = "<think>"
THINK_END = "</think>"
DSML = "｜DSML｜"
THINKING_MODES = ("chat", "thinking")
ROLES = ("system", "user", "assistant", "tool")

bos_token = BOS  # the checkpoint module's name for it; ChatEncoder reads it from either module

# Appended (after "\n\n") to the system prompt when tools are given. Verbatim format text of the
# released encoder: the model was trained on exactly this wording, so it is data, not style.
TOOLS_TEMPLATE = """## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "<{dsml}tool_calls>" block like the following:

<{dsml}tool_calls>
<{dsml}invoke name="$TOOL_NAME">
<{dsml}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{dsml}parameter>
...
</{dsml}invoke>
<{dsml}invoke name="$TOOL_NAME2">
...
</{dsml}invoke>
</{dsml}tool_calls>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {think_start}), you MUST output your complete reasoning inside {think_start}...{think_end} BEFORE any tool calls or final response.

Otherwise, output directly after {think_end} with tool calls or final response.

### Available Tool Schemas

{schemas}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def render_tools(tools: list[dict]) -> str:
    """OpenAI-format tools ([{"type": "function", "function": {...}}]) -> the system-prompt section."""
    schemas = "\n".join(_json(t["function"] if "function" in t else t) for t in tools)
    return TOOLS_TEMPLATE.format(dsml=DSML, think_start=THINK_START, think_end=THINK_END, schemas=schemas)


def render_tool_calls(tool_calls: list[dict]) -> str:
    """OpenAI-format tool calls -> the DSML block that follows an assistant's content."""
    invokes = []
    for call in tool_calls:
        fn = call.get("function", call)
        args = fn.get("arguments", "")
        try:  # arguments are a JSON object string; anything else is passed as one string argument
            args = json.loads(args) if isinstance(args, str) else args
            if not isinstance(args, dict):
                raise ValueError
        except ValueError:
            args = {"arguments": fn.get("arguments", "")}
        params = "\n".join(
            f'<{DSML}parameter name="{k}" string="{"true" if isinstance(v, str) else "false"}">'
            f"{v if isinstance(v, str) else _json(v)}</{DSML}parameter>"
            for k, v in args.items()
        )
        invokes.append(f'<{DSML}invoke name="{fn["name"]}">\n{params}\n</{DSML}invoke>')
    return f"\n\n<{DSML}tool_calls>\n" + "\n".join(invokes) + f"\n</{DSML}tool_calls>"


def _text(content: Any) -> str:
    """Message content as text: a string, or OpenAI content blocks whose text parts are joined."""
    if content is None:
        return ""
    if isinstance(content, list):
        return "\n\n".join(b.get("text", "") if isinstance(b, dict) else str(b) for b in content)
    return str(content)


def merge_tool_messages(messages: list[dict]) -> list[dict]:
    """Fold every run of consecutive user/tool messages into one user turn.

    V4 has no tool role: tool outputs become `<tool_result>` parts of a user turn, ordered as the
    preceding assistant issued the calls (by tool_call_id), and plain user text in the same run
    becomes another part; parts are joined by a blank line.
    """
    out: list[dict] = []
    call_order: dict[str, int] = {}
    run: list[tuple[str, int, str]] | None = None  # (kind, call position, text) of the open user turn

    def close():
        nonlocal run
        if run is None:
            return
        slots = iter(sorted((p for p in run if p[0] == "tool"), key=lambda p: p[1]))  # stable sort
        parts = [next(slots) if kind == "tool" else (kind, pos, text) for kind, pos, text in run]
        out[-1]["content"] = "\n\n".join(text for _, _, text in parts)
        run = None

    for msg in messages:
        role = msg.get("role")
        if role not in ROLES:
            raise ValueError(
                f"role {role!r} is not supported by the built-in DeepSeek-V4 encoder (it knows {ROLES}); "
                "map it in prepare_data, or put the checkpoint's encoding/encoding_dsv4.py in place"
            )
        if role in ("user", "tool"):
            if run is None:
                out.append({k: v for k, v in msg.items() if k not in ("role", "content", "tool_call_id")} | {"role": "user"})
                run = []
            if role == "tool":
                run.append(("tool", call_order.get(msg.get("tool_call_id") or "", 0),
                            f"<tool_result>{_text(msg.get('content'))}</tool_result>"))
            else:
                run.append(("text", 0, _text(msg.get("content"))))
            continue
        close()
        if role == "assistant" and msg.get("tool_calls"):
            call_order = {c["id"]: i for i, c in enumerate(msg["tool_calls"]) if c.get("id")}
        out.append(copy.deepcopy(msg))
    close()
    return out


def _last_user_index(messages: list[dict]) -> int:
    return max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=-1)


def drop_thinking_messages(messages: list[dict]) -> list[dict]:
    """Remove reasoning_content from assistant turns before the last user turn."""
    last_user = _last_user_index(messages)
    return [
        {k: v for k, v in m.items() if k != "reasoning_content"} if m.get("role") == "assistant" and i < last_user else m
        for i, m in enumerate(messages)
    ]


def render_message(index: int, messages: list[dict], thinking_mode: str, drop_thinking: bool = True) -> str:
    """The text of messages[index] (already merged), including the transition that closes a user turn."""
    if thinking_mode not in THINKING_MODES:
        raise ValueError(f"thinking_mode must be one of {THINKING_MODES}, got {thinking_mode!r}")
    msg, role = messages[index], messages[index].get("role")
    thinking = thinking_mode == "thinking"
    last_user = _last_user_index(messages)
    if role == "system":
        text = _text(msg.get("content"))
        if msg.get("tools"):
            text += "\n\n" + render_tools(msg["tools"])
    elif role == "user":
        text = USER + _text(msg.get("content"))
    elif role == "assistant":
        reasoning = ""
        if thinking and (not drop_thinking or index > last_user):
            reasoning = _text(msg.get("reasoning_content")) + THINK_END
        calls = render_tool_calls(msg["tool_calls"]) if msg.get("tool_calls") else ""
        text = reasoning + _text(msg.get("content")) + calls + EOS
    else:
        raise ValueError(f"message {index}: role {role!r} cannot be rendered; run merge_tool_messages first")
    # A user turn that an assistant answers (or that ends the conversation) opens the assistant turn.
    next_role = messages[index + 1].get("role") if index + 1 < len(messages) else "assistant"
    if role == "user" and next_role == "assistant":
        opens_thinking = thinking and (not drop_thinking or index >= last_user)
        text += ASSISTANT + (THINK_START if opens_thinking else THINK_END)
    return text


def _prepare(messages: list[dict], thinking_mode: str, drop_thinking: bool) -> tuple[list[dict], bool]:
    merged = merge_tool_messages(messages)
    drop = drop_thinking and not any(m.get("tools") for m in merged)
    if thinking_mode == "thinking" and drop:
        merged = drop_thinking_messages(merged)
    return merged, drop


def encode_messages(messages: list[dict], thinking_mode: str, drop_thinking: bool = True,
                    add_default_bos_token: bool = True) -> str:
    """The whole conversation as one prompt string (the official entry point's signature)."""
    merged, drop = _prepare(messages, thinking_mode, drop_thinking)
    body = "".join(render_message(i, merged, thinking_mode, drop) for i in range(len(merged)))
    return (BOS if add_default_bos_token else "") + body


def with_tools(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """Attach a row's tool list to its system message (the encoder reads tools from there)."""
    if not tools:
        return messages
    out = copy.deepcopy(messages)
    if not out or out[0].get("role") != "system":
        out.insert(0, {"role": "system", "content": ""})
    out[0]["tools"] = list(tools)
    return out


# --- SFT: pieces, tokens and the loss mask, for this module or a checkpoint's encoder ------------

@dataclass(frozen=True)
class Piece:
    text: str
    role: str  # "bos" for the leading BOS, else the (merged) message role
    train: bool


@dataclass
class Encoded:
    ids: list[int]
    mask: list[int]  # 1 where the token itself is trained (an assistant token), aligned with ids
    text: str
    pieces: list[Piece]
    spans: list[tuple[int, int]] = field(default_factory=list)  # token range of each piece
    whole_text_ids_match: bool = True  # per-piece tokenization == tokenizing the whole text at once


class ChatEncoder:
    """Renders a conversation piece by piece with an encoding_dsv4-style module.

    The module is this file (built-in) or a checkpoint's encoding/encoding_dsv4.py; both expose
    `bos_token`, `render_message(index, messages, thinking_mode, drop_thinking)`, and optionally
    `merge_tool_messages`, `sort_tool_results_by_call_order`, a drop-thinking helper and
    `encode_messages`, which is used as the cross-check that the pieces add up to the prompt.
    """

    def __init__(self, module: ModuleType, source: str):
        missing = [n for n in ("bos_token", "render_message") if not hasattr(module, n)]
        if missing:
            raise ValueError(f"{source}: not a DeepSeek-V4 encoder, it lacks {missing} "
                             "(expected the module-level API of encoding/encoding_dsv4.py)")
        self.module, self.source = module, source

    @classmethod
    def builtin(cls) -> ChatEncoder:
        return cls(sys.modules[__name__], "built-in (dsv4/encoding.py)")

    @classmethod
    def from_file(cls, path: str | Path) -> ChatEncoder:
        spec = importlib.util.spec_from_file_location("encoding_dsv4_checkpoint", path)
        if spec is None or spec.loader is None:
            raise ValueError(f"{path}: cannot be imported as a Python module")
        module = importlib.util.module_from_spec(spec)
        # registered while it executes: dataclasses (and pickling) look their module up by name
        sys.modules[spec.name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            sys.modules.pop(spec.name, None)
            raise
        return cls(module, str(path))

    @classmethod
    def for_checkpoint(cls, ckpt_dir: str | Path | None) -> ChatEncoder:
        """The checkpoint's own encoder when it ships one, else the built-in equivalent."""
        path = Path(ckpt_dir) / "encoding" / "encoding_dsv4.py" if ckpt_dir else None
        return cls.from_file(path) if path and path.is_file() else cls.builtin()

    def _preprocess(self, messages: list[dict], thinking_mode: str, drop_thinking: bool) -> tuple[list[dict], bool]:
        m = self.module
        msgs = copy.deepcopy(messages)
        if hasattr(m, "merge_tool_messages"):
            msgs = m.merge_tool_messages(msgs)
        if hasattr(m, "sort_tool_results_by_call_order"):
            msgs = m.sort_tool_results_by_call_order(msgs)
        drop = drop_thinking and not any(x.get("tools") for x in msgs)
        dropper = getattr(m, "drop_thinking_messages", None) or getattr(m, "_drop_thinking_messages", None)
        if thinking_mode == "thinking" and drop and dropper:
            msgs = dropper(msgs)
        return msgs, drop

    def pieces(self, messages: list[dict], tools: list[dict] | None = None, thinking_mode: str = "chat",
               drop_thinking: bool = False) -> list[Piece]:
        msgs, drop = self._preprocess(with_tools(messages, tools), thinking_mode, drop_thinking)
        out = [Piece(self.module.bos_token, "bos", False)]
        for i, msg in enumerate(msgs):
            text = self.module.render_message(i, msgs, thinking_mode=thinking_mode, drop_thinking=drop)
            role = msg.get("role", "")
            out.append(Piece(text, role, role == "assistant" and msg.get("step_loss_mask", 1) != 0))
        return out

    def canonical_text(self, messages: list[dict], tools: list[dict] | None = None, thinking_mode: str = "chat",
                       drop_thinking: bool = False) -> str | None:
        """The module's own one-shot encode_messages output, or None if it has none."""
        fn = getattr(self.module, "encode_messages", None)
        if fn is None:
            return None
        return fn(with_tools(copy.deepcopy(messages), tools), thinking_mode=thinking_mode, drop_thinking=drop_thinking)

    def encode(self, messages: list[dict], tokenizer, tools: list[dict] | None = None, thinking_mode: str = "chat",
               drop_thinking: bool = False) -> Encoded:
        """Token ids and per-token loss mask. Each piece is tokenized on its own, so piece
        boundaries are token boundaries and the mask is exact without offset mappings; whether
        that equals tokenizing the whole text at once is recorded (it does for a byte-level
        tokenizer and whenever boundaries fall on special tokens)."""
        pieces = self.pieces(messages, tools, thinking_mode, drop_thinking)
        ids: list[int] = []
        mask: list[int] = []
        spans = []
        for p in pieces:
            t = tokenizer.encode(p.text)
            spans.append((len(ids), len(ids) + len(t)))
            ids += t
            mask += [int(p.train)] * len(t)
        text = "".join(p.text for p in pieces)
        return Encoded(ids, mask, text, pieces, spans, tokenizer.encode(text) == ids)
