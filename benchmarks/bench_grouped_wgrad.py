"""The routed experts' weight-gradient accumulation into fp32 main_grad, three ways, at one rank's expert shapes.

    python benchmarks/bench_grouped_wgrad.py [--experts 32] [--rows 768] [--dim 4096] [--inter 2048] [--repeat 20]
                                             [--configs all|chosen] [--json]

For each of a layer's three expert weights (w1, w3: [inter, dim]; w2: [dim, inter]) and one micro-batch's rows
sorted by expert (counts drawn around --rows, one expert empty, as routing leaves them), times:
  addmm     one cuBLAS addmm(out_dtype=float32) per expert into its main_grad (moe_impl=grouped, the default);
  grouped   torch._grouped_mm's bf16 weight gradients, then each added into its main_grad (what megatron's hook did
            after moe_impl=grouped_autograd);
  triton    dsv4/kernels/triton_grouped_wgrad.py (moe_impl=grouped_triton), for each launch configuration
            (--configs all: a sweep of block sizes, warps and stages; chosen: its CONFIG).
Prints ms per layer (the three weights), TFLOP/s of the GEMM work (2 x rows x inter x dim x 3), the ratio to addmm
in the same run, and each result's largest difference from addmm's relative to its largest entry (a config that
computes something else shows here, not only in its speed). CUDA only.
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import torch  # noqa: E402

from dsv4.kernels import triton_grouped_wgrad as tw  # noqa: E402


def _time(fn, repeat: int) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeat):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeat


def _configs(which: str) -> list[dict]:
    if which == "chosen":
        return [dict(tw.CONFIG)]
    out = []
    for bn, bk, bt, warps, stages in itertools.product((128, 256), (128,), (32, 64), (4, 8), (3, 4)):
        if bn == 256 and warps == 4:
            continue                       # a 256 x 128 fp32 accumulator does not fit 4 warps' registers
        out.append({"BN": bn, "BK": bk, "BT": bt, "GROUP": 8, "num_warps": warps, "num_stages": stages})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--rows", type=int, default=768, help="mean rows an expert (a micro-batch of 4096 tokens, top-6 "
                                                         "of 256 experts, 32 of them local: 768)")
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--inter", type=int, default=2048)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--configs", choices=("all", "chosen"), default="all")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_grouped_wgrad: needs a CUDA GPU")
    E, dev = args.experts, "cuda"
    g = torch.Generator().manual_seed(0)
    counts = (torch.rand(E, generator=g) * 2 * args.rows).long()
    counts[E // 2] = 0
    offs = torch.cumsum(counts, 0).to(torch.int32).to(dev)
    T = int(counts.sum())
    bounds = [0] + offs.tolist()
    shapes = [(args.inter, args.dim), (args.inter, args.dim), (args.dim, args.inter)]     # w1, w3, w2: [out, in]
    weights = []
    for n, k in shapes:
        weights.append({"dy": torch.randn(T, n, device=dev).bfloat16(), "x": torch.randn(T, k, device=dev).bfloat16(),
                        "mg": [torch.zeros(n, k, device=dev) for _ in range(E)]})
    flops = sum(2 * T * n * k for n, k in shapes)

    def addmm():
        for w in weights:
            for e in range(E):
                if bounds[e + 1] > bounds[e]:
                    r = slice(bounds[e], bounds[e + 1])
                    torch.addmm(w["mg"][e], w["dy"][r].t(), w["x"][r], out_dtype=torch.float32, out=w["mg"][e])

    def grouped():
        for w in weights:
            dw = torch._grouped_mm(w["dy"].t(), w["x"], offs=offs)
            torch._foreach_add_(w["mg"], list(dw.unbind(0)))

    def triton_with(cfg):
        def run():
            for w in weights:
                tw.accumulate(w["dy"], w["x"], offs, w["mg"], config=cfg)
        return run

    def result(fn) -> list[torch.Tensor]:
        for w in weights:
            for m in w["mg"]:
                m.zero_()
        fn()
        return [m.clone() for w in weights for m in w["mg"]]

    reference = result(addmm)
    scale = max(r.abs().max().item() for r in reference)

    def diff(fn) -> float:
        return max((a - b).abs().max().item() for a, b in zip(result(fn), reference)) / scale

    rows = [{"path": "addmm", "ms": _time(addmm, args.repeat), "diff": 0.0},
            {"path": "grouped + add", "ms": _time(grouped, args.repeat), "diff": diff(grouped)}]
    for cfg in _configs(args.configs):
        name = "triton " + " ".join(f"{k}={v}" for k, v in cfg.items() if k != "GROUP")
        try:
            fn = triton_with(cfg)
            rows.append({"path": name, "ms": _time(fn, args.repeat), "diff": diff(fn), "config": cfg})
        except Exception as e:                   # a config out of shared memory or registers: say so, go on
            rows.append({"path": name, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"})
    base = rows[0]["ms"]
    for r in rows:
        if "ms" in r:
            r["tflops"] = flops / r["ms"] / 1e9
            r["vs_addmm"] = base / r["ms"]
    head = (f"{E} experts, {T} rows ({args.rows} mean, one expert empty), weights {args.inter} x {args.dim}: "
            f"{flops / 1e12:.2f} TFLOP a layer, {torch.cuda.get_device_name()}")
    if args.json:
        print(json.dumps({"shape": head, "rows": rows}))
        return
    print(head)
    print(f"{'path':58s} {'ms':>8s} {'TFLOP/s':>8s} {'x addmm':>8s} {'diff':>9s}")
    for r in rows:
        if "error" in r:
            print(f"{r['path']:58s} {r['error']}")
        else:
            print(f"{r['path']:58s} {r['ms']:8.3f} {r['tflops']:8.1f} {r['vs_addmm']:8.2f} {r['diff']:9.2e}")


if __name__ == "__main__":
    main()
