"""`v4 bench kernels`: TileLang kernel throughput next to the torch fallback, measured in the same run.

FLOPs are counted explicitly, per query token and head, over all K index slots (padding included):
  sparse attention forward : 4 * K * D        (scores q.k: 2KD, output p.v: 2KD)
  sparse attention backward: 10 * K * D       (scores recomputed 2KD, dO.v 2KD, dq 2KD, dkv 2 x 2KD)
  indexer logits           : 2 * N * Di       (q.k for every compressed entry, causal half included)
TFLOP/s = FLOPs / median time of `--iters` timed runs after warm-up (CUDA events between runs queued back to back,
so host launch time is not counted); the fastest and slowest of those runs are printed beside it, so noise between
runs of the same kernel is visible. Each row also gives the SM clock just after its runs: under the H200's ~700 W
power cap the clock, and with it a kernel's time, moves by several per cent from run to run.
Each TileLang row also gives its speedup over the torch fallback timed in the same run (median over median),
and, at the shapes issue 5 sets goals for (one H200), whether the median meets the goal.
Where a build of FlashMLA (DeepSeek's CUDA kernels for this attention) is importable, its sparse prefill forward is
timed beside ours on the same inputs (`flashmla` rows, FLOPs counted the same way), once its output has been checked
against ours; each TileLang forward row then gives its speedup over FlashMLA's (`vs FlashMLA`).
"""
from __future__ import annotations

import importlib
import json
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import click

from dsv4.config import RUNTIME_SWITCHES

FWD_FLOPS = "4*B*S*H*K*D"
BWD_FLOPS = "10*B*S*H*K*D"


@dataclass(frozen=True)
class AttnShape:
    name: str
    B: int
    S: int
    N: int
    H: int
    D: int
    K: int
    ops: tuple[str, ...] = ("fwd", "bwd")
    upstream: tuple[tuple[str, str], ...] = ()   # (op, the upstream TileLang example measured there; environment.md)
    goals: tuple[tuple[str, float], ...] = ()      # (op, TFLOP/s the kernels must reach on one H200)

    def __str__(self) -> str:
        return f"{self.name}: B{self.B} S{self.S} N{self.N} H{self.H} D{self.D} top-k {self.K} ({', '.join(self.ops)})"

    def note(self, op: str) -> str:
        return dict(self.upstream).get(op, "")

    def row_note(self, op: str, tflops: float) -> str:
        """The note of a TileLang row: the upstream figure at this shape, and whether the goal for the pass is met."""
        goal = dict(self.goals).get(op)
        status = f"goal (H200) {goal:.0f}: {'met' if tflops >= goal else 'NOT met'}" if goal is not None else ""
        return "; ".join(n for n in (self.note(op), status) if n)


SHAPE_SETS = {
    "flash": [AttnShape("v4-flash", 1, 4096, 5120, 64, 512, 640, ("fwd", "bwd"),
                        (("fwd", "upstream V4 illustration: 320"),), (("fwd", 550.0), ("bwd", 250.0)))],
    "upstream": [
        AttnShape("v4-fwd-example", 1, 4096, 8192, 128, 512, 1024, ("fwd",), (("fwd", "upstream V4 illustration: 354"),)),
        AttnShape("v32-fwd", 1, 4096, 4096, 128, 512, 2048, ("fwd",), (("fwd", "upstream V3.2 fwd (D576): 331"),)),
        AttnShape("v32-fwd-pipelined", 1, 4096, 8192, 128, 512, 2048, ("fwd",),
                  (("fwd", "upstream V3.2 pipelined (D576): 548"),)),
        AttnShape("v32-bwd", 1, 4096, 8192, 64, 512, 2048, ("bwd",), (("bwd", "upstream V3.2 bwd (D576): 190"),)),
    ],
}


@dataclass
class Row:
    shape: str
    op: str
    impl: str
    ms: float | None                   # median
    tflops: float | None               # at the median
    note: str = ""
    ms_min: float | None = None
    ms_max: float | None = None
    vs_torch: float | None = None      # torch fallback's median / this row's, same shape and pass, same run
    vs_flashmla: float | None = None   # FlashMLA's median / this row's, same shape and pass, same run
    clock_mhz: float | None = None     # SM clock just after the timed runs (see _timed_runs)

    @classmethod
    def timed(cls, shape: str, op: str, impl: str, runs: tuple[list[float], float | None], flops: int,
              note: str = "") -> "Row":
        times, clock_mhz = runs
        ms = statistics.median_high(times)      # a time that was measured, never an average of two
        return cls(shape, op, impl, ms, flops / ms / 1e9, note, min(times), max(times), clock_mhz=clock_mhz)


HEAD_START_CYCLES = 20_000_000     # ~10 ms of GPU spin at H200 clocks: time for the host to queue every timed run
CLOCK_PROBE_CYCLES = 500_000       # ~0.25 ms: long enough for the events' resolution, too short for the clock to rise


def _timed_runs(fn, warmup: int, iters: int) -> tuple[list[float], float]:
    """(GPU ms of each of `iters` runs of `fn`, run back to back after `warmup` runs; SM clock in MHz after them).

    The runs are queued behind a GPU spin, with an event between each two, so a run's time is its kernels' alone: with
    the GPU idle at each start, the host's ~20 us of Python and launch a call would count as kernel time (3-4 % of the
    V4-Flash forward). The clock comes from a spin of a known number of cycles timed right after the runs: the
    H200 caps its power at ~700 W by lowering the clock (1.5-1.98 GHz seen), which moves a kernel's time by percents."""
    import torch
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(iters + 2)]
    torch.cuda._sleep(HEAD_START_CYCLES)
    events[0].record()
    for i in range(iters):
        fn()
        events[i + 1].record()
    torch.cuda._sleep(CLOCK_PROBE_CYCLES)
    events[-1].record()
    torch.cuda.synchronize()
    times = [a.elapsed_time(b) for a, b in zip(events[:-1], events[1:-1])]
    return times, CLOCK_PROBE_CYCLES / (events[-2].elapsed_time(events[-1]) * 1e3)


def _inputs(sh: AttnShape):
    import torch
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(sh.B, sh.S, sh.H, sh.D, device="cuda", dtype=torch.bfloat16, generator=g)
    kv = torch.randn(sh.B, sh.N, sh.D, device="cuda", dtype=torch.bfloat16, generator=g)
    sink = torch.randn(sh.H, device="cuda", generator=g)
    # distinct rows per query (argsort of noise): the gather pattern of a real top-k, no duplicates
    idx = torch.rand(sh.B * sh.S, sh.N, device="cuda", generator=g).argsort(-1)[:, :sh.K]
    return q, kv, sink, idx.view(sh.B, sh.S, sh.K).int().contiguous()


