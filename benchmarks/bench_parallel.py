"""Step time and tokens/s of the DSV4 megatron model per parallel layout (prints a table; not a test).

    python benchmarks/bench_parallel.py                       # tiny model, CPU/gloo: w1 tp2 ep2 pp2 tp2_ep2
    python benchmarks/bench_parallel.py --layouts w1,tp2 --seq-len 128 --steps 4
    python benchmarks/bench_parallel.py --device cuda --model 4layer \
        --overrides "n_routed_experts=16 vocab_size=16384" --seq-len 1024 --layouts w1

Every layout trains `--steps` optimizer steps on the same random global batch (reference init, the
real megatron DDP/optimizer/schedules); the first step is reported apart (warm-up: allocations,
kernel compilation) and the rest summarised by their median. The ratio column compares tokens/s with
the first layout of the same run. On CPU the ranks share this machine's cores, so more ranks means
less compute each: the figures show communication and scheduling overhead, not scaling.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LAYOUTS = {  # name: (world, tp, pp, ep, etp)
    "w1": (1, 1, 1, 1, 1), "tp2": (2, 2, 1, 1, 1), "ep2": (2, 1, 1, 2, 1), "pp2": (2, 1, 2, 1, 1),
    "tp2_ep2": (2, 2, 1, 2, 1), "tp2_etp2": (2, 2, 1, 1, 2), "dp2": (2, 1, 1, 1, 1),
    "tp2_pp2": (4, 2, 2, 1, 1), "tp2_pp2_ep2": (4, 2, 2, 2, 1), "ep4": (4, 1, 1, 4, 1),
}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, args, name, out):
    warnings.filterwarnings("ignore")
    from dsv4.config import ModelConfig
    from dsv4.megatron.model import Objective
    from dsv4.megatron.parallel import Layout, init_parallel
    from dsv4.megatron.train import TrainConfig, Trainer, init_distributed, peak_memory_gb, split_micro_batches
    if args.device == "cuda":
        os.environ["LOCAL_RANK"] = str(rank)       # (CPU threads per rank: see train.init_distributed)
    _, tp, pp, ep, etp = LAYOUTS[name]
    init_distributed(rank, world, "nccl" if args.device == "cuda" else "gloo", args.device, "127.0.0.1", port)
    m = ModelConfig.preset(args.model).with_overrides(args.overrides, attn_impl=args.attn_impl)
    if args.dtype:
        m = m.with_overrides(dtype=args.dtype)
    tc = TrainConfig(model=m, layout=Layout(tp, pp, ep, etp), objective=Objective(args.mtp, 0.0),
                     seq_len=args.seq_len, micro_batch_size=args.mbs, global_batch_size=args.gbs,
                     num_steps=args.steps, lr=1e-4, device=args.device, nonfinite_locate=args.nonfinite_locate,
                     recompute=args.recompute)
    init_parallel(tc.layout, tc.seed)
    tr = Trainer(tc)
    g = torch.Generator().manual_seed(0)
    rows = {"tokens": torch.randint(0, m.vocab_size, (args.gbs, args.seq_len + 1), generator=g),
            "loss_mask": torch.ones(args.gbs, args.seq_len)}
    per = args.gbs // tr.ranks.dp
    mine = {k: v[tr.ranks.dp_rank * per:(tr.ranks.dp_rank + 1) * per] for k, v in rows.items()}
    times, losses = [], []
    for _ in range(args.steps):
        r = tr.step(split_micro_batches(mine, args.mbs))
        times.append(r.step_time_s)
        losses.append(r.loss)
    peak = torch.tensor([peak_memory_gb(args.device)], device="cuda" if args.device == "cuda" else "cpu")
    torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX)
    if rank == 0:
        Path(out).write_text(json.dumps({"times": times, "losses": losses, "peak_gb": peak.item(),
                                         "params": sum(p.numel() for p in tr.stage.parameters())}))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def main() -> None:
    from dsv4.megatron.train import NONFINITE_LOCATE

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--overrides", default="")
    ap.add_argument("--dtype", default="", help="bf16 | fp32 (default: the preset's)")
    ap.add_argument("--attn-impl", default="torch")
    ap.add_argument("--layouts", default="w1,tp2,ep2,pp2,tp2_ep2")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--gbs", type=int, default=4)
    ap.add_argument("--mbs", type=int, default=1)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--mtp", type=float, default=0.0, help="MTP loss weight (0: MTP not run)")
    ap.add_argument("--recompute", default="none", choices=("none", "full"))
    ap.add_argument("--nonfinite-locate", default="rerun", choices=NONFINITE_LOCATE,
                    help="the non-finite module hooks: on a bad step only (rerun), every step, or off")
    args = ap.parse_args()
    names = args.layouts.split(",")
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        sys.exit(f"unknown layout(s) {unknown}; known: {', '.join(LAYOUTS)}")
    tokens = args.gbs * args.seq_len
    print(f"model {args.model} {args.overrides} | {args.device} | global batch {args.gbs} x {args.seq_len} "
          f"= {tokens} tokens, micro-batch {args.mbs}, {args.steps} steps, non-finite hooks {args.nonfinite_locate}")
    print(f"{'layout':14s} {'world':>5s} {'first s':>8s} {'step s':>8s} {'tok/s':>9s} {'ratio':>6s} {'peak GB':>8s} "
          f"{'loss[0]':>8s} {'loss[-1]':>8s}")
    base = None
    with tempfile.TemporaryDirectory() as d:
        for name in names:
            world = LAYOUTS[name][0]
            out = Path(d) / f"{name}.json"
            t0 = time.time()
            mp.spawn(_worker, args=(world, _port(), args, name, str(out)), nprocs=world, join=True)
            r = json.loads(out.read_text())
            steady = statistics.median(r["times"][1:]) if len(r["times"]) > 1 else r["times"][0]
            tps = tokens / steady
            base = base or tps
            print(f"{name:14s} {world:5d} {r['times'][0]:8.2f} {steady:8.3f} {tps:9.1f} {tps / base:6.2f} "
                  f"{r['peak_gb']:8.2f} {r['losses'][0]:8.4f} {r['losses'][-1]:8.4f}   ({time.time() - t0:.0f} s wall)",
                  flush=True)


if __name__ == "__main__":
    main()
