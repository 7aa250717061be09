"""Where a training step's time goes: device time by part of the model, from one profiled step.

torch.profiler records each kernel with the CPU op that launched it. Forward ops are attributed through the
scopes that `scopes()` opens around each module's forward (the innermost part wins: the indexer's compressor
counts as a compressor, the attention's q norm as a norm); backward ops through autograd's sequence numbers,
which tie each backward node to the forward op that created it (a recomputed forward runs inside the same
scopes again, so recompute lands in its part). Wherever they run, NCCL kernels count as communication;
`optimizer_scope` marks the optimizer step; ops outside every scope are "other" (gradient buffers, norms of
the gradient, loss reductions). Idle is the step's wall time minus the union of kernel intervals.

Each kernel is counted once. The profiler also lists, among the device's events, one span per user annotation
(every `record_function`: our part scopes, torch.optim's `Optimizer.step#...`) that covers the kernels launched
inside it: on the H200, 103 such spans in a step of 16,863 device events, 739 ms of "device time" in a 755 ms step
whose kernels took 373 ms. Taken as kernel intervals they hid most of the idle time (204 ms instead of 382), and
linked to their annotation's op as a kernel (as torch links a device event to the op of its correlation id) they
would count each scope's time twice. Only the device events that are not annotations are kernels here
(`device_kernels`), and each op's kernel list is read against them, so every kernel counts once, in one part,
and the parts add up to the step. Kernels that run at the same time (on several streams) are each counted in
full: `overlap_ms` is by how much their sum exceeds their union.

On a CPU there are no kernels: each part's time is then its ops' own CPU time (self time, so nothing is
counted twice) and idle is what no op accounts for.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

# module class name -> part; a block's own work (what its children do not) is the hyper-connections
PART_OF_CLASS = {
    "Compressor": "compressors",
    "Indexer": "indexer",
    "ParallelAttention": "attention", "Attention": "attention",
    "RMSNorm": "norms", "Norm": "norms", "SPRMSNorm": "norms",
    "Gate": "router and dispatch", "ParallelMoE": "router and dispatch", "MoE": "router and dispatch",
    "Expert": "expert GEMMs", "GroupedExperts": "expert GEMMs",
    "ParallelBlock": "hyper-connections", "ParallelMTPBlock": "hyper-connections",
    "Block": "hyper-connections", "MTPBlock": "hyper-connections",
    "VocabParallelEmbedding": "embedding", "Embedding": "embedding",
    "DSV4Stage": "LM head and loss", "Transformer": "LM head and loss",
}
PARTS = ("attention", "indexer", "compressors", "hyper-connections", "norms", "router and dispatch",
         "expert GEMMs", "LM head and loss", "embedding", "optimizer", "communication", "other", "idle")
_SCOPE = "part::"
_BACKWARD = "autograd::engine::evaluate_function"


@contextlib.contextmanager
def scopes(root: nn.Module):
    """Open a profiler scope named for its part around the forward of every module of `root` that has one."""
    handles, stack = [], []

    def pre(part):
        def hook(module, args):
            rf = torch.profiler.record_function(_SCOPE + part)
            rf.__enter__()
            stack.append(rf)
        return hook

    def post(module, args, output):
        if stack:
            stack.pop().__exit__(None, None, None)

    for m in root.modules():
        part = PART_OF_CLASS.get(type(m).__name__)
        if part is not None:
            handles += [m.register_forward_pre_hook(pre(part)), m.register_forward_hook(post)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def optimizer_scope():
    with torch.profiler.record_function(_SCOPE + "optimizer"):
        yield


@dataclass
class Part:
    name: str
    ms: float
    share: float          # of the step's wall time
    kernels: int


def _scope_of(e) -> str | None:
    while e is not None:
        if e.name.startswith(_SCOPE):
            return e.name[len(_SCOPE):]
        e = e.cpu_parent
    return None


def _backward_node(e):
    while e is not None:
        if e.name.startswith(_BACKWARD):
            return e
        e = e.cpu_parent
    return None


def _is_comm(name: str) -> bool:
    n = name.lower()
    return "nccl" in n or n.startswith("c10d::") or "all_reduce" in n or "allreduce" in n


def union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def _attributor(cpu: list) -> Callable:
    """part_of(op) for the ops of one profiled step: its scope, or for a backward op its forward op's scope."""
    # forward: the part of every op with a sequence number, for the backward nodes that carry the same number
    part_of_seq: dict[int, str] = {}
    for e in cpu:
        if e.sequence_nr is not None and e.sequence_nr >= 0 and _backward_node(e) is None:
            part = _scope_of(e)
            if part is not None:
                part_of_seq[e.sequence_nr] = part

    def part_of(e) -> str:
        if _is_comm(e.name):
            return "communication"
        scope = _scope_of(e)
        if scope is not None:
            return scope
        node = _backward_node(e)
        if node is not None:
            return part_of_seq.get(node.sequence_nr, "other")
        return "other"
    return part_of


