"""The built-in DeepSeek-V4 chat encoder: exact strings and the loss mask.

Expected strings follow the released encoder (deepseek-ai/DeepSeek-V4-*, encoding/encoding_dsv4.py);
the chat-mode multi-turn and tool-call strings are outputs of that encoder on its own
encoding/tests fixtures, as published by third-party parity tests. The thinking-mode strings
are written out by hand from the format rules in dsv4/encoding.py.
"""
import pytest

from dsv4.encoding import ASSISTANT, BOS, EOS, THINK_END, THINK_START, USER, ChatEncoder, encode_messages

SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
BASIC = [
    SYSTEM,
    {"role": "user", "content": "Hello"},
    {"role": "assistant", "content": "Hi there! How can I help you?"},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "The capital of France is Paris."},
]
THINKING = [
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "reasoning_content": "Add them.", "content": "4"},
    {"role": "user", "content": "3+3?"},
    {"role": "assistant", "reasoning_content": "Add again.", "content": "6"},
]
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Get the weather for a specific location",
        "parameters": {"type": "object", "properties": {
            "location": {"type": "string", "description": "The city name"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "description": "Temperature unit"}},
            "required": ["location"]}}},
    {"type": "function", "function": {
        "name": "search", "description": "Search the web for information",
        "parameters": {"type": "object", "properties": {
            "query": {"type": "string", "description": "Search query"},
            "num_results": {"type": "integer", "description": "Number of results to return"}},
            "required": ["query"]}}},
]
TOOL_CHAT = [
    SYSTEM,
    {"role": "user", "content": "What's the weather in Beijing?"},
    {"role": "assistant", "tool_calls": [{"id": "call_001", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"location": "Beijing", "unit": "celsius"}'}}]},
    {"role": "tool", "tool_call_id": "call_001", "content": '{"temperature": 22, "condition": "sunny", "humidity": 45}'},
    {"role": "assistant", "content": "The weather in Beijing is currently sunny with a temperature of 22°C and 45% humidity."},
]
GOLDEN_TOOLS = (
    '<｜begin▁of▁sentence｜>You are a helpful assistant.\n\n## Tools\n\nYou have access '
    'to a set of tools to help answer the user\'s question. You can invoke tools by '
    'writing a "<｜DSML｜tool_calls>" block like the following:\n\n<｜DSML｜tool_calls>\n'
    '<｜DSML｜invoke name="$TOOL_NAME">\n<｜DSML｜parameter name="$PARAMETER_NAME" '
    'string="true|false">$PARAMETER_VALUE</｜DSML｜parameter>\n...\n</｜DSML｜invoke>\n'
    '<｜DSML｜invoke name="$TOOL_NAME2">\n...\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>\n\n'
    'String parameters should be specified as is and set `string="true"`. For all '
    'other types (numbers, booleans, arrays, objects), pass the value in JSON format '
    'and set `string="false"`.\n\nIf thinking_mode is enabled (triggered by <think>), '
    'you MUST output your complete reasoning inside <think>...</think> BEFORE any tool '
    'calls or final response.\n\nOtherwise, output directly after </think> with tool '
    'calls or final response.\n\n### Available Tool Schemas\n\n'
    '{"name": "get_weather", "description": "Get the weather for a specific location", '
    '"parameters": {"type": "object", "properties": {"location": {"type": "string", '
    '"description": "The city name"}, "unit": {"type": "string", "enum": ["celsius", '
    '"fahrenheit"], "description": "Temperature unit"}}, "required": ["location"]}}\n'
    '{"name": "search", "description": "Search the web for information", "parameters": '
    '{"type": "object", "properties": {"query": {"type": "string", "description": '
    '"Search query"}, "num_results": {"type": "integer", "description": "Number of '
    'results to return"}}, "required": ["query"]}}\n\nYou MUST strictly follow the '
    'above defined tool name and parameter schemas to invoke tool calls.\n'
    '<｜User｜>What\'s the weather in Beijing?<｜Assistant｜></think>\n\n<｜DSML｜tool_calls>\n'
    '<｜DSML｜invoke name="get_weather">\n<｜DSML｜parameter name="location" '
    'string="true">Beijing</｜DSML｜parameter>\n<｜DSML｜parameter name="unit" '
    'string="true">celsius</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>'
    '<｜end▁of▁sentence｜><｜User｜><tool_result>{"temperature": 22, "condition": '
    '"sunny", "humidity": 45}</tool_result><｜Assistant｜></think>The weather in Beijing '
    'is currently sunny with a temperature of 22°C and 45% humidity.<｜end▁of▁sentence｜>'
)


def test_single_turn_chat_and_generation_prompt():
    assert encode_messages([SYSTEM, {"role": "user", "content": "Hi"}], "chat") == (
        f"{BOS}You are a helpful assistant.{USER}Hi{ASSISTANT}{THINK_END}")
    assert encode_messages([SYSTEM, {"role": "user", "content": "Hi"}], "thinking") == (
        f"{BOS}You are a helpful assistant.{USER}Hi{ASSISTANT}{THINK_START}")
    assert encode_messages([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}], "chat") == (
        f"{BOS}{USER}Hi{ASSISTANT}{THINK_END}Yo{EOS}")


def test_multi_turn_chat_matches_reference():
    assert encode_messages(BASIC, "chat") == (
        "<｜begin▁of▁sentence｜>You are a helpful assistant."
        "<｜User｜>Hello<｜Assistant｜></think>Hi there! How can I help you?<｜end▁of▁sentence｜>"
        "<｜User｜>What is the capital of France?<｜Assistant｜></think>"
        "The capital of France is Paris.<｜end▁of▁sentence｜>")


def test_thinking_mode_keeps_or_drops_earlier_reasoning():
    kept = f"{BOS}{USER}2+2?{ASSISTANT}<think>Add them.</think>4{EOS}{USER}3+3?{ASSISTANT}<think>Add again.</think>6{EOS}"
    dropped = f"{BOS}{USER}2+2?{ASSISTANT}</think>4{EOS}{USER}3+3?{ASSISTANT}<think>Add again.</think>6{EOS}"
    assert encode_messages(THINKING, "thinking", drop_thinking=False) == kept
    assert encode_messages(THINKING, "thinking", drop_thinking=True) == dropped
    # chat mode never renders reasoning, whatever drop_thinking says
    assert encode_messages(THINKING, "chat", drop_thinking=False) == (
        f"{BOS}{USER}2+2?{ASSISTANT}</think>4{EOS}{USER}3+3?{ASSISTANT}</think>6{EOS}")


def test_tool_calls_match_reference():
    enc = ChatEncoder.builtin()
    assert enc.canonical_text(TOOL_CHAT[1:], tools=TOOLS) == GOLDEN_TOOLS.replace("You are a helpful assistant.", "", 1)
    assert "".join(p.text for p in enc.pieces(TOOL_CHAT, tools=TOOLS)) == GOLDEN_TOOLS
    # tools switch drop_thinking off: the first turn's reasoning survives in thinking mode
    msgs = [dict(m) for m in TOOL_CHAT]
    msgs[2]["reasoning_content"] = "Use the tool."
    text = "".join(p.text for p in enc.pieces(msgs, tools=TOOLS, thinking_mode="thinking", drop_thinking=True))
    assert "<think>Use the tool.</think>\n\n<｜DSML｜tool_calls>" in text


def test_tool_results_merge_in_call_order():
    msgs = [
        {"role": "user", "content": "both"},
        {"role": "assistant", "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "f", "arguments": '{"n": 1, "s": "x"}'}},
            {"id": "b", "type": "function", "function": {"name": "g", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "b", "content": "B"},
        {"role": "tool", "tool_call_id": "a", "content": "A"},
        {"role": "user", "content": "thanks"},
    ]
    text = encode_messages(msgs, "chat")
    assert '<｜DSML｜parameter name="n" string="false">1</｜DSML｜parameter>\n' in text
    assert '<｜DSML｜parameter name="s" string="true">x</｜DSML｜parameter>' in text
    assert text.endswith(f"{EOS}{USER}<tool_result>A</tool_result>\n\n<tool_result>B</tool_result>\n\nthanks"
                         f"{ASSISTANT}{THINK_END}")


def test_unknown_role_is_refused_with_a_fix():
    with pytest.raises(ValueError, match="developer.*prepare_data"):
        encode_messages([{"role": "developer", "content": "x"}], "chat")
    with pytest.raises(ValueError, match="thinking_mode"):
        encode_messages(BASIC, "deep")


def _mask_text(enc):
    """The trained characters, as text: what the loss sees."""
    return "".join(p.text for p in enc.pieces if p.train)


@pytest.mark.parametrize("mode,drop", [("chat", False), ("thinking", False), ("thinking", True)])
def test_mask_covers_exactly_the_assistant_spans(tokenizer, mode, drop):
    enc = ChatEncoder.builtin().encode(THINKING, tokenizer, thinking_mode=mode, drop_thinking=drop)
    assert len(enc.ids) == len(enc.mask) and enc.whole_text_ids_match
    assert tokenizer.encode(enc.text) == enc.ids
    assert enc.text == encode_messages(THINKING, mode, drop_thinking=drop)
    trained = [i for i, m in zip(enc.ids, enc.mask) if m]
    assert tokenizer.decode(trained) == _mask_text(enc)
    expected = {("chat", False): f"4{EOS}6{EOS}",
                ("thinking", False): f"Add them.</think>4{EOS}Add again.</think>6{EOS}",
                ("thinking", True): f"4{EOS}Add again.</think>6{EOS}"}[(mode, drop)]
    assert tokenizer.decode(trained) == expected
    # every token of a non-assistant piece is 0, every token of an assistant piece is 1
    for piece, (a, b) in zip(enc.pieces, enc.spans):
        assert set(enc.mask[a:b]) == ({1} if piece.role == "assistant" else {0})
    # the transition that opens each assistant turn is prompt
    eos, asst = tokenizer.encode(EOS), tokenizer.encode(ASSISTANT)
    assert len(eos) == 1 and len(asst) == 1
    assert all(m == 0 for i, m in zip(enc.ids, enc.mask) if i == asst[0])
    assert all(m == 1 for i, m in zip(enc.ids, enc.mask) if i == eos[0])


def test_step_loss_mask_zero_excludes_a_turn(tokenizer):
    msgs = [dict(m) for m in THINKING]
    msgs[1]["step_loss_mask"] = 0
    enc = ChatEncoder.builtin().encode(msgs, tokenizer)
    assert tokenizer.decode([i for i, m in zip(enc.ids, enc.mask) if m]) == f"6{EOS}"


def test_checkpoint_encoder_file_is_loaded_and_preferred(tmp_path):
    assert ChatEncoder.for_checkpoint(tmp_path).source.startswith("built-in")
    assert ChatEncoder.for_checkpoint(None).source.startswith("built-in")
    (tmp_path / "encoding").mkdir()
    # a stand-in for the released file: same API, marks every user turn so we can tell it was used
    (tmp_path / "encoding" / "encoding_dsv4.py").write_text(
        "from dsv4.encoding import bos_token, merge_tool_messages, encode_messages\n"
        "from dsv4 import encoding as _e\n"
        "def render_message(index, messages, thinking_mode, drop_thinking=True):\n"
        "    return '[ckpt]' + _e.render_message(index, messages, thinking_mode, drop_thinking)\n")
    enc = ChatEncoder.for_checkpoint(tmp_path)
    assert enc.source.endswith("encoding/encoding_dsv4.py")
    assert enc.pieces(BASIC)[1].text == "[ckpt]You are a helpful assistant."
    (tmp_path / "encoding" / "encoding_dsv4.py").write_text("x = 1\n")
    with pytest.raises(ValueError, match="lacks.*render_message"):
        ChatEncoder.for_checkpoint(tmp_path)


def test_the_shipped_encoder_copied_into_a_checkpoint_loads(tmp_path):
    """The generator copies dsv4/encoding.py into checkpoints; loading it by path must work (it uses
    dataclasses, which look their module up in sys.modules while the class is created)."""
    import shutil
    from pathlib import Path

    import dsv4.encoding as builtin

    (tmp_path / "encoding").mkdir()
    shutil.copy(Path(builtin.__file__), tmp_path / "encoding" / "encoding_dsv4.py")
    enc = ChatEncoder.for_checkpoint(tmp_path)
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert enc.source.endswith("encoding_dsv4.py")
    assert enc.canonical_text(msgs) == ChatEncoder.builtin().canonical_text(msgs)
