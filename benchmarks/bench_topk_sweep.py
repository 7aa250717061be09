"""Where a sparse attention forward's time goes: a cost per 64-row KV block and a cost per kernel that top-k does not
change, from the forward's time at several top-k (H64 D512, S 4096, N 5120: the V4-Flash shape but for top-k).

Times our TileLang forward and, where a build of FlashMLA is importable (see `v4 bench kernels`), FlashMLA's on the
same inputs, `--rounds` interleaved rounds of `v4 bench kernels`' timing each; the fastest median of each top-k enters a
least-squares line  ms = per_block * (top-k / 64) + fixed. Prints the times, the line of each kernel, and what each
line gives at top-k 640 in TFLOP/s: the per-block cost of one kernel with the fixed cost of the other shows what
combining their strengths would reach. Needs a GPU (and TileLang; it compiles one forward per top-k).

    python benchmarks/bench_topk_sweep.py [--topk 128,256,384,640,1024,2048] [--rounds 3] [--json]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

S, N, H, D, BLOCK = 4096, 5120, 64, 512, 64


def fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares slope and intercept."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return slope, my - slope * mx


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--topk", default="128,256,384,640,1024,2048")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    import torch
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    from dsv4.kernels import tilelang_sparse_attn as tl
    from launcher.commands.bench import AttnShape, _flashmla_args, _inputs, _timed_runs, flashmla

    fm, where = flashmla()
    if fm is None:
        print(f"FlashMLA is not importable ({where}): our kernel alone", file=sys.stderr)
    topks = [int(k) for k in args.topk.split(",")]
    best: dict[str, dict[int, float]] = {}
    scale = D ** -0.5
    for k in topks:
        q, kv, sink, idx = _inputs(AttnShape(f"k{k}", 1, S, N, H, D, k))
        qp, kvb, sinkp, idxp = tl._pad_inputs(q, kv, sink, idx)
        fns = {"tilelang": lambda: tl._fwd(qp, kvb, sinkp, idxp, scale)}
        if fm is not None:
            fm_args = _flashmla_args(q, kv, idx)
            fns["flashmla"] = lambda: fm(*fm_args, scale, D, sink)
        for _ in range(args.rounds):
            for name, fn in fns.items():
                times, _mhz = _timed_runs(fn, 3, 10)
                med = sorted(times)[len(times) // 2]
                best.setdefault(name, {})[k] = min(med, best.get(name, {}).get(k, float("inf")))
        del q, kv, sink, idx, qp, kvb, sinkp, idxp
        torch.cuda.empty_cache()

    flops_640 = 4 * S * H * 640 * D
    lines = {name: fit([k / BLOCK for k in topks], [ms[k] for k in topks]) for name, ms in best.items()}
    report = {"shape": f"B1 S{S} N{N} H{H} D{D}", "device": torch.cuda.get_device_name(),
              "ms": {name: {str(k): v for k, v in ms.items()} for name, ms in best.items()},
              "line": {name: {"per_block_ms": a, "fixed_ms": b} for name, (a, b) in lines.items()}}
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"{report['device']}, B1 S{S} N{N} H{H} D{D}; fastest median of {args.rounds} rounds, ms")
    print(f"{'top-k':>6} " + " ".join(f"{name:>10}" for name in best))
    for k in topks:
        print(f"{k:>6} " + " ".join(f"{best[name][k]:>10.4f}" for name in best))
    for name, (a, b) in lines.items():
        at = a * 640 / BLOCK + b
        print(f"{name}: {a * 1e3:.1f} us a block (all CTAs), {b * 1e3:.1f} us fixed; at top-k 640 {at:.4f} ms, "
              f"{flops_640 / at / 1e9:.1f} TFLOP/s")
    if len(lines) == 2:
        (a0, b0), (a1, b1) = lines["tilelang"], lines["flashmla"]
        for label, (a, b) in (("flashmla's per-block cost, tilelang's fixed cost", (a1, b0)),
                              ("tilelang's per-block cost, flashmla's fixed cost", (a0, b1))):
            at = a * 640 / BLOCK + b
            print(f"{label}: at top-k 640 {at:.4f} ms, {flops_640 / at / 1e9:.1f} TFLOP/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