def _cpu_ops(events) -> list:
    return [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]


def device_kernels(events) -> list:
    """The device's own work of a profiled step, each once: its kernels, copies and fills, without the spans the
    profiler lists for user annotations (see the module docstring)."""
    import bisect
    events = list(events)
    annotated = {e.name for e in events if e.device_type == torch.autograd.DeviceType.CPU
                 and (e.is_user_annotation or e.name.startswith(_SCOPE))}
    device = sorted((e for e in events if e.device_type != torch.autograd.DeviceType.CPU
                     and not e.is_user_annotation and not e.name.startswith(_SCOPE)),
                    key=lambda e: (e.time_range.start, -e.time_range.end))
    starts = [e.time_range.start for e in device]

    def spans_others(i: int, e) -> bool:
        """An annotation span the profiler did not flag: named as an annotation and covering another event of
        another name (an inductor kernel is named as the mark around its launch too, but covers nothing)."""
        for j in range(bisect.bisect_left(starts, e.time_range.start), bisect.bisect_right(starts, e.time_range.end)):
            o = device[j]
            if j != i and o.time_range.end <= e.time_range.end and o.name != e.name:
                return True
        return False
    out, seen = [], set()
    for i, e in enumerate(device):
        if e.name in annotated:
            span = (e.name, e.time_range.start, e.time_range.end)
            if spans_others(i, e) or span in seen:      # an unflagged span over the same-named kernel: once
                continue
            seen.add(span)
        out.append(e)
    return out


def _key(name: str, duration_us: float) -> tuple[str, float]:
    return name, round(float(duration_us), 3)


def _kernels(cpu: list, part_of: Callable, device: list) -> list[tuple[str, float, str]]:
    """[(kernel name, us, part)] of one profiled step: every kernel of `device` once, with the part of the CPU op
    whose kernel list holds it ("other" where none does). A CPU op's list entry that is no kernel of `device` (an
    annotation's span) or one already taken is passed over."""
    from collections import Counter
    left = Counter(_key(k.name, k.time_range.elapsed_us()) for k in device)
    out = []
    for e in cpu:
        for k in e.kernels:
            key = _key(k.name, k.duration)
            if left[key] > 0:
                left[key] -= 1
                out.append((k.name, float(k.duration), "communication" if _is_comm(k.name) else part_of(e)))
    for (name, us), n in left.items():
        out += [(name, us, "communication" if _is_comm(name) else "other")] * n
    return out


@dataclass
class Breakdown:
    parts: list[Part]
    wall_ms: float
    overlap_ms: float = 0.0      # kernels' sum over their union: work on several streams at once (0 on a CPU)

    @property
    def sum_ms(self) -> float:
        return sum(p.ms for p in self.parts)


def breakdown(events, wall_s: float) -> list[Part]:
    """Parts of one step from the profiler's function events (`prof.events()`) and the step's wall time."""
    return step_breakdown(events, wall_s).parts


def step_breakdown(events, wall_s: float) -> Breakdown:
    """`breakdown` with the overlap of concurrent kernels; the parts sum to the wall time plus that overlap (on a
    CPU, to the wall time, unless the ops' own times exceed it)."""
    events = list(events)
    cpu = _cpu_ops(events)
    part_of = _attributor(cpu)
    us = dict.fromkeys(PARTS, 0.0)
    count = dict.fromkeys(PARTS, 0)
    device = device_kernels(events)
    overlap = 0.0
    if device:
        for _, t, part in _kernels(cpu, part_of, device):
            us[part] += t
            count[part] += 1
        busy = union_us([(e.time_range.start, e.time_range.end) for e in device])
        overlap = max(sum(us.values()) - busy, 0.0)
    else:   # CPU: each op's own time
        for e in cpu:
            if e.name.startswith(_SCOPE) or e.name.startswith(_BACKWARD):
                continue
            part = part_of(e)
            us[part] += e.self_cpu_time_total
            count[part] += 1
        busy = sum(us.values())
    us["idle"] = max(wall_s * 1e6 - busy, 0.0)
    parts = [Part(p, us[p] / 1e3, us[p] / (wall_s * 1e6), count[p]) for p in PARTS if us[p] > 0 or p == "idle"]
    return Breakdown(parts, wall_s * 1e3, overlap / 1e3)


