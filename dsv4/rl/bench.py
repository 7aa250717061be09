"""`v4 bench rollout`: decode speed of the embedded engine beside the HBM roofline of the same step, and the
seconds and GB/s of each weight-update path, measured in one run.

Decode: for each batch size, a batch of prompts is fed to a fresh cache, then `--steps` decode steps are timed
(the median step after warm-up; CUDA synchronised around each step). tokens/s = batch / step time. Mode
"graph" is the engine's step: its regions compiled by inductor, replayed from a CUDA graph (`decode.GraphedStep`);
"uncompiled" the same graph of the uncompiled regions; "eager" the uncompiled step launched op by op (the only
mode on a CPU). Every mode runs the same positions on the same cache, so the rows sit side by side from one run.
The step's MoE runs only the experts its batch chose (grouped GEMMs, `decode.moe`), so the experts the roofline
counts are the ones it reads: at one token 6 of 256 a layer, at 64 tokens of 32 experts nearly all of them.
Roofline of a step = the bytes the step must read at least once / the device's copy bandwidth measured in the
same run (a large device-to-device copy, read + write counted):
  weights: every parameter except the embedding and the routed experts, plus the embedding rows of the batch's
           tokens and the routed experts that step's routes activate (counted from the routes of the timed steps);
  KV:      per layer and sample, the rows the attention reads (window + selected compressed entries) and, for
           ratio-4 layers, every indexer key (the indexer scores all of them).
Achieved fraction = roofline time / measured step time.

Weight updates (the engine's side; the trainer's quantisation is timed separately): `tensor` (in-process copy of
the model's own parameters, bf16/fp32 as stored), `tensor-fp8` (the FP8 weights as e4m3 + scales, dequantised on
load), `disk` (update_weights_from_disk of a checkpoint written once before timing), `distributed` (a broadcast
group, gloo on CPU / nccl on GPU, the sender a thread of this process). GB/s = bytes of the tensors sent / seconds.
"""
from __future__ import annotations

import statistics
import tempfile
import threading
import time
from dataclasses import dataclass

import torch

from dsv4 import quant
from dsv4.rl import decode, sync
from dsv4.rl.engine import EmbeddedEngine


@dataclass
class DecodeRow:
    mode: str                # "graph": replayed CUDA graph; "eager": the step launched op by op
    batch: int
    step_ms: float
    tokens_per_s: float
    weight_bytes: int
    kv_bytes: int
    roofline_ms: float
    achieved: float          # roofline_ms / step_ms


@dataclass
class KernelRow:
    name: str
    us_per_step: float       # device time summed over its launches, per decode step
    launches_per_step: float


@dataclass
class DecodeProfile:
    mode: str
    batch: int
    steps: int
    wall_ms: float           # per step, under the profiler (its overhead included)
    busy_ms: float           # per step: the union of the device's kernels (on a CPU: the ops' own time)
    kernels: list[KernelRow]
    unit: str = "kernels"    # "ops" on a CPU

    def table(self, top: int) -> str:
        lines = [f"batch {self.batch} {self.mode}: {len(self.kernels)} {self.unit}, device busy {self.busy_ms:.3f} of "
                 f"{self.wall_ms:.3f} ms a step under the profiler ({self.wall_ms - self.busy_ms:.3f} ms between "
                 f"them)", f"{'us/step':>9} {'share':>6} {'launches':>8}  {self.unit[:-1]}"]
        for k in self.kernels[:top]:
            name = k.name if len(k.name) <= 100 else k.name[:97] + "..."
            lines.append(f"{k.us_per_step:>9.1f} {k.us_per_step / 1e3 / self.busy_ms:>6.1%} "
                         f"{k.launches_per_step:>8.1f}  {name}")
        return "\n".join(lines)


def profile_steps(run, positions, dev, mode: str, batch: int) -> DecodeProfile:
    """The device's kernels over `run(p)` for each position, by name, per step: what a decode step spends its time
    on. A CUDA graph's replay shows its kernels to the profiler one by one, as eager launches do; on a CPU the ops'
    own times stand in for kernels."""
    from torch.profiler import ProfilerActivity, profile

    from dsv4.megatron import stepprof
    positions = list(positions)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    _sync_dev(dev)
    with profile(activities=acts) as prof:
        t = time.perf_counter()
        for p in positions:
            run(p)
        _sync_dev(dev)
        wall = time.perf_counter() - t
    events = list(prof.events())
    device = stepprof.device_kernels(events)
    total: dict[str, list] = {}
    if device:
        for e in device:
            k = total.setdefault(e.name, [0.0, 0])
            k[0] += e.time_range.elapsed_us()
            k[1] += 1
        busy = stepprof.union_us([(e.time_range.start, e.time_range.end) for e in device])
    else:
        for e in events:
            if e.device_type == torch.autograd.DeviceType.CPU and e.self_cpu_time_total > 0:
                k = total.setdefault(e.name, [0.0, 0])
                k[0] += e.self_cpu_time_total
                k[1] += 1
        busy = sum(us for us, _ in total.values())
    n = len(positions)
    rows = sorted((KernelRow(name, us / n, c / n) for name, (us, c) in total.items()), key=lambda k: -k.us_per_step)
    return DecodeProfile(mode, batch, n, wall / n * 1e3, busy / n / 1e3, rows, "kernels" if device else "ops")