# Where FlashMLA's builds put its sparse prefill forward: its own package, sgl-kernel, and vllm's vendored copy. All
# share flash_mla_sparse_fwd(q[T,H,D], kv[M,1,D], indices[T,1,K], sm_scale, d_v, attn_sink) -> (out, max_logits, lse):
# no batch dimension, attn_sink in the denominator as ours, -1 (or >= M) an empty slot.
FLASHMLA_MODULES = ("flash_mla", "sgl_kernel.flash_mla", "vllm.third_party.flashmla.flash_mla_interface")
FLASHMLA_TOLERANCE = 2e-2     # relative L2 difference from our output; bf16 rounding alone gives ~2e-3


def flashmla() -> tuple[Callable | None, str]:
    """(FlashMLA's flash_mla_sparse_fwd, the module it came from), or (None, why none could be imported)."""
    tried = []
    for name in FLASHMLA_MODULES:
        try:
            return importlib.import_module(name).flash_mla_sparse_fwd, name
        except (ImportError, OSError, AttributeError, RuntimeError) as e:   # absent, or built for another torch
            tried.append(f"{name}: {type(e).__name__}")
    return None, "; ".join(tried)


def _flashmla_args(q, kv, idx):
    """Our [B,S,H,D] / [B,N,D] / [B,S,K] operands as FlashMLA's batchless ones: batch b's rows offset by b*N."""
    import torch
    B, S, H, D = q.shape
    N = kv.shape[1]
    offset = (torch.arange(B, device=idx.device, dtype=idx.dtype) * N).view(B, 1, 1)
    flat = torch.where((idx >= 0) & (idx < N), idx + offset, -1)
    return q.reshape(B * S, H, D), kv.reshape(B * N, 1, D), flat.reshape(B * S, 1, -1).contiguous()


def bench_flashmla(sh: AttnShape, upstream: tuple[Callable, str], q, kv, sink, idx, scale: float, ours,
                   flops: int, warmup: int, iters: int) -> Row:
    """FlashMLA's forward on our inputs, timed only if its output matches ours (`ours`: o[B,S,H,D])."""
    import torch
    fn, where = upstream
    args = _flashmla_args(q, kv, idx)
    try:
        out = fn(*args, scale, sh.D, sink)[0]
    except RuntimeError as e:             # its own checks: head count, head dim, top-k it was not built for
        return Row(sh.name, "fwd", "flashmla", None, None, f"FlashMLA ({where}) refused: {str(e).splitlines()[0]}")
    ref = ours.reshape(out.shape).float()
    if not torch.isfinite(out).all():
        return Row(sh.name, "fwd", "flashmla", None, None, f"FlashMLA ({where}) gave non-finite output: not timed")
    diff = ((out.float() - ref).norm() / ref.norm()).item()
    if not diff <= FLASHMLA_TOLERANCE:
        return Row(sh.name, "fwd", "flashmla", None, None,
                   f"FlashMLA ({where}) output differs from ours by {diff:.1e} (relative): not timed")
    row = Row.timed(sh.name, "fwd", "flashmla", _timed_runs(lambda: fn(*args, scale, sh.D, sink), warmup, iters), flops)
    row.note = f"FlashMLA from {where}; output within {diff:.1e} of ours"
    return row


def bench_attention(sh: AttnShape, ops: tuple[str, ...], torch_fallback: bool, warmup: int, iters: int,
                    upstream: tuple[Callable, str] | None = None) -> list[Row]:
    import torch
    from dsv4.kernels import reference
    from dsv4.kernels import tilelang_sparse_attn as tl

    q, kv, sink, idx = _inputs(sh)
    scale = sh.D ** -0.5
    per = sh.B * sh.S * sh.H * sh.K * sh.D
    flops = {"fwd": 4 * per, "bwd": 10 * per}
    rows = []
    qp, kvb, sinkp, idxp = tl._pad_inputs(q, kv, sink, idx)
    o, lse2 = tl._fwd(qp, kvb, sinkp, idxp, scale)
    dop = torch.randn_like(o)
    runs = {"fwd": lambda: tl._fwd(qp, kvb, sinkp, idxp, scale),
            "bwd": lambda: tl._bwd(qp, kvb, sinkp, idxp, o, lse2, dop, scale)}
    for op in ops:
        row = Row.timed(sh.name, op, "tilelang", _timed_runs(runs[op], warmup, iters), flops[op])
        row.note = sh.row_note(op, row.tflops)
        rows.append(row)
    if upstream is not None and "fwd" in ops:
        rows.append(bench_flashmla(sh, upstream, q, kv, sink, idx, scale, o[:, :, :sh.H], flops["fwd"], warmup, iters))
    if torch_fallback:
        for op in ops:
            try:
                if op == "fwd":
                    with torch.no_grad():
                        timing = _timed_runs(lambda: reference.sparse_attn_gather(q, kv, sink, idx, scale), 1, 3)
                else:
                    leaves = [t.detach().clone().requires_grad_(True) for t in (q, kv, sink)]
                    out = reference.sparse_attn_gather(*leaves, idx, scale)
                    do = torch.randn_like(out)
                    timing = _timed_runs(lambda: torch.autograd.grad(out, leaves, do, retain_graph=True), 1, 3)
                    del out
                rows.append(Row.timed(sh.name, op, "torch", timing, flops[op]))
            except torch.OutOfMemoryError:
                rows.append(Row(sh.name, op, "torch", None, None, "out of memory"))
            torch.cuda.empty_cache()
    return rows