@dataclass
class Kernel:
    name: str
    part: str
    ms: float             # summed over its launches in the step
    launches: int


def top_kernels(events, n: int) -> list[Kernel]:
    """The n kernels (by name and part) with the most device time in the step: the next lever by name."""
    total: dict[tuple[str, str], list] = {}
    events = list(events)
    cpu = _cpu_ops(events)
    for name, us, part in _kernels(cpu, _attributor(cpu), device_kernels(events)):
        t = total.setdefault((name, part), [0.0, 0])
        t[0] += us
        t[1] += 1
    rows = [Kernel(name, part, us / 1e3, count) for (name, part), (us, count) in total.items()]
    return sorted(rows, key=lambda k: -k.ms)[:n]


def kernel_table(kernels: list[Kernel]) -> str:
    lines = [f"{'ms':>8} {'launches':>8}  {'part':<20} kernel"]
    for k in kernels:
        name = k.name if len(k.name) <= 90 else k.name[:87] + "..."
        lines.append(f"{k.ms:>8.1f} {k.launches:>8}  {k.part:<20} {name}")
    return "\n".join(lines)


def compare_table(rows: list) -> str:
    """The profiled steps of several variants side by side: ms by part, one column per variant (numbered as the
    rows above it), the last variant's share."""
    numbered = [(i + 1, r) for i, r in enumerate(rows) if r.parts]
    rows = [r for _, r in numbered]
    lines = [f"{'part':<22} " + " ".join(f"{'(' + str(i) + ') ms':>10}" for i, _ in numbered) + f" {'share':>7}"]
    by_row = [{p.name: p for p in r.parts} for r in rows]
    order = [p.name for p in sorted(rows[-1].parts, key=lambda p: (p.name == "idle", -p.ms))]
    order += [n for n in PARTS if n not in order and any(n in b for b in by_row)]
    for name in order:
        cells = " ".join(f"{b[name].ms if name in b else 0.0:>10.1f}" for b in by_row)
        last = by_row[-1].get(name)
        lines.append(f"{name:<22} {cells} {(last.share if last else 0.0):>7.1%}")
    lines.append(f"{'step (wall)':<22} " + " ".join(f"{r.profiled_wall_s * 1e3:>10.1f}" for r in rows) + f" {1:>7.0%}")
    lines.append(f"{'parts, summed':<22} " + " ".join(f"{sum(p.ms for p in r.parts):>10.1f}" for r in rows)
                 + f" {sum(p.ms for p in rows[-1].parts) / (rows[-1].profiled_wall_s * 1e3):>7.1%}")
    return "\n".join(lines)


def table(parts: list[Part], wall_s: float, overlap_ms: float = 0.0) -> str:
    """The parts of one profiled step, longest first, idle last; the step's wall time under them. The parts add up
    to it (kernels that ran at the same time on several streams aside: `overlap_ms`, said on the last line)."""
    lines = [f"{'part':<22} {'ms':>9} {'share':>7} {'kernels':>8}"]   # on a CPU: ops
    for p in sorted(parts, key=lambda p: (p.name == "idle", -p.ms)):
        lines.append(f"{p.name:<22} {p.ms:>9.1f} {p.share:>7.1%} {p.kernels:>8}")
    lines.append(f"{'step (wall)':<22} {wall_s * 1e3:>9.1f} {1:>7.0%}")
    total = sum(p.ms for p in parts)
    lines.append(f"{'parts, summed':<22} {total:>9.1f} {total / (wall_s * 1e3):>7.1%}"
                 + (f"   ({overlap_ms:.1f} ms of kernels ran beside others)" if overlap_ms else ""))
    return "\n".join(lines)


# ================================================================================================ the bench
@dataclass
class StepRow:
    variant: str          # e.g. "fp32_gemm=bf16x3"
    step_s: float         # median over the timed steps
    tokens_per_s: float
    model_tflops: float
    mfu: float | None
    loss: float           # on one fixed batch with the starting weights: the variants' numerics side by side
    peak_mem_gb: float    # on CUDA the variant's own peak; on a CPU the process's so far (RSS cannot be reset)
    parts: list[Part] | None = None        # its profiled step by part
    profiled_wall_s: float | None = None
    overlap_ms: float | None = None         # concurrent kernels' sum over their union in the profiled step

    @property
    def parts_ms(self) -> float | None:
        """What the parts add up to: the profiled step's wall time (plus overlap_ms where kernels ran at once)."""
        return sum(p.ms for p in self.parts) if self.parts else None


