"""Memory and step time of context parallelism: CP = 1 against CP = 2, per sequence length (prints a table).

    python benchmarks/bench_cp.py                              # tiny model, CPU/gloo, 1024 2048 4096 tokens
    python benchmarks/bench_cp.py --seq-lens 512,1024 --steps 3
    python benchmarks/bench_cp.py --device cuda --model 4layer --overrides "n_routed_experts=8" \
        --attn-impl tilelang --seq-lens 16384,32768,65536        # needs 2 GPUs

Each length runs CP = 1 (one process) and CP = 2 (two processes, one sequence split over them) on the same random
global batch, `--steps` optimizer steps each with the real megatron DDP/optimizer/schedules; the first step is
warm-up and the rest are summarised by their median. Lengths are tried in increasing order and the sweep stops at
the first one where either run does not fit (out of memory, or a step slower than --max-step-s): the last row
printed is the longest sequence that fits. On cpu "memory" is --host-mem-gb shared by a run's ranks (default: 80%
of the memory available at the start): the ranks' resident memory is polled every 0.2 s and a run that passes it
is stopped, so that a length that does not fit ends there instead of waking the kernel's OOM killer on a shared
machine.

Memory, per rank (the largest over a run's ranks):
* act MB: bytes of the tensors autograd saves for backward during one micro-batch's forward (each storage once),
  what context parallelism divides;
* peak GB: on cuda torch's peak allocation; on cpu the process's peak resident size, which includes the
  interpreter and libraries (a few hundred MB) and so moves less than the activations.
Ratios are CP = 2 over CP = 1 of the same run. On CPU both runs use one thread a rank (train.init_distributed),
so CP = 2 also gets a second core: its step time shows the split's overhead and that extra core together.
"""
from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import tempfile
import warnings
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SavedBytes:
    """Bytes autograd saves for backward, per micro-batch: counting restarts when backward begins to unpack."""

    def __init__(self):
        self.seen: set[int] = set()
        self.cur = 0
        self.peak = 0
        self.backward = False

    def pack(self, t: torch.Tensor):
        if self.backward:
            self.seen, self.cur, self.backward = set(), 0, False
        s = t.untyped_storage()
        if s.data_ptr() not in self.seen:
            self.seen.add(s.data_ptr())
            self.cur += s.nbytes()
            self.peak = max(self.peak, self.cur)
        return t

    def unpack(self, t: torch.Tensor):
        self.backward = True
        return t


def _worker(rank, world, port, args, seq_len, out):
    warnings.filterwarnings("ignore")
    import os
    from dsv4.config import ModelConfig
    from dsv4.megatron.model import Objective
    from dsv4.megatron.parallel import Layout, init_parallel
    from dsv4.megatron.train import TrainConfig, Trainer, init_distributed, peak_memory_gb, split_micro_batches
    if args.device == "cuda":
        os.environ["LOCAL_RANK"] = str(rank)
    init_distributed(rank, world, "nccl" if args.device == "cuda" else "gloo", args.device, "127.0.0.1", port)
    m = ModelConfig.preset(args.model).with_overrides(args.overrides, attn_impl=args.attn_impl)
    tc = TrainConfig(model=m, layout=Layout(cp=world), objective=Objective(args.mtp, args.indexer),
                     seq_len=seq_len, micro_batch_size=1, global_batch_size=args.gbs, num_steps=args.steps,
                     lr=1e-4, device=args.device)
    init_parallel(tc.layout, tc.seed)
    result = {"ok": True}
    try:
        tr = Trainer(tc)
        g = torch.Generator().manual_seed(0)
        batch = {"tokens": torch.randint(0, m.vocab_size, (args.gbs, seq_len + 1), generator=g),
                 "loss_mask": torch.ones(args.gbs, seq_len)}
        saved, times, losses = SavedBytes(), [], []
        for i in range(args.steps):
            if i == 0:
                with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
                    r = tr.step(split_micro_batches(batch, 1))
            else:
                r = tr.step(split_micro_batches(batch, 1))
            times.append(r.step_time_s)
            losses.append(r.loss)
            if i > 0 and r.step_time_s > args.max_step_s:
                break
        result.update(times=times, losses=losses, act_mb=saved.peak / 2 ** 20)
    except torch.OutOfMemoryError as e:
        result = {"ok": False, "why": f"out of memory: {str(e).splitlines()[0][:120]}"}
    flag = torch.tensor([0.0 if result["ok"] else 1.0], device="cuda" if args.device == "cuda" else "cpu")
    torch.distributed.all_reduce(flag)
    stats = torch.tensor([peak_memory_gb(args.device), result.get("act_mb", 0.0)],
                         device="cuda" if args.device == "cuda" else "cpu")
    torch.distributed.all_reduce(stats, op=torch.distributed.ReduceOp.MAX)
    if rank == 0:
        if flag.item():
            result = {"ok": False, "why": result.get("why", "out of memory on another rank")}
        result.update(peak_gb=stats[0].item(), act_mb=stats[1].item())
        Path(out).write_text(json.dumps(result))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def _rss_gb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 2 ** 20
    except OSError:
        pass
    return 0.0