def bench_indexer(warmup: int, iters: int) -> list[Row]:
    import torch
    from dsv4.kernels import reference
    from dsv4.kernels.tilelang_indexer import indexer_logits
    B, S, Hi, Di, ratio = 1, 4096, 64, 128, 4
    N = S // ratio
    q = torch.randn(B, S, Hi, Di, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, N, Di, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(B, S, Hi, device="cuda")
    flops = 2 * B * S * N * Hi * Di
    name = f"indexer B{B} S{S} N{N} Hi{Hi} Di{Di}"
    ours = _timed_runs(lambda: indexer_logits(q, k, w, ratio), warmup, iters)
    ref = _timed_runs(lambda: reference.indexer_logits_ref(q, k, w, ratio), 1, 3)
    return [Row.timed(name, "fwd", "tilelang", ours, flops), Row.timed(name, "fwd", "torch", ref, flops)]


@click.group()
def bench():
    """Benchmarks on the local GPU."""


@bench.command("kernels")
@click.option("--shapes", default="flash,upstream", show_default=True,
              help=f"comma-separated shape sets: {', '.join(SHAPE_SETS)}")
@click.option("--ops", default="fwd,bwd", show_default=True, help="sparse attention passes to time")
@click.option("--no-torch", is_flag=True, help="skip the torch fallback (it needs tens of GB at large shapes)")
@click.option("--upstream/--no-upstream", default=True, show_default=True,
              help="also time FlashMLA's sparse prefill forward where a build of it is importable "
                   f"({', '.join(FLASHMLA_MODULES)})")
@click.option("--indexer/--no-indexer", default=True, show_default=True)
@click.option("--warmup", default=3, show_default=True)
@click.option("--iters", default=10, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="print JSON on stdout")
def bench_kernels(shapes, ops, no_torch, upstream, indexer, warmup, iters, as_json):
    """TFLOP/s of the TileLang sparse attention (fwd/bwd) and indexer, next to the torch fallback and FlashMLA."""
    import torch
    if not torch.cuda.is_available():
        raise click.UsageError("v4 bench kernels needs a CUDA GPU (none is visible)")
    unknown = [s for s in shapes.split(",") if s not in SHAPE_SETS]
    if unknown:
        raise click.UsageError(f"unknown shape set(s) {unknown}; choose from {list(SHAPE_SETS)}")
    ops = tuple(o for o in ops.split(",") if o)
    fm, fm_where = flashmla() if upstream else (None, "--no-upstream")
    if upstream and fm is None:
        click.echo(f"[bench] FlashMLA is not importable ({fm_where}): no upstream kernel rows", err=True)
    rows, shapes_used = [], []
    for set_name in shapes.split(","):
        for sh in SHAPE_SETS[set_name]:
            shape_ops = tuple(o for o in ops if o in sh.ops)
            click.echo(f"[bench] {sh}", err=True)
            shapes_used.append({**asdict(sh), "upstream": dict(sh.upstream), "goals": dict(sh.goals)})
            rows += bench_attention(sh, shape_ops, not no_torch, warmup, iters, (fm, fm_where) if fm else None)
    if indexer:
        rows += bench_indexer(warmup, iters)
    with_speedups(rows)
    report = {"device": torch.cuda.get_device_name(),
              "flashmla": {"module": fm_where} if fm else {"module": None, "why_not": fm_where},
              "flops": {"fwd": FWD_FLOPS, "bwd": BWD_FLOPS, "indexer": "2*B*S*N*Hi*Di"},
              "shapes": shapes_used, "rows": [asdict(r) for r in rows]}
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    click.echo(f"device: {report['device']}   FLOPs: fwd {FWD_FLOPS}, bwd {BWD_FLOPS} (K = top-k slots, padding included)")
    click.echo(table(rows))


def model_options(f):
    """--device, --model, --model-overrides, --attn-impl: the model a bench builds (see `bench_model`)."""
    for opt in reversed([
            click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True),
            click.option("--model", default=None, help="model preset (default: tiny on cpu, 4layer on cuda)"),
            click.option("--model-overrides", default=None,
                         help="model field overrides (default on cuda: n_routed_experts=8, the smoke's 4-layer model)"),
            click.option("--attn-impl", type=click.Choice(["auto", "torch", "tilelang"]), default="auto",
                         show_default=True)]):
        f = opt(f)
    return f


def bench_model(device: str, model: str | None, model_overrides: str | None, attn_impl: str,
                rank_of: str | None = None):
    """-> (cuda, preset name, overrides dict): the smoke's model on a GPU (4layer, 8 experts, TileLang), the tiny
    one with the torch attention on a CPU, unless the options say otherwise. With --rank-of the layout's model is
    a real one, by default flash on a GPU (tiny on a CPU), without the smoke's expert override."""
    import torch

    from dsv4.config import parse_overrides
    cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if cuda and not torch.cuda.is_available():
        raise click.UsageError("--device cuda: no CUDA GPU is visible")
    smoke = "n_routed_experts=8" if cuda and not rank_of else ""
    try:
        overrides = parse_overrides(model_overrides if model_overrides is not None else smoke)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--model-overrides") from None
    overrides["attn_impl"] = attn_impl if attn_impl != "auto" else ("tilelang" if cuda else "torch")
    default = ("flash" if cuda else "tiny") if rank_of else ("4layer" if cuda else "tiny")
    return cuda, model or default, overrides


def rank_options(f):
    """--rank-of, --stage, --layers: one rank of a parallel layout (dsv4/megatron/rankshape.py)."""
    for opt in reversed([
            click.option("--rank-of", "rank_of", default=None, metavar="'TP=8 PP=8 EP=8 [ETP= CP= DP= FIRST= LAST=]'",
                         help="build what rank 0 of this layout computes (its layers, local experts, tokens per "
                              "expert, heads and vocabulary under TP), of the --model (default flash on a GPU); "
                              "FIRST/LAST/LAYOUT split the pipeline as PRESET_PP_FIRST_LAYERS/LAST_LAYERS/LAYOUT. "
                              "Communication is absent: one device"),
            click.option("--stage", default="mixed", show_default=True,
                         help="with --rank-of: the pipeline stage the rank holds: mixed (a slice as long as the "
                              "longest stage with every attention kind, hash and score routing, the MTP and the LM "
                              "head), first, last, or a stage number"),
            click.option("--layers", type=int, default=None,
                         help="with --rank-of: the slice's layer count instead of the stage's (one that fits the "
                              "device's memory: `v4 bench step` names the largest the cost model says fits)")]):
        f = opt(f)
    return f


def build_rank(model: str, overrides: dict, rank_of: str, stage: str, layers: int | None, train: bool,
               seq_len: int | None = None):
    """-> (RankShape, its model config) for --rank-of; usage errors name what does not fit."""
    from dsv4.config import ModelConfig
    from dsv4.megatron.rankshape import RankLayout, rank_shape
    from launcher.config.checks import pipeline_split
    try:
        full = ModelConfig.preset(model).with_overrides(**overrides)
        lay = RankLayout.parse(rank_of)
        try:
            split = pipeline_split(full.n_layers, lay.pp, lay.first, lay.last, lay.layout)
        except ValueError as e:
            raise ValueError(f"{e}: add FIRST= and LAST= to --rank-of (V4-Flash over PP8: FIRST=4 LAST=3, as "
                             "presets/full.env) or LAYOUT=") from None
        rank = rank_shape(full, lay, tuple(split), stage, layers, train=train, seq_len=seq_len)
        return rank, rank.model_config()
    except (KeyError, ValueError, TypeError) as e:
        raise click.BadParameter(str(e), param_hint="--rank-of/--stage/--layers/--model-overrides") from None


