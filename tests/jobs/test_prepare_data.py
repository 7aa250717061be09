"""jobs.prepare_data: accepted formats, drop reasons, the sentinel (skip / re-run on change)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from jobs.prepare_data import main

ROOT = Path(__file__).resolve().parents[2]

ROWS = [
    # OpenAI style, with reasoning and a tool round trip
    {"messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
        {"role": "assistant", "content": "", "reasoning_content": "Need the tool.",
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "wx", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "cold"},
        {"role": "assistant", "content": "Cold."}],
     "tools": json.dumps([{"name": "wx", "parameters": {"type": "object"}}])},
    # ShareGPT
    {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello", "weight": 0},
                       {"from": "human", "value": "bye"}, {"from": "gpt", "value": "bye!"}]},
    # prompt/response pairs, Alpaca-style instruction + input
    {"prompt": "2+2?", "response": "4", "system": "Math."},
    {"instruction": "Reverse", "input": "abc", "output": "cba"},
    # dropped rows
    {"messages": [{"role": "user", "content": "no answer"}]},
    {"messages": [{"role": "narrator", "content": "x"}, {"role": "assistant", "content": "y"}]},
    {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": ""}]},
    {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}]},
    {"text": "plain pretraining text"},
]


def _run_dir(tmp_path: Path, source: Path, max_drop: float = 1.0) -> Path:
    run = tmp_path / "run"
    run.mkdir(exist_ok=True)
    out = tmp_path / "data" / "sft.jsonl"
    (run / "config.json").write_text(json.dumps({"values": {
        "PRESET_DATA": str(source), "V4_SFT_DATA": str(out), "V4_SOCKET_IFNAME": "", "PRESET_DATA_MAX_DROP": max_drop}}))
    return run


def test_a_mostly_dropped_data_set_fails_and_leaves_no_output(tmp_path, capfd):
    """5 of 9 rows dropped (56 %): over a 0.2 limit the step fails, names the share and the key, writes nothing."""
    src = tmp_path / "src.jsonl"
    _write_jsonl(src, ROWS)
    assert main(["--run-dir", str(_run_dir(tmp_path, src, max_drop=0.2))]) == 1
    err = capfd.readouterr().err
    assert "5 of 9 rows" in err and "(56%, more than PRESET_DATA_MAX_DROP=0.2)" in err
    assert not (tmp_path / "data" / "sft.jsonl").exists() and not (tmp_path / "data" / "sft.jsonl.v4-done.json").exists()
    assert main(["--run-dir", str(_run_dir(tmp_path, src, max_drop=0.6))]) == 0


def _write_jsonl(path: Path, rows, extra_lines=()):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "".join(extra_lines))


def test_formats_are_normalized_and_drops_counted(tmp_path):
    src = tmp_path / "src.jsonl"
    _write_jsonl(src, ROWS, extra_lines=["{not json\n"])
    run = _run_dir(tmp_path, src)
    assert main(["--run-dir", str(run)]) == 0
    out = [json.loads(line) for line in (tmp_path / "data" / "sft.jsonl").read_text().splitlines()]
    assert len(out) == 4
    first = out[0]
    assert first["tools"] == [{"type": "function", "function": {"name": "wx", "parameters": {"type": "object"}}}]
    assert first["messages"][1] == {"role": "user", "content": "Weather?"}
    assert first["messages"][2]["reasoning_content"] == "Need the tool."
    assert first["messages"][2]["tool_calls"] == [
        {"type": "function", "function": {"name": "wx", "arguments": '{"city": "Oslo"}'}, "id": "c1"}]
    assert first["messages"][3] == {"role": "tool", "content": "cold", "tool_call_id": "c1"}
    assert out[1]["messages"] == [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello", "step_loss_mask": 0},
        {"role": "user", "content": "bye"}, {"role": "assistant", "content": "bye!"}]
    assert out[2]["messages"] == [{"role": "system", "content": "Math."}, {"role": "user", "content": "2+2?"},
                                  {"role": "assistant", "content": "4"}]
    assert out[3]["messages"][0] == {"role": "user", "content": "Reverse\n\nabc"}
    summary = json.loads((run / "steps" / "prepare_data" / "summary.json").read_text())
    assert summary["kept"] == 4 and summary["dropped"] == 6
    assert summary["dropped_by_reason"] == {
        "no assistant turn": 1, "unknown role 'narrator'": 1, "empty assistant turn": 1,
        "malformed tool call": 1, "no conversation found (expected messages, conversations or prompt/response fields)": 1,
        "invalid JSON": 1}
    assert summary["first_row_by_reason"]["invalid JSON"] == 10


def test_every_kept_row_encodes(tmp_path, tokenizer):
    from dsv4.data import SFTDataset

    src = tmp_path / "src.jsonl"
    _write_jsonl(src, ROWS)
    assert main(["--run-dir", str(_run_dir(tmp_path, src))]) == 0
    ds = SFTDataset(tmp_path / "data" / "sft.jsonl", tokenizer, seq_len=64)
    assert ds.stats.rows == 4 and ds.stats.trained_tokens > 0


def test_sentinel_skips_and_a_changed_source_reruns(tmp_path, capfd):
    src = tmp_path / "src.jsonl"
    _write_jsonl(src, ROWS[:2])
    run = _run_dir(tmp_path, src)
    out = tmp_path / "data" / "sft.jsonl"
    assert main(["--run-dir", str(run)]) == 0
    assert len(out.read_text().splitlines()) == 2
    out.write_text(out.read_text() + "# marker: untouched if skipped\n")
    assert main(["--run-dir", str(run)]) == 0
    assert "skipping" in capfd.readouterr().err
    assert out.read_text().endswith("# marker: untouched if skipped\n")
    _write_jsonl(src, ROWS[:3])  # changed input
    assert main(["--run-dir", str(run)]) == 0
    assert "skipping" not in capfd.readouterr().err
    assert len(out.read_text().splitlines()) == 3


def test_failures_exit_1_and_leave_no_sentinel(tmp_path):
    src = tmp_path / "src.jsonl"
    _write_jsonl(src, ROWS[4:])  # nothing usable
    run = _run_dir(tmp_path, src)
    assert main(["--run-dir", str(run)]) == 1
    assert not (tmp_path / "data" / "sft.jsonl.v4-done.json").exists()
    (tmp_path / "missing").mkdir()
    assert main(["--run-dir", str(_run_dir(tmp_path / "missing", tmp_path / "nope.jsonl"))]) == 1


def test_parquet_reads_when_pyarrow_exists_and_says_so_otherwise(tmp_path):
    src = tmp_path / "src.parquet"
    run = _run_dir(tmp_path, src)
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        src.write_bytes(b"PAR1")
        with pytest.raises(SystemExit, match="pyarrow"):
            main(["--run-dir", str(run)])
        return
    pq.write_table(pa.Table.from_pylist([ROWS[1], {"conversations": [{"from": "human", "value": "x"}]}]), src)
    assert main(["--run-dir", str(run)]) == 0
    assert len((tmp_path / "data" / "sft.jsonl").read_text().splitlines()) == 1


def test_runs_as_a_module_on_the_shipped_smoke_set(tmp_path):
    run = _run_dir(tmp_path, ROOT / "data" / "sft_smoke.jsonl")
    r = subprocess.run([sys.executable, "-m", "jobs.prepare_data", "--run-dir", str(run)], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "kept 200, dropped 0" in r.stderr
    assert (tmp_path / "data" / "sft.jsonl.v4-done.json").is_file()


def test_data_another_run_prepared_into_the_same_file_is_refused(tmp_path):
    """V4_SFT_DATA is one path whatever PRESET_DATA is: after run B prepares its source there, run A must not
    train (or evaluate) on it as if it were its own."""
    from jobs.common import RunContext, foreign_sft_data

    out = tmp_path / "shared" / "sft.jsonl"
    runs = {}
    for name, rows in (("a", ROWS[:3]), ("b", ROWS[3:4])):
        src = tmp_path / f"{name}.jsonl"
        _write_jsonl(src, rows)
        run = tmp_path / f"run-{name}"
        run.mkdir()
        (run / "config.json").write_text(json.dumps({"values": {
            "PRESET_DATA": str(src), "V4_SFT_DATA": str(out), "V4_SOCKET_IFNAME": "", "CKPT_HF_DIR": "/x",
            "CKPT_BF16_DIR": "/x", "CKPT_TORCH_DIST": "/x", "PRESET_DATA_MAX_DROP": 0.2}}))
        runs[name] = run
    assert main(["--run-dir", str(runs["a"])]) == 0
    assert foreign_sft_data(RunContext.load(runs["a"])) is None
    assert main(["--run-dir", str(runs["b"])]) == 0
    why = foreign_sft_data(RunContext.load(runs["a"]))
    assert why and str(tmp_path / "b.jsonl") in why and "V4_SFT_DATA" in why
    assert foreign_sft_data(RunContext.load(runs["b"])) is None
    assert not list(out.parent.glob("*.tmp"))                      # the per-process temp file was renamed