def _run(args, world: int, seq_len: int, d: str) -> dict:
    out = Path(d) / f"cp{world}_s{seq_len}.json"
    ctx = mp.spawn(_worker, args=(world, _port(), args, seq_len, str(out)), nprocs=world, join=False)
    try:
        while not ctx.join(timeout=0.2):
            if args.device == "cpu" and sum(_rss_gb(p.pid) for p in ctx.processes) > args.host_mem_gb:
                for p in ctx.processes:
                    p.kill()
                return {"ok": False, "why": f"the ranks' resident memory passed {args.host_mem_gb:g} GB"}
    except Exception as e:            # a rank that died: the last line of its traceback says why
        last = [line for line in str(e).splitlines() if line.strip()][-1:] or [type(e).__name__]
        return {"ok": False, "why": last[0][:160]}
    r = json.loads(out.read_text())
    if r["ok"]:
        r["step_s"] = statistics.median(r["times"][1:]) if len(r["times"]) > 1 else r["times"][0]
        if r["step_s"] > args.max_step_s:
            r.update(ok=False, why=f"step {r['step_s']:.1f} s > --max-step-s {args.max_step_s:g}")
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--overrides", default="")
    ap.add_argument("--attn-impl", default="torch")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--seq-lens", default="1024,2048,4096", help="increasing; each a multiple of 4 (2*CP)")
    ap.add_argument("--gbs", type=int, default=1, help="sequences per step (micro-batches of one)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--mtp", type=float, default=0.3, help="MTP loss weight")
    ap.add_argument("--indexer", type=float, default=0.1, help="indexer KL loss weight")
    ap.add_argument("--max-step-s", type=float, default=120.0, help="a slower step counts as not fitting")
    ap.add_argument("--host-mem-gb", type=float, default=0.0,
                    help="cpu: memory a run's ranks share (0: 80%% of MemAvailable now)")
    args = ap.parse_args()
    if args.device == "cpu" and not args.host_mem_gb:
        avail = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
                     if line.startswith("MemAvailable:"))
        args.host_mem_gb = round(0.8 * avail / 2 ** 20, 1)
    lens = [int(s) for s in args.seq_lens.split(",")]
    print(f"model {args.model} {args.overrides} | {args.device} attn {args.attn_impl} | {args.gbs} sequence(s) a step, "
          f"{args.steps} steps, MTP {args.mtp:g}, indexer loss {args.indexer:g}"
          + (f" | {args.host_mem_gb:g} GB host memory per run" if args.device == "cpu" else ""))
    print(f"{'seq':>7s} {'CP1 step s':>10s} {'CP2 step s':>10s} {'time x':>7s} {'CP1 act MB':>10s} {'CP2 act MB':>10s} "
          f"{'act x':>6s} {'CP1 peak GB':>11s} {'CP2 peak GB':>11s} {'peak x':>7s} {'loss CP1':>9s} {'loss CP2':>9s}",
          flush=True)
    longest = None
    with tempfile.TemporaryDirectory() as d:
        for n in lens:
            one = _run(args, 1, n, d)
            two = _run(args, 2, n, d)      # also where CP1 does not fit: the split may be what makes it fit
            if not (one["ok"] and two["ok"]):
                said = {k: (f"{r['step_s']:.3f} s a step, act {r['act_mb']:.1f} MB, peak {r['peak_gb']:.3f} GB"
                            if r["ok"] else f"does not fit ({r['why']})") for k, r in (("CP1", one), ("CP2", two))}
                print(f"{n:7d} CP1 {said['CP1']}; CP2 {said['CP2']}")
                break
            longest = n
            print(f"{n:7d} {one['step_s']:10.3f} {two['step_s']:10.3f} {two['step_s'] / one['step_s']:7.2f} "
                  f"{one['act_mb']:10.1f} {two['act_mb']:10.1f} {two['act_mb'] / one['act_mb']:6.2f} "
                  f"{one['peak_gb']:11.3f} {two['peak_gb']:11.3f} {two['peak_gb'] / one['peak_gb']:7.2f} "
                  f"{one['losses'][0]:9.5f} {two['losses'][0]:9.5f}", flush=True)
    print(f"longest sequence that fits: {longest if longest else 'none of ' + args.seq_lens}"
          + ("" if longest != lens[-1] else " (the longest asked for; add longer --seq-lens to find the limit)"))


if __name__ == "__main__":
    main()