RECORDS = Path(__file__).resolve().parents[2] / "benchmarks" / "records"


def record_option(f):
    f = click.option("--records-dir", "records_dir", type=click.Path(file_okay=False, path_type=Path),
                     default=RECORDS, show_default=True, help="where --record appends")(f)
    return click.option(
        "--record", "record", default=None, metavar="ID",
        help="append each row as a dated record to the records file of this bench (benchmark id ID, suffixed per "
             "row), with the command, the commit (V4_BENCH_COMMIT where set, else git's) and the device")(f)


def append_records(records_dir: Path, file: str, device: str, records: list[dict], say) -> Path:
    """One JSON line a record in RECORDS_DIR/FILE (see docs/pipeline.md): date, commit, device, benchmark, shape,
    variant, metrics, command, note, plus what a record adds (the rank shape, the profile)."""
    import datetime
    import os
    import shlex
    import sys

    from launcher.registry import code_version
    # V4_BENCH_COMMIT, where set, names the code: a copy of the tree on a GPU host may carry a git of some older
    # commit with the newer files over it (then git's sha is the older one, and "dirty" says only that they differ)
    ver = {"sha": os.environ["V4_BENCH_COMMIT"], "dirty": None} if os.environ.get("V4_BENCH_COMMIT") \
        else code_version(RECORDS.parents[1])
    base = {"date": datetime.datetime.now(datetime.timezone.utc).date().isoformat(),
            "commit": (ver.get("sha") or "")[:7] or None, "dirty": ver.get("dirty"), "device": device,
            "clock_mhz": None}
    command = "v4 " + shlex.join(sys.argv[1:])
    path = Path(records_dir) / file
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        for r in records:
            f.write(json.dumps({**base, **r, "command": command}) + "\n")
    say(f"[bench] {len(records)} record(s) appended to {path}")
    return path


@bench.command("rollout")
@model_options
@rank_options
@click.option("--batches", default="1,2,4,8,16,32,64", show_default=True)
@click.option("--prompt-len", default=None, type=int, help="tokens fed before timing (default: 16 cpu, 256 cuda)")
@click.option("--steps", default=8, show_default=True, help="timed decode steps per batch size")
@click.option("--warmup", default=2, show_default=True)
@click.option("--modes", default="graph", show_default=True,
              help="decode modes side by side, comma-separated: graph (the engine's compiled, graphed step), "
                   "uncompiled (the same graph without torch.compile), eager (op by op); a CPU runs eager only")
@click.option("--eager", is_flag=True, help="shorthand for --modes graph,uncompiled,eager")
@click.option("--sync", "sync_paths", default="tensor,tensor-fp8,disk,distributed", show_default=True,
              help="weight-update paths to time (empty: none)")
@click.option("--profile-top", "profile_top", default=0, show_default=True, type=click.IntRange(min=0),
              help="after timing each batch size and mode, profile the same steps and print the N kernels with the "
                   "most device time a step, and the time between kernels (0: no profile)")
@record_option
@click.option("--json", "as_json", is_flag=True, help="print JSON on stdout")
def bench_rollout(device, model, model_overrides, attn_impl, rank_of, stage, layers, batches, prompt_len, steps,
                  warmup, modes, eager, sync_paths, profile_top, record, records_dir, as_json):
    """Decode tokens/s of the embedded rollout engine (its CUDA-graphed step, and with --eager the same step
    launched op by op) beside the HBM roofline of the same step, and the seconds and GB/s of each weight-update
    path. With --rank-of, the model is what one rank of an expert-parallel rollout holds (its stage's layers,
    E/EP experts), each rank decoding its own batch."""
    import torch

    from dsv4.config import ModelConfig
    from dsv4.model import Transformer
    from dsv4.rl import bench as rb
    from dsv4.rl.engine import EmbeddedEngine

    cuda, model, overrides = bench_model(device, model, model_overrides, attn_impl, rank_of)
    dev = "cuda" if cuda else "cpu"
    say = (lambda m: click.echo(m, err=True))
    modes = rb.MODES if eager else tuple(m for m in modes.split(",") if m)
    bad = [m for m in modes if m not in rb.MODES]
    if bad or not modes:
        raise click.BadParameter(f"{','.join(bad) or '(none)'}: choose from {', '.join(rb.MODES)}", param_hint="--modes")
    try:
        batch_sizes = [int(b) for b in batches.split(",") if b]
    except ValueError:
        raise click.BadParameter(f"{batches!r}: comma-separated integers", param_hint="--batches") from None
    plen = prompt_len or (256 if cuda else 16)
    rank = None
    if rank_of:
        rank, cfg = build_rank(model, overrides, rank_of, stage, layers, train=False)
    else:
        try:
            cfg = ModelConfig.preset(model).with_overrides(**overrides)
        except (KeyError, ValueError, TypeError) as e:
            raise click.BadParameter(str(e), param_hint="--model/--model-overrides") from None
    say(f"[bench] building {model} {overrides or ''} on {dev}" + (f": {cfg.n_layers} layers, {cfg.n_routed_experts} "
                                                                  "experts" if rank else ""))
    engine = EmbeddedEngine(Transformer(cfg).to(dev), model_path=f"preset:{model}", seed=0)
    bw = rb.copy_bandwidth(engine.device)
    profiles = [] if profile_top else None
    rows = rb.bench_decode(engine, batch_sizes, plen, steps, warmup, bw, say, modes=modes, profiles=profiles)
    sync_rows = rb.bench_sync(engine, [p for p in sync_paths.split(",") if p], say)
    dev_name = torch.cuda.get_device_name() if cuda else "cpu"
    report = {"device": dev_name, "model": model, "overrides": overrides,
              "experts": cfg.n_routed_experts, "top_k": cfg.n_activated_experts, "layers": cfg.n_layers,
              "rank": rank.summary(plen, 1, train=False) if rank else None,
              "copy_bandwidth_gb_s": bw / 1e9, "graph_capture_failed": rb.decode.GraphedStep.capture_failed,
              "compile_failed": rb.decode.GraphedStep.compile_failed,
              "decode": [{**asdict(r), "tokens_per_expert": r.batch * cfg.n_activated_experts / cfg.n_routed_experts}
                         for r in rows],
              "sync": [asdict(r) for r in sync_rows],
              "profiles": [{**asdict(p), "kernels": [asdict(k) for k in p.kernels[:profile_top]]}
                           for p in profiles or []]}
    if record:
        shape = (f"{model} {' '.join(f'{k}={v}' for k, v in overrides.items())}, {cfg.n_layers} layers, "
                 f"{cfg.n_routed_experts} experts (top-{cfg.n_activated_experts}), {cfg.dtype}, prompt {plen}")
        if rank:
            shape += f"; rank 0 of {rank.layout}, {rank.stage_name()}"
        note = "roofline at the copy bandwidth measured in the same run" + (
            "; communication absent (one device: no EP all-to-all)" if rank else "")
        recs = [{"benchmark": f"{record}_b{r.batch}_{r.mode}", "shape": shape,
                 "metrics": {"ms_per_step": round(r.step_ms, 3), "tokens_per_s": round(r.tokens_per_s, 1),
                             "of_roofline": round(r.achieved, 3), "roofline_ms": round(r.roofline_ms, 3),
                             "weight_mb": round(r.weight_bytes / 1e6, 1), "kv_mb": round(r.kv_bytes / 1e6, 2)},
                 "note": note, **({"rank": report["rank"]} if rank else {})} for r in rows]
        recs += [{"benchmark": f"{record}_sync_{r.path}", "shape": shape,
                  "metrics": {"seconds": round(r.seconds, 3), "gb_per_s": round(r.gb_per_s, 2), "bytes": r.bytes},
                  "note": note} for r in sync_rows]
        append_records(records_dir, "rollout.jsonl", dev_name, recs, say)
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    click.echo(f"device: {report['device']}   model: {model} {overrides or ''}   {cfg.n_layers} layers, "
               f"{cfg.n_routed_experts} experts (top-{cfg.n_activated_experts})")
    if rank:
        for line in rank.describe(plen, 1, train=False):
            click.echo(line)
    if report["graph_capture_failed"]:
        click.echo(f"CUDA graph capture failed, eager only: {report['graph_capture_failed']}")
    if report["compile_failed"]:
        click.echo(f"compiling the decode step failed, graphs uncompiled: {report['compile_failed']}")
    click.echo(rb.table(rows, bw))
    for p in profiles or []:
        click.echo(p.table(profile_top))
    if sync_rows:
        click.echo(f"{'weight update':<24} {'tensors':>7} {'GB':>8} {'s':>8} {'GB/s':>7}")
        for r in sync_rows:
            click.echo(f"{r.path:<24} {r.tensors:>7} {r.bytes / 1e9:>8.3f} {r.seconds:>8.3f} {r.gb_per_s:>7.2f}")


