"""Tiny DeepSeek-V4 reference model: forward and forward+backward wall time on CPU.

    .venv/bin/python benchmarks/bench_model.py [--batch 2] [--seq 64] [--iters 5] [--preset tiny] [--set k=v ...] [--threads N]

Prints the median over --iters timed runs after 2 warm-up runs (the first call pays one-off oneDNN set-up),
with tokens/s, for the plain model and with every QAT point switched on. Loss = next-token CE + MTP CE +
the indexer KL loss, so the backward covers every parameter.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
from dsv4.config import ModelConfig
from dsv4.model import Transformer


def step(model, ids, backward: bool) -> None:
    out = model(ids, indexer_loss=backward)
    if backward:
        V = model.cfg.vocab_size
        loss = F.cross_entropy(out.logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1))
        for k, m in enumerate(out.mtp_logits):
            loss = loss + F.cross_entropy(m[:, :-1].reshape(-1, V), ids[:, k + 2:].reshape(-1))
        (loss + out.indexer_loss).backward()
        model.zero_grad(set_to_none=True)


def median_ms(fn, iters: int) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    base = ModelConfig.preset(a.preset).with_overrides(*a.overrides)
    ids = torch.randint(0, base.vocab_size, (a.batch, a.seq), generator=torch.Generator().manual_seed(0))
    tokens = a.batch * a.seq
    print(f"preset {a.preset}: {base.n_params() / 1e6:.2f} M params, dtype {base.dtype}, batch {a.batch} x seq {a.seq}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{'variant':<22} {'forward ms':>11} {'fwd+bwd ms':>11} {'fwd+bwd tok/s':>14}")
    variants = {"plain": base,
                "all QAT points on": base.with_overrides(qat_kv_fp8=True, qat_indexer_fp4=True, fp8_gemm_inputs=True,
                                                         mxfp4_experts=True)}
    for name, cfg in variants.items():
        model = Transformer(cfg)
        with torch.no_grad():
            fwd = median_ms(lambda: step(model, ids, False), a.iters)
        both = median_ms(lambda: step(model, ids, True), a.iters)
        print(f"{name:<22} {fwd:>11.1f} {both:>11.1f} {tokens / both * 1e3:>14.0f}")


if __name__ == "__main__":
    main()
