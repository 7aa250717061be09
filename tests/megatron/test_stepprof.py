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


def _events():
    """A profiled step as torch.profiler lists it on a GPU: the optimizer's two nested annotations (our
    part::optimizer, torch.optim's Optimizer.step#...) each get a span on the device covering their kernels, handed to
    the annotation's CPU op as if it were a kernel; one span comes unflagged. An inductor kernel is named as its
    launch mark (a user annotation) and is a kernel all the same."""
    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import FunctionEvent

    def cpu(i, name, a, b, parent=None, ann=False):
        e = FunctionEvent(i, name, thread=1, start_us=a, end_us=b, is_user_annotation=ann)
        if parent is not None:
            e.set_cpu_parent(parent)
            parent.append_cpu_child(e)
        return e

    def dev(i, name, a, b, ann=False):
        return FunctionEvent(i, name, thread=7, start_us=a, end_us=b, device_type=DeviceType.CUDA,
                             is_user_annotation=ann)

    attn = cpu(1, "part::attention", 0, 40, ann=True)
    mm = cpu(2, "aten::mm", 5, 10, attn)
    fused = cpu(3, "triton_poi_fused_add_0", 10, 15, attn, ann=True)
    opt = cpu(4, "part::optimizer", 50, 150, ann=True)
    add = cpu(5, "aten::_foreach_add_", 55, 60, opt)
    step = cpu(6, "Optimizer.step#Adam.step", 60, 140, opt, ann=True)
    mul = cpu(7, "aten::_foreach_mul_", 70, 80, step)
    device = [dev(10, "gemm", 200, 230), dev(11, "triton_poi_fused_add_0", 230, 240),
              dev(12, "multi_tensor_apply_kernel", 300, 310), dev(13, "multi_tensor_apply_kernel", 310, 325),
              dev(14, "multi_tensor_apply_kernel", 330, 350),
              dev(15, "part::optimizer", 300, 350, ann=True), dev(16, "Optimizer.step#Adam.step", 330, 350)]
    mm.append_kernel("gemm", 0, 30)
    fused.append_kernel("triton_poi_fused_add_0", 0, 10)
    add.append_kernel("multi_tensor_apply_kernel", 0, 10)
    add.append_kernel("multi_tensor_apply_kernel", 0, 15)
    mul.append_kernel("multi_tensor_apply_kernel", 0, 20)
    opt.append_kernel("part::optimizer", 0, 50)                  # the annotations' spans, as the profiler links them
    step.append_kernel("Optimizer.step#Adam.step", 0, 20)
    return [attn, mm, fused, opt, add, step, mul] + device


def test_annotation_spans_are_not_counted_as_kernels():
    """The optimizer's kernels count once (45 us, not 45 + its annotations' 70), the inductor kernel named as its
    mark counts, and the parts add up to the step's wall time."""
    from dsv4.megatron import stepprof
    wall_s = 400e-6
    parts = {p.name: p for p in stepprof.breakdown(_events(), wall_s)}
    assert math.isclose(parts["optimizer"].ms, 0.045) and parts["optimizer"].kernels == 3
    assert math.isclose(parts["attention"].ms, 0.040) and parts["attention"].kernels == 2
    assert math.isclose(parts["idle"].ms, 0.400 - 0.085)
    assert math.isclose(sum(p.ms for p in parts.values()), 0.400)
    assert stepprof.step_breakdown(_events(), wall_s).overlap_ms == 0
    top = stepprof.top_kernels(_events(), 5)
    assert [(k.name, k.launches) for k in top][:1] == [("multi_tensor_apply_kernel", 3)]
    assert not any(k.name.startswith(("part::", "Optimizer.")) for k in top)