def peak_tflops_of(device_name: str) -> float:
    """HW_PEAK_TFLOPS of the hw layer whose HW_GPU_NAME names this GPU, 0 where none does."""
    from launcher.config.envfile import parse_file
    from launcher.config.resolve import hw_for_gpu, layer_file
    hw = hw_for_gpu(device_name)
    vals = {a.key: a.raw for a in parse_file(layer_file("hw", hw))} if hw else {}
    return float(vals.get("HW_PEAK_TFLOPS") or 0)


@dataclass
class StepPlan:
    """What launcher/costmodel.py predicts for the process `v4 bench step` is about to build (its BenchShape on this
    GPU), before anything is built: the bench refuses a shape the model says does not fit, and prints and records
    the prediction beside the measured peak when it runs."""
    shape: object                     # costmodel.BenchShape
    hw: object                        # costmodel.Hardware: this device
    prediction: object                # costmodel.Prediction
    what: str                         # the shape in words, for the messages

    def lines(self) -> list[str]:
        from launcher import costmodel
        return costmodel.memory_lines(self.prediction, self.hw)

    def to_json(self) -> dict:
        p = self.prediction
        return {**self.shape.to_json(), "hw": self.hw.name, "gpu_memory_gib": round(self.hw.memory_gib, 2),
                "predicted": {"peak_gib": round(p.peak_gib, 2), "usable_gib": round(p.usable_gib, 2),
                              "fits": p.fits, "memory_gib": {k: round(v, 3) for k, v in p.memory.parts.items()},
                              "phases_gib": {k: round(v, 2) for k, v in p.memory.detail["phases_gib"].items()},
                              "step_s": None if p.step_s is None else round(p.step_s, 4)}}


def _specs(fields: dict) -> tuple[str, ...]:
    """Model fields as the cost model's override strings ("k=v"; lists as JSON without spaces)."""
    return tuple(f"{k}={json.dumps(v, separators=(',', ':')) if isinstance(v, list) else v}"
                 for k, v in fields.items())


def step_shape(model: str, overrides: dict, rank, seq_len: int, global_batch: int, micro_batch: int,
               recompute: str):
    """The planner's inputs (launcher.costmodel.BenchShape) for the process bench_step builds: the preset with the
    bench's overrides and, with --rank-of, the rank's slice (RankShape.slice_overrides, what its model_config
    applies), TP/ETP as the stand-in builds them, the MTP block trained where the slice holds it, and the model
    config's expert weight-gradient path (moe_impl=grouped_triton) and head loss."""
    from launcher import costmodel
    lay = rank.layout if rank else None
    specs = _specs({**overrides, **(rank.slice_overrides() if rank else {})})
    cfg = costmodel.model_shape(model, specs, seq_len).cfg
    return costmodel.BenchShape(model, specs,
                                tp=lay.tp if lay else 1, etp=lay.etp if lay else 1, seq_len=seq_len,
                                global_batch=global_batch, micro_batch=micro_batch, recompute=recompute,
                                mtp=bool(rank and rank.mtp), attn_impl=overrides.get("attn_impl", "tilelang"),
                                expert_wgrad="triton" if cfg.moe_impl == "grouped_triton" else "main_grad",
                                head_loss=cfg.head_loss)


def step_plan(model: str, overrides: dict, rank, seq_len: int, global_batch: int, micro_batch: int, recompute: str,
              gpu_name: str, total_gib: float) -> StepPlan:
    """The cost model's prediction for bench_step's process on the GPU `gpu_name` of `total_gib` (as the device
    reports it: what the allocator can ever have, not the hw layer's nominal figure)."""
    from launcher import costmodel
    shape = step_shape(model, overrides, rank, seq_len, global_batch, micro_batch, recompute)
    hw = costmodel.device_hardware(gpu_name, total_gib, shape.tp)
    cfg = costmodel.model_shape(shape.model, shape.overrides, seq_len).cfg
    what = (f"rank 0 of {rank.layout}, {rank.stage_name()}, " if rank else "") + (
        f"{cfg.n_layers} layers" + (f" + {cfg.n_mtp_layers} MTP" if shape.mtp else "")
        + f", {cfg.n_routed_experts} experts, micro-batch {micro_batch} x {seq_len}")
    return StepPlan(shape, hw, costmodel.predict_bench(shape, hw), what)