@dataclass
class SyncRow:
    path: str
    tensors: int
    bytes: int
    seconds: float
    gb_per_s: float


def _sync_dev(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device, nbytes: int = 1 << 30, iters: int = 5) -> float:
    """Bytes/s of a large copy on `device` (read + write counted)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(iters):
        _sync_dev(device)
        t = time.perf_counter()
        dst.copy_(src)
        _sync_dev(device)
        times.append(time.perf_counter() - t)
    return 2 * src.numel() * 4 / statistics.median(times)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def step_bytes(model, cache: decode.DecodeCache, routes: torch.Tensor, batch: int) -> tuple[int, int]:
    """(weight bytes, KV bytes) one decode step reads at least once; routes [B, L, k] of that step."""
    weights = 0
    for name, p in model.named_parameters():
        if name == "embed.weight" or ".experts." in name or name.startswith("mtp.") or name.endswith("tid2eid"):
            continue
        weights += _nbytes(p)
    weights += batch * model.embed.weight.shape[1] * model.embed.weight.element_size()
    for layer, r in zip(model.layers, routes.unbind(1)):
        for e in torch.unique(r).tolist():
            weights += sum(_nbytes(p) for p in layer.ffn.experts[e].parameters())
    kv = 0
    cfg = model.cfg
    for lc in cache.layers:
        row = lc.kv.shape[-1] * lc.kv.element_size()
        slots = lc.window + (min(cfg.index_topk, lc.n_entries) if lc.ratio == 4 else lc.n_entries)
        kv += batch * slots * row
        if lc.ratio == 4:   # every key of the indexer (its buffer's last row is the trash row nothing reads)
            kv += batch * lc.n_entries * lc.index_keys.shape[-1] * lc.index_keys.element_size()
    return weights, kv


def _time_steps(run, positions, timed_from: int, dev) -> tuple[list[float], list[torch.Tensor]]:
    """Seconds of `run(p)` for each position from `timed_from` on (the earlier ones warm up), with the routes
    of each timed step (copied: a graph's outputs are overwritten by the next replay)."""
    times, routes = [], []
    for p in positions:
        _sync_dev(dev)
        t = time.perf_counter()
        _, r = run(p)
        _sync_dev(dev)
        if p >= timed_from:
            times.append(time.perf_counter() - t)
            routes.append(r.clone())
    return times, routes


MODES = ("graph", "uncompiled", "eager")


def bench_decode(engine: EmbeddedEngine, batches: list[int], prompt_len: int, steps: int, warmup: int,
                 bandwidth: float, say=print, modes=("graph",),
                 profiles: list[DecodeProfile] | None = None) -> list[DecodeRow]:
    """modes: "graph" (the engine's step: compiled regions in a CUDA graph), "uncompiled" (the same graph of
    the uncompiled regions), "eager" (the uncompiled step launched op by op). On a CPU there is no graph and
    one "eager" set of rows is timed. `profiles`: a list to append each row's kernel profile to (the timed
    positions again, under the profiler, after the timing)."""
    model, dev = engine.model, engine.device
    V = model.cfg.vocab_size
    rows = []
    if dev.type != "cuda":
        modes = ("eager",)
    for B in batches:
        g = torch.Generator().manual_seed(B)
        total = prompt_len + warmup + steps
        ids = torch.randint(0, V, (B, total), generator=g).to(dev)
        cache = decode.DecodeCache(model, B, total)
        prefill = decode.GraphedStep(model, cache, graph=False, prepared=engine._prepared)
        for p in range(prompt_len):
            prefill(ids[:, p], p)
        for mode in modes:
            # the same positions for every mode: a step repeated at its position redoes the same work
            if mode == "eager":
                dec = prefill
            else:
                dec = decode.GraphedStep(model, cache, compiled=mode == "graph", prepared=engine._prepared)
                dec(ids[:, prompt_len], prompt_len)               # capture outside the timing
                if not dec.graphed:
                    say(f"[bench] batch {B:>3} {mode}: no CUDA graph ({decode.GraphedStep.capture_failed})")
                    continue
                if mode == "graph" and not dec.compiled:
                    say(f"[bench] batch {B:>3} graph: compiling failed ({decode.GraphedStep.compile_failed})")
            times, routes = _time_steps(lambda p, dec=dec: dec(ids[:, p], p), range(prompt_len, total),
                                        prompt_len + warmup, dev)
            byte_counts = [step_bytes(model, cache, r, B) for r in routes]
            ms = statistics.median(times) * 1e3
            w = int(statistics.median(b[0] for b in byte_counts))
            kv = int(statistics.median(b[1] for b in byte_counts))
            roof = (w + kv) / bandwidth * 1e3
            rows.append(DecodeRow(mode, B, ms, B / ms * 1e3, w, kv, roof, roof / ms))
            if profiles is not None:
                profiles.append(profile_steps(lambda p, dec=dec: dec(ids[:, p], p),
                                              range(prompt_len + warmup, total), dev, mode, B))
            say(f"[bench] batch {B:>3} {mode:<10}: {ms:8.2f} ms/step  {B / ms * 1e3:10.1f} tokens/s  "
                f"roofline {roof:.3f} ms ({roof / ms:.1%})")
            del dec
        del prefill, cache
    return rows


def bench_sync(engine: EmbeddedEngine, paths: list[str], say=print) -> list[SyncRow]:
    model, dev, cfg = engine.model, engine.device, engine.cfg
    named = [(n, p.detach().clone()) for n, p in model.named_parameters() if not n.startswith("mtp.")]
    rows = []

    def record(path, tensors, seconds):
        nbytes = sum(_nbytes(t) for _, t in tensors)
        rows.append(SyncRow(path, len(tensors), nbytes, seconds, nbytes / seconds / 1e9))
        say(f"[bench] sync {path:<12} {len(tensors):>5} tensors {nbytes / 1e9:8.3f} GB  {seconds:7.3f} s  "
            f"{nbytes / seconds / 1e9:7.2f} GB/s")

    def timed(fn):
        _sync_dev(dev)
        t = time.perf_counter()
        res = fn()
        _sync_dev(dev)
        if not res["success"]:
            raise RuntimeError(res["message"])
        return time.perf_counter() - t

    if "tensor" in paths:
        record("tensor", named, timed(lambda: engine.update_weights_from_tensor(named, weight_version="b1")))
    if "tensor-fp8" in paths:
        fp8 = []
        for n, t in named:
            if cfg.storage_format(n) == "fp8" and t.dim() == 2:
                q, s = quant.weight_quant_fp8(t)
                fp8 += [(n, q), (n[:-len("weight")] + "scale", s)]
            else:
                fp8.append((n, t))
        record("tensor-fp8", fp8, timed(lambda: engine.update_weights_from_tensor(fp8, weight_version="b2")))
    if "disk" in paths:
        from dsv4.checkpoint import generate_checkpoint
        with tempfile.TemporaryDirectory() as d:
            generate_checkpoint(cfg, d, force=True)
            record("disk", named, timed(lambda: engine.update_weights_from_disk(d, weight_version="b3")))
    if "distributed" in paths:
        # NCCL needs the sender on another GPU than the engine; with one GPU the bytes go through gloo
        backend = "nccl" if dev.type == "cuda" and torch.cuda.device_count() > 1 else "gloo"
        listener = sync.listen_socket("127.0.0.1", 0, 2)
        port = listener.getsockname()[1]
        src = [t.to("cuda:1" if backend == "nccl" else "cpu") for _, t in named]

        def sender():
            g = sync.weight_group("127.0.0.1", port, 0, 2, backend, listener=listener)
            for t in src:
                sync.broadcast(g, t)

        th = threading.Thread(target=sender)
        th.start()
        res = engine.init_weights_update_group("127.0.0.1", port, 1, 2, backend=backend)
        if not res["success"]:
            raise RuntimeError(res["message"])
        names = [n for n, _ in named]
        dtypes = [sync.dtype_name(t.dtype) for _, t in named]
        shapes = [list(t.shape) for _, t in named]
        secs = timed(lambda: engine.update_weights_from_distributed(names, dtypes, shapes, weight_version="b4"))
        th.join()
        record(f"distributed-{backend}", named, secs)
    return rows


def table(decode_rows: list[DecodeRow], bandwidth: float) -> str:
    """One line a batch size: each mode's ms/step, tokens/s and fraction of the roofline, side by side, and
    the first mode's speedup over each other mode that ran."""
    modes = list(dict.fromkeys(r.mode for r in decode_rows))
    by = {(r.batch, r.mode): r for r in decode_rows}
    head = f"{'batch':>5} {'weights MB':>11} {'KV MB':>8} {'roofline ms':>12}"
    for m in modes:
        head += f" | {m + ' ms':>13} {'tokens/s':>10} {'of roof':>8}"
    for m in modes[1:]:
        head += f" | {'vs ' + m:>13}"
    lines = [f"decode (roofline at the measured copy bandwidth {bandwidth / 1e9:.0f} GB/s)", head]
    for B in dict.fromkeys(r.batch for r in decode_rows):
        first = next(by[(B, m)] for m in modes if (B, m) in by)
        line = f"{B:>5} {first.weight_bytes / 1e6:>11.1f} {first.kv_bytes / 1e6:>8.2f} {first.roofline_ms:>12.3f}"
        for m in modes:
            r = by.get((B, m))
            line += f" | {r.step_ms:>13.2f} {r.tokens_per_s:>10.1f} {r.achieved:>8.1%}" if r else \
                f" | {'-':>13} {'-':>10} {'-':>8}"
        a = by.get((B, modes[0]))
        for m in modes[1:]:
            b = by.get((B, m))
            line += f" | {b.step_ms / a.step_ms:>12.1f}x" if a and b else f" | {'-':>13}"
        lines.append(line)
    return "\n".join(lines)