def bench_step(cfg, *, seq_len: int, global_batch: int, micro_batch: int, steps: int, warmup: int, device: str,
               recompute: str = "none", peak_tflops: float = 0.0, variants: list[dict] | None = None,
               profile: str = "last", top: int = 0, seed: int = 1234, hooks: bool = False, rank=None,
               say=print) -> dict:
    """Time `steps` training steps after `warmup` (one process, world size 1, the real Trainer: megatron-core's
    DDP, optimizer and schedule) for each variant, and profile one more step (`profile`: of the "last" variant, of
    "each", or "none"); the longest `top` kernels are listed for the last variant.

    `rank`: a rankshape.RankShape: `cfg` is then its model (`rank.model_config()`), built under its TP stand-in, the
    MTP block trained where the slice holds it, and the model FLOPs are the slice's at the model's expert count,
    times the rank's share (see dsv4/megatron/rankshape.py).

    A variant sets ModelConfig fields that only choose how the same math runs (config.RUNTIME_SWITCHES) on the
    trainer's own config, so every variant runs in one process on the same data; each row's loss is taken on
    one fixed batch with the starting weights before anything trains, so the losses differ only by numerics.
    `hooks`: one more row, the last variant with the non-finite monitor's hooks on every module (what each step
    costs under PRESET_NONFINITE_LOCATE=every_step; the default attaches them only to re-run a bad step)."""
    import statistics

    from dsv4.megatron import rankshape
    from dsv4.megatron.model import Objective

    standin = rankshape.standin(rank.layout.tp, rank.layout.etp) if rank is not None else contextlib.nullcontext()
    with standin:
        return _bench_step(cfg, seq_len=seq_len, global_batch=global_batch, micro_batch=micro_batch, steps=steps,
                           warmup=warmup, device=device, recompute=recompute, peak_tflops=peak_tflops,
                           variants=variants, profile=profile, top=top, seed=seed, hooks=hooks, say=say,
                           objective=Objective(mtp_coeff=MTP_COEFF if rank is not None and rank.mtp else 0.0),
                           flops_cfg=rank.flops_config() if rank is not None else cfg,
                           share=rank.flops_share if rank is not None else 1.0,
                           # a TP stand-in's embedding holds its vocabulary slice, and the other ranks' lookups, which
                           # the reduce-scatter would add, are absent: tokens of other slices would embed as zero
                           # rows (whose norms' gradients blow up); its own slice's tokens are looked up as any others
                           vocab=cfg.vocab_size // (rank.layout.tp if rank is not None else 1))


MTP_COEFF = 0.3      # a rank shape's MTP loss weight (DeepSeek-V3's first stretch): the speed does not depend on it


def routing_stats(stage) -> dict | None:
    """Rows per expert of each MoE layer's last forward (its micro-batch), the mean and the largest over the
    layers: what the rank's expert GEMMs saw."""
    counts = []
    for layer in list(stage.layers.values()) + list(getattr(stage, "mtp", {}).values()):
        idx = getattr(layer.ffn, "last_expert_idx", None)
        if idx is not None:
            counts.append(torch.bincount(idx.flatten().cpu(), minlength=len(layer.ffn.experts)).float())
    if not counts:
        return None
    c = torch.stack(counts)
    return {"tokens_per_expert_mean": float(c.mean()), "tokens_per_expert_max": float(c.max()),
            "tokens_per_expert_min": float(c.min())}


def _bench_step(cfg, *, seq_len, global_batch, micro_batch, steps, warmup, device, recompute, peak_tflops, variants,
                profile, top, seed, hooks, say, objective, flops_cfg, share, vocab) -> dict:
    import statistics

    from dsv4.config import RUNTIME_SWITCHES
    from dsv4.flops import train_flops_per_token
    from dsv4.megatron.launch import free_port
    from dsv4.megatron.parallel import Layout, init_parallel
    from dsv4.megatron.train import TrainConfig, Trainer, init_distributed, peak_memory_gb, split_micro_batches

    init_distributed(0, 1, "nccl" if device == "cuda" else "gloo", device, "127.0.0.1", free_port())
    init_parallel(Layout(), seed)
    variants = variants or [{}]
    tc = TrainConfig(model=cfg, seq_len=seq_len, micro_batch_size=micro_batch, global_batch_size=global_batch,
                     num_steps=(len(variants) + hooks) * (warmup + steps) + 1, lr=1e-5, seed=seed, device=device,
                     recompute=recompute, nonfinite_locate="off", peak_tflops=peak_tflops, objective=objective)
    say(f"[bench] building the trainer: {cfg.n_layers} layers" + (f" + {cfg.n_mtp_layers} MTP" if objective.mtp_coeff
                                                                   else "")
        + f", {cfg.n_routed_experts} experts, {device}")
    trainer = Trainer(tc)
    g = torch.Generator().manual_seed(seed)

    def batch():
        tokens = torch.randint(0, vocab, (global_batch, seq_len + 1), generator=g)
        return split_micro_batches({"tokens": tokens, "loss_mask": torch.ones(global_batch, seq_len)}, micro_batch)

    flops, _ = train_flops_per_token(flops_cfg, seq_len, mtp=objective.mtp_coeff > 0, recompute=recompute == "full")
    flops *= share
    tokens = global_batch * seq_len
    fixed = batch()
    losses = []
    routing = None
    base = {k: getattr(cfg, k) for k in RUNTIME_SWITCHES}

    def apply(v: dict) -> None:          # each variant from the configured switches, not from the one before
        for k, val in {**base, **v}.items():
            setattr(cfg, k, val)
    for v in variants:
        apply(v)
        losses.append(trainer.eval_loss(fixed)[0])
        routing = routing or routing_stats(trainer.stage)
    rows, kernels = [], []
    runs = list(zip(variants, losses)) + ([(variants[-1], losses[-1])] if hooks else [])
    for i, (v, loss) in enumerate(runs):
        apply(v)
        name = " ".join(f"{k}={val}" for k, val in v.items()) or " ".join(
            f"{k}={getattr(cfg, k)}" for k in RUNTIME_SWITCHES)
        hooked = i == len(variants)            # the extra row: the last variant again, hooks on
        if hooked:
            name += " + non-finite hooks"
            trainer.monitor.attach()
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        times = []
        for j in range(warmup + steps):
            res = trainer.step(batch())
            if not res.finite:
                raise RuntimeError(f"{name}: a non-finite step (loss {res.loss})")
            if j >= warmup:
                times.append(res.step_time_s)
        t = statistics.median(times)
        tflops = flops * tokens / t / 1e12
        rows.append(StepRow(name, t, tokens / t, tflops, tflops / peak_tflops if peak_tflops else None, loss,
                            peak_memory_gb(device)))
        say(f"[bench] {name}: {t:.3f} s/step, {tokens / t:,.0f} tokens/s, {tflops:.1f} TFLOP/s"
            + (f", MFU {tflops / peak_tflops:.1%}" if peak_tflops else ""))
        if hooked:
            trainer.monitor.detach()
            continue                    # timed only: the profile is of the variants as runs train them
        last = i == len(variants) - 1
        if profile == "each" or (profile == "last" and last):
            bd, rows[-1].profiled_wall_s, found = _profiled_step(trainer, batch(), device, top if last else 0)
            rows[-1].parts, rows[-1].overlap_ms = bd.parts, bd.overlap_ms
            kernels = found if last else kernels
            say(f"[bench] {name}: profiled step {rows[-1].profiled_wall_s:.3f} s (profiler overhead included), "
                f"parts {bd.sum_ms:.1f} ms" + (f", {bd.overlap_ms:.1f} ms of it concurrent kernels" if bd.overlap_ms
                                                 else ""))
    return {"flops_per_token": flops, "tokens_per_step": tokens, "rows": rows, "top_kernels": kernels,
            "routing": routing, "flops_share": share}


def _profiled_step(trainer, micro, device: str, top: int) -> tuple[Breakdown, float, list[Kernel]]:
    """One training step under the profiler, with each module's part scoped: (parts, wall s, longest kernels).
    The step is the trainer's whole step, the optimizer's update inside it, so each kernel of the update is in
    the profile once."""
    import time

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    step_opt = trainer.optimizer.step

    def scoped_step(*a, **kw):
        with optimizer_scope():
            return step_opt(*a, **kw)
    trainer.optimizer.step = scoped_step
    try:
        with scopes(trainer.stage), torch_profile(activities=activities) as prof:
            t0 = time.perf_counter()
            trainer.step(micro)
            wall = time.perf_counter() - t0
    finally:
        trainer.optimizer.step = step_opt
    events = prof.events()
    return step_breakdown(events, wall), wall, (top_kernels(events, top) if top and device == "cuda" else [])