def what_fits(plan: StepPlan, model: str, overrides: dict, rank_of: str | None, stage: str, rank,
              seq_len: int, global_batch: int, micro_batch: int, recompute: str) -> list[str]:
    """The nearest shapes the model says fit, for the refusal: the largest --layers of the rank's slice (without
    --rank-of, the largest n_layers override), and the largest smaller micro-batch."""
    from dataclasses import replace as dc_replace

    from launcher import costmodel
    out = []
    layers_now = costmodel.model_shape(plan.shape.model, plan.shape.overrides, seq_len).cfg.n_layers
    for n in range(layers_now - 1, 0, -1):
        try:
            if rank_of:
                r, _ = build_rank(model, overrides, rank_of, stage, n, train=True, seq_len=seq_len)
                b = step_shape(model, overrides, r, seq_len, global_batch, micro_batch, recompute)
                flag = f"--layers {n}"
            else:
                fields = {**overrides, "n_layers": n}
                b = step_shape(model, fields, None, seq_len, global_batch, micro_batch, recompute)
                flag = "--model-overrides '" + " ".join(f"{k}={v}" for k, v in fields.items() if k != "attn_impl") + "'"
            p = costmodel.predict_bench(b, plan.hw)
        except (click.BadParameter, KeyError, ValueError, TypeError):
            continue              # a length the model cannot be cut to (its hash-routed layers, say)
        if p.fits:
            out.append(f"{flag} (predicted {p.peak_gib:.1f} GiB)")
            break
    else:
        out.append("no --layers fits" if rank_of else "no layer count fits")
    for mb in range(micro_batch - 1, 0, -1):
        if global_batch % mb == 0:
            p = costmodel.predict_bench(dc_replace(plan.shape, micro_batch=mb), plan.hw)
            if p.fits:
                out.append(f"--micro-batch {mb} (predicted {p.peak_gib:.1f} GiB)")
                break
    return out


def refuse_or_warn(plan: StepPlan, alternatives: list[str], skip: bool, say) -> None:
    """Exit 2 when the predicted peak exceeds what this GPU leaves usable, naming the parts and what fits instead;
    with --skip-fit-check, say so and go on."""
    from launcher import costmodel
    from launcher.errors import USAGE, V4Error
    p = plan.prediction
    # (not the planner's overflow text: its remedies, shard the optimizer or add stages, are a cluster's)
    why = (f"the cost model predicts {plan.what} peaks at {p.peak_gib:.1f} GiB, more than the "
           f"{p.usable_gib:.1f} GiB this {plan.hw.gpu or 'GPU'} leaves usable")
    if skip:
        say(f"[bench] --skip-fit-check: building anyway; {why}")
        return
    fits = "; ".join(alternatives)
    raise V4Error(f"v4 bench step: {why}\n  " + "\n  ".join(costmodel.memory_lines(p, plan.hw)),
                  fix=f"what the model says fits: {fits}; --skip-fit-check builds anyway (the model holds memory to "
                      f"+-{costmodel.MODEL_TOLERANCE['memory']:.0%}: docs/plan.md)", code=USAGE)


@bench.command("step")
@model_options
@rank_options
@click.option("--seq-len", type=int, default=None, help="tokens per sequence (default: 64 cpu, 4096 cuda)")
@click.option("--global-batch", type=int, default=None,
              help="sequences per step (default: 2 cpu, 8 cuda: the smoke's); with --rank-of the rank's share")
@click.option("--micro-batch", type=int, default=1, show_default=True)
@click.option("--recompute", type=click.Choice(["none", "full"]), default="none", show_default=True)
@click.option("--warmup", type=int, default=2, show_default=True)
@click.option("--steps", type=int, default=3, show_default=True, help="timed steps per variant (the median is printed)")
@click.option("--compare", "compare", default=None, metavar="KEY=V1,V2 | 'K=V K=V;K=V ...'",
              help="time variants side by side on the same weights and batches: the values of one runtime switch "
                   "(fp32_gemm=fp32,bf16x3), or variants separated by ';', each a set of switches "
                   "('fp32_gemm=bf16x3;fp32_gemm=bf16x3_fwd compiled=hc'). Switches: " + ", ".join(RUNTIME_SWITCHES))
@click.option("--top", type=int, default=0, show_default=True, help="also list the profiled step's N longest kernels")
@click.option("--peak-tflops", type=float, default=None,
              help="MFU's denominator (default: HW_PEAK_TFLOPS of the hw/*.env whose HW_GPU_NAME names this GPU)")
@click.option("--profile", "profile", type=click.Choice(["last", "each", "none"]), default="last", show_default=True,
              help="profile one more step of the last variant, of each (their tables side by side; reading a "
                   "profile takes ~30 s on the GPU), or none")
@click.option("--nonfinite-hooks", "hooks", is_flag=True,
              help="one more row: the last variant with the non-finite hooks on every module, as "
                   "PRESET_NONFINITE_LOCATE=every_step trains (the default attaches them only to re-run a bad step)")
@click.option("--skip-fit-check", "skip_fit_check", is_flag=True,
              help="build even when launcher/costmodel.py predicts the step's peak memory exceeds this GPU's "
                   "(before building, the bench predicts the process it is about to build and refuses, exit 2, a "
                   "shape that does not fit, naming the parts and the largest --layers or micro-batch that does; "
                   "on a CPU there is no check)")
