"""`v4 bench step` on CPU: the real trainer (megatron-core DDP and optimizer, one process), two variants of a
runtime switch side by side, the last one again with the non-finite hooks on, and the profiled step's time by
part of the model."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_step_compares_variants_and_splits_the_step_by_part():
    r = subprocess.run([sys.executable, "-m", "launcher", "bench", "step", "--steps", "1", "--warmup", "1",
                        "--compare", "fp32_gemm=fp32,bf16x3", "--profile", "each", "--nonfinite-hooks", "--json"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads(r.stdout)
    rows = rep["rows"]
    assert [x["variant"] for x in rows] == ["fp32_gemm=fp32", "fp32_gemm=bf16x3",
                                            "fp32_gemm=bf16x3 + non-finite hooks"]
    for x in rows:
        assert math.isfinite(x["loss"]) and x["tokens_per_s"] > 0 and x["model_tflops"] > 0
        assert x["mfu"] is None                                   # a CPU states no peak
    assert rows[0]["loss"] == rows[1]["loss"] == rows[2]["loss"]  # the same fixed batch, fp32 on a CPU either way
    assert rows[0]["parts"] and rows[1]["parts"]                  # each variant's step profiled
    assert not rows[2]["parts"]                                   # the hooks' row is timed, not profiled
    parts = {p["name"]: p for p in rows[1]["parts"]}
    for name in ("attention", "compressors", "hyper-connections", "norms", "router and dispatch", "expert GEMMs",
                 "LM head and loss", "optimizer", "idle"):
        assert name in parts, sorted(parts)
    assert parts["expert GEMMs"]["ms"] > 0 and parts["optimizer"]["ms"] > 0
    wall = rows[1]["profiled_wall_s"] * 1e3
    assert abs(sum(p["ms"] for p in parts.values()) - wall) <= 0.01 * wall   # the parts and idle make the step


def test_compare_parses_one_switch_or_sets_of_switches():
    import click
    import pytest

    from launcher.commands.bench import parse_variants
    assert parse_variants("fp32_gemm=fp32,bf16x3") == [{"fp32_gemm": "fp32"}, {"fp32_gemm": "bf16x3"}]
    assert parse_variants("fp32_gemm=bf16x3; fp32_gemm=bf16x3_fwd compiled=hc+attn") == [
        {"fp32_gemm": "bf16x3"}, {"fp32_gemm": "bf16x3_fwd", "compiled": "hc+attn"}]
    for bad in ("lr=1,2", "fp32_gemm", "fp32_gemm=bf16x3;seq_len=4", ";"):
        with pytest.raises(click.BadParameter, match="switches: attn_impl"):
            parse_variants(bad)