@record_option
@click.option("--json", "as_json", is_flag=True, help="print JSON on stdout")
def bench_step(device, model, model_overrides, attn_impl, rank_of, stage, layers, seq_len, global_batch, micro_batch,
               recompute, warmup, steps, compare, top, peak_tflops, profile, hooks, skip_fit_check, record,
               records_dir, as_json):
    """Training step speed: tokens/s, TFLOP/s and MFU of the real trainer (megatron-core DDP and optimizer, one
    process), and a profiled step's device time by part of the model (attention, indexer, compressors,
    hyper-connections, norms, router and dispatch, expert GEMMs, LM head and loss, optimizer, communication,
    idle), which add up to the step. With --rank-of, what rank 0 of a parallel layout computes, on one device.

    On a GPU the cost model (launcher/costmodel.py, `v4 plan`) first predicts the process's peak memory: a shape it
    says does not fit is refused in seconds instead of running out of memory after minutes of compiling
    (--skip-fit-check builds it anyway); the prediction is printed beside the measured peak and recorded."""
    import torch

    from dsv4.config import ModelConfig
    from dsv4.megatron import stepprof

    cuda, model, overrides = bench_model(device, model, model_overrides, attn_impl, rank_of)
    variants = parse_variants(compare) if compare else None
    seq_len = seq_len or (4096 if cuda else 64)
    rank = None
    if rank_of:
        rank, cfg = build_rank(model, overrides, rank_of, stage, layers, train=True, seq_len=seq_len)
    try:
        if not rank:
            cfg = ModelConfig.preset(model).with_overrides(**overrides)
        for v in variants or []:
            cfg.with_overrides(**v)
    except (KeyError, ValueError, TypeError) as e:
        raise click.BadParameter(str(e), param_hint="--model-overrides/--compare") from None
    dev = "cuda" if cuda else "cpu"
    if peak_tflops is None:
        peak_tflops = peak_tflops_of(torch.cuda.get_device_name()) if cuda else 0.0
    say = (lambda m: click.echo(m, err=True))
    global_batch = global_batch or (8 if cuda else 2)
    if rank:
        for line in rank.describe(seq_len, micro_batch):
            say(f"[bench] {line}")
    plan, plans = None, []      # plans: each variant's (a switch such as head_loss changes the prediction)
    if cuda:      # a CPU's memory is the host's: nothing to predict against
        plan = step_plan(model, overrides, rank, seq_len, global_batch, micro_batch, recompute,
                         torch.cuda.get_device_name(),
                         torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / 2 ** 30)
        for line in plan.lines():
            say(f"[bench] {line}")
        # the variants run in this process one after another: each must fit (a switch such as head_loss changes
        # what the step keeps)
        gpu = (torch.cuda.get_device_name(),
               torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / 2 ** 30)
        for v in variants or [{}]:
            vo = {**overrides, **v}
            vplan = plan if not v else step_plan(model, vo, rank, seq_len, global_batch, micro_batch, recompute, *gpu)
            plans.append(vplan)
            if not vplan.prediction.fits:
                if v:
                    vplan.what += " (variant " + " ".join(f"{k}={x}" for k, x in v.items()) + ")"
                refuse_or_warn(vplan, [] if skip_fit_check else what_fits(
                    vplan, model, vo, rank_of, stage, rank, seq_len, global_batch, micro_batch, recompute),
                    skip_fit_check, say)
    try:
        res = stepprof.bench_step(cfg, seq_len=seq_len, global_batch=global_batch, micro_batch=micro_batch,
                                  steps=steps, warmup=warmup, device=dev, recompute=recompute,
                                  peak_tflops=peak_tflops, variants=variants, profile=profile, top=top,
                                  hooks=hooks, rank=rank, say=say)
    except torch.OutOfMemoryError as e:
        said = ""
        if plan:
            pred = f"{plan.prediction.peak_gib:.1f} GiB of {plan.prediction.usable_gib:.1f} usable"
            said = (f" (the cost model predicted {pred}: a miss, for benchmarks/records/plan_validation.jsonl)"
                    if plan.prediction.fits else f" (as the cost model predicted: {pred})")
        raise click.UsageError(f"out of device memory ({str(e).splitlines()[0]}): the model of {cfg.n_layers} layers "
                               f"and {cfg.n_routed_experts} experts with its Adam state does not fit{said}; try fewer "
                               "--layers, a larger TP or EP in --rank-of, or --micro-batch 1") from None
    finally:
        import torch.distributed as dist
        if dist.is_initialized():      # left initialized, NCCL's exit can hang the process after its output
            dist.destroy_process_group()
    rows = res["rows"]
    dev_name = torch.cuda.get_device_name() if cuda else "cpu"
    report = {"device": dev_name, "model": model, "overrides": overrides,
              "peak_tflops": peak_tflops, "rank": rank.summary(seq_len, micro_batch) if rank else None, **res,
              "rows": [{**asdict(r), "parts_ms": r.parts_ms} for r in rows],
              "top_kernels": [asdict(k) for k in res["top_kernels"]],
              "plan": plan.to_json() if plan else None}
    if record:
        recs = step_records(record, rows, model, overrides, cfg, seq_len, global_batch, micro_batch, peak_tflops, rank,
                            res["routing"], plans)
        append_records(records_dir, "train_step.jsonl", dev_name, recs, say)
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    click.echo(f"device: {report['device']}   model: {model} {overrides}   "
               f"{res['tokens_per_step']:,} tokens/step, {res['flops_per_token'] / 1e9:.2f} GFLOP/token (model"
               + (f", the rank's share 1/{round(1 / res['flops_share'])}" if res["flops_share"] != 1 else "") + ")"
               + (f", peak {peak_tflops:g} TFLOP/s" if peak_tflops else ""))
    if rank:
        for line in rank.describe(seq_len, micro_batch):
            click.echo(line)
    if res["routing"]:
        r = res["routing"]
        click.echo(f"tokens per expert, measured on one micro-batch: mean {r['tokens_per_expert_mean']:,.0f}, "
                   f"min {r['tokens_per_expert_min']:,.0f}, max {r['tokens_per_expert_max']:,.0f}")
    w = max([24] + [len(r.variant) + 4 for r in rows])
    click.echo(f"{'variant':<{w}} {'s/step':>8} {'pred s':>7} {'tokens/s':>10} {'TFLOP/s':>8} {'MFU':>6} {'loss':>9} "
               f"{'peak GB':>8} {'pred GiB':>9}")
    for i, r in enumerate(rows):
        p = plans[min(i, len(plans) - 1)].prediction if plans else None     # the hooks' row: the last variant's
        pred_peak = f"{p.peak_gib:>9.1f}" if p else f"{'-':>9}"
        pred_step = f"{p.step_s:>7.3f}" if p and p.step_s else f"{'-':>7}"
        mfu = f"{r.mfu:.1%}" if r.mfu is not None else "-"
        label = f"({i + 1}) {r.variant}" if len(rows) > 1 else r.variant
        click.echo(f"{label:<{w}} {r.step_s:>8.3f} {pred_step} {r.tokens_per_s:>10,.0f} {r.model_tflops:>8.1f} "
                   f"{mfu:>6} {r.loss:>9.4f} {r.peak_mem_gb:>8.1f} {pred_peak}")
    if plan:
        click.echo("(pred: launcher/costmodel.py for this process, before it was built; peak GB is "
                   "torch.cuda.max_memory_allocated in GiB, the figure the model predicts)")
        for line in plan.lines():
            click.echo(line)
    profiled = [i for i, r in enumerate(rows) if r.parts]          # (the hooks' row is timed only)
    if len(profiled) > 1:
        click.echo("\nwhere each profiled step's time goes (device ms by part; share: the last variant's):")
        click.echo(stepprof.compare_table(rows))
    elif profiled:
        r = rows[profiled[0]]
        click.echo(f"\nwhere the profiled step's time goes ({r.variant}):")
        click.echo(stepprof.table(r.parts, r.profiled_wall_s, r.overlap_ms or 0.0))
    if res["top_kernels"]:
        click.echo(f"\nthe {len(res['top_kernels'])} longest kernels of ({profiled[-1] + 1}) (total over the profiled "
                   "step):")
        click.echo(stepprof.kernel_table(res["top_kernels"]))


def step_records(record: str, rows, model: str, overrides: dict, cfg, seq_len: int, global_batch: int,
                 micro_batch: int, peak_tflops: float, rank, routing, plans: list[StepPlan] = ()) -> list[dict]:
    """One record a timed row: benchmark RECORD (RECORD_2, ... for several variants; RECORD_nonfinite_hooks for the
    hooks' row), the profile's parts where the row was profiled, and on a GPU the cost model's inputs and prediction
    ("plan", the row's variant's: what `v4 plan calibration` re-predicts and compares with the measured peak and
    step). `plans`: one a variant, in the rows' order (the hooks' row repeats the last variant)."""
    shape = (f"{model} {' '.join(f'{k}={v}' for k, v in overrides.items())}, {cfg.n_layers} layers"
             + (f" + {cfg.n_mtp_layers} MTP" if rank and rank.mtp else "")
             + f", {cfg.n_routed_experts} experts, {global_batch} x {seq_len} tokens, micro-batch {micro_batch}")
    if rank:
        shape += f"; rank 0 of {rank.layout}, {rank.stage_name()}"
    note = (f"MFU against {peak_tflops:g} TFLOP/s" if peak_tflops else "no peak given: no MFU") + (
        "; communication absent (one device), model FLOPs the rank's share" if rank else "")
    out = []
    timed = [r for r in rows if not r.variant.endswith(" + non-finite hooks")]
    for i, r in enumerate(rows):
        if r.variant.endswith(" + non-finite hooks"):
            bench_id = f"{record}_nonfinite_hooks"
        else:
            bench_id = record if len(timed) == 1 or i == 0 else f"{record}_{i + 1}"
        rec = {"benchmark": bench_id, "shape": shape, "variant": r.variant,
               "metrics": {"step_s": round(r.step_s, 4), "tokens_per_s": round(r.tokens_per_s),
                           "model_tflops": round(r.model_tflops, 1),
                           "mfu": round(r.mfu, 4) if r.mfu is not None else None,
                           "loss_fixed_batch": round(r.loss, 4), "peak_mem_gb": round(r.peak_mem_gb, 1)},
               "note": note}
        if r.parts:
            rec["profile"] = {"wall_ms": round(r.profiled_wall_s * 1e3, 1), "parts_ms": round(r.parts_ms, 1),
                              "overlap_ms": round(r.overlap_ms or 0.0, 1),
                              "parts": {p.name: round(p.ms, 1) for p in r.parts}}
        if rank:
            rec["rank"] = rank.summary(seq_len, micro_batch)
            rec["routing"] = routing
        if plans:
            rec["plan"] = plans[min(i, len(plans) - 1)].to_json()
        out.append(rec)
    return out


def parse_variants(text: str) -> list[dict[str, str]]:
    """--compare: 'KEY=V1,V2' (one switch, several values) or 'K=V K=V;K=V' (variants, each a set of switches)."""
    def bad(why):
        return click.BadParameter(f"{text!r}: {why}; switches: {', '.join(RUNTIME_SWITCHES)}", param_hint="--compare")
    if ";" not in text and " " not in text.strip():
        key, _, values = text.partition("=")
        if key not in RUNTIME_SWITCHES or not values:
            raise bad("KEY=V1,V2 with KEY a runtime switch")
        return [{key: v} for v in values.split(",") if v]
    variants = []
    for part in text.split(";"):
        v = {}
        for item in part.split():
            key, eq, value = item.partition("=")
            if key not in RUNTIME_SWITCHES or not eq or not value:
                raise bad(f"{item!r} is not SWITCH=VALUE")
            v[key] = value
        if v:
            variants.append(v)
    if not variants:
        raise bad("no variant")
    return variants


def with_speedups(rows: list[Row]) -> list[Row]:
    """Set each TileLang row's speedup over the torch and the FlashMLA row of its shape and pass (where those ran)."""
    def medians(impl):
        return {(r.shape, r.op): r.ms for r in rows if r.impl == impl and r.ms is not None}
    torch_ms, flashmla_ms = medians("torch"), medians("flashmla")
    for r in rows:
        if r.impl == "tilelang" and r.ms is not None:
            key = (r.shape, r.op)
            r.vs_torch = torch_ms[key] / r.ms if key in torch_ms else None
            r.vs_flashmla = flashmla_ms[key] / r.ms if key in flashmla_ms else None
    return rows


def table(rows: list[Row]) -> str:
    """ms is the median; min-max the fastest and slowest timed run; vs torch / vs FlashMLA the speedup over the fallback
    and over FlashMLA (above 1: ours is faster); MHz the SM clock just after the runs."""
    lines = [f"{'shape':<40} {'op':<4} {'impl':<9} {'ms':>9} {'min-max':>17} {'TFLOP/s':>8} {'vs torch':>8} "
             f"{'vs FlashMLA':>11} {'MHz':>5}  note"]
    for r in rows:
        ms = f"{r.ms:.3f}" if r.ms is not None else "-"
        spread = f"{r.ms_min:.3f}-{r.ms_max:.3f}" if r.ms_min is not None else "-"
        tf = f"{r.tflops:.1f}" if r.tflops is not None else "-"
        vs = f"{r.vs_torch:.1f}x" if r.vs_torch is not None else "-"
        vs_fm = f"{r.vs_flashmla:.3f}x" if r.vs_flashmla is not None else "-"
        mhz = f"{r.clock_mhz:.0f}" if r.clock_mhz is not None else "-"
        lines.append(f"{r.shape:<40} {r.op:<4} {r.impl:<9} {ms:>9} {spread:>17} {tf:>8} {vs:>8} {vs_fm:>11} {mhz:>5}  "
                     f"{r.note}")
    return "\n".join(lines)
