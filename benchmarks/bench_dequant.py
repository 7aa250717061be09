"""Dequantizer throughput on a generated checkpoint, next to a plain copy of the same bytes (same run).

    .venv/bin/python benchmarks/bench_dequant.py [--dir /tmp/dsv4-bench] [--preset 4layer]
        [--set 'n_routed_experts=8 vocab_size=32768'] [--threads 1] [--workers 2] [--keep]

Generates a released-layout checkpoint (FP8 + MXFP4, >= 1 GB with the defaults), then times
  1. a plain copy of its shard files, twice: shutil.copyfile (an in-kernel copy_file_range on Linux) and a
     user-space read/write loop in 64 MiB chunks (the path any program that transforms bytes must take),
  2. reading and dequantizing every tensor without writing (the compute part alone), and
  3. `dequantize_checkpoint` into BF16 shards (read, dequantize, write, fsync), in one process and with
     `workers` processes converting shards at once,
and prints MB/s of input bytes for both (and MB/s of output bytes for the dequantizer). Both read the source
from the page cache, since the generator has just written it. The dequantizer writes 2.2x the bytes it reads
(bf16 from FP8 and MXFP4), so where the disk is the limit its share of the copy's throughput cannot exceed
input/output bytes: the last line prints that ceiling beside the share reached. Everything is deleted at the end
unless --keep.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
from dsv4.checkpoint import dequantize_checkpoint, generate_checkpoint, iter_state_dict
from dsv4.config import ModelConfig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=Path("/tmp/dsv4-bench-dequant"))
    ap.add_argument("--preset", default="4layer")
    ap.add_argument("--set", dest="overrides", action="append", default=["n_routed_experts=8 vocab_size=32768"])
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--shard-gb", type=float, default=1.0)
    ap.add_argument("--workers", type=int, default=2, help="also time dequantize_checkpoint(workers=N), N > 1")
    ap.add_argument("--keep", action="store_true")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    cfg = ModelConfig.preset(a.preset).with_overrides(*a.overrides)
    src, copy, dst = a.dir / "src", a.dir / "copy", a.dir / "bf16"
    shutil.rmtree(a.dir, ignore_errors=True)
    shard_bytes = int(a.shard_gb * (1 << 30))

    t = time.perf_counter()
    gen = generate_checkpoint(cfg, src, shard_bytes=shard_bytes)
    t_gen = time.perf_counter() - t
    shards = sorted(src.glob("model-*.safetensors"))
    nbytes = sum(p.stat().st_size for p in shards)
    print(f"checkpoint: {a.preset} {' '.join(a.overrides)} -> {len(shards)} shard(s), {nbytes / 1e6:.0f} MB "
          f"({gen.n_tensors} tensors), generated in {t_gen:.1f} s; torch threads {torch.get_num_threads()}")

    copy.mkdir(parents=True)
    t = time.perf_counter()
    for p in shards:
        shutil.copyfile(p, copy / p.name)
        with open(copy / p.name, "rb+") as f:   # same durability as the dequantizer's shards
            os.fsync(f.fileno())
    t_copy = time.perf_counter() - t
    shutil.rmtree(copy)

    copy.mkdir(parents=True)
    t = time.perf_counter()
    for p in shards:
        with open(p, "rb") as fi, open(copy / p.name, "wb") as fo:
            while chunk := fi.read(64 << 20):
                fo.write(chunk)
            fo.flush()
            os.fsync(fo.fileno())
    t_ucopy = time.perf_counter() - t
    shutil.rmtree(copy)

    t = time.perf_counter()
    for _ in iter_state_dict(src):      # read + dequantize only, nothing written
        pass
    t_compute = time.perf_counter() - t

    t = time.perf_counter()
    s = dequantize_checkpoint(src, dst, shard_bytes=shard_bytes)
    t_deq = time.perf_counter() - t
    t_par = None
    if a.workers > 1:
        shutil.rmtree(dst)
        t = time.perf_counter()
        dequantize_checkpoint(src, dst, shard_bytes=shard_bytes, workers=a.workers)
        t_par = time.perf_counter() - t

    print(f"{'step':<24} {'seconds':>8} {'MB/s (input bytes)':>19} {'MB/s (output bytes)':>20}")
    print(f"{'copyfile + fsync':<24} {t_copy:>8.2f} {nbytes / 1e6 / t_copy:>19.0f} {nbytes / 1e6 / t_copy:>20.0f}")
    print(f"{'read/write copy + fsync':<24} {t_ucopy:>8.2f} {nbytes / 1e6 / t_ucopy:>19.0f} {nbytes / 1e6 / t_ucopy:>20.0f}")
    print(f"{'read + dequantize only':<24} {t_compute:>8.2f} {s.bytes_in / 1e6 / t_compute:>19.0f} "
          f"{s.bytes_out / 1e6 / t_compute:>20.0f}")
    print(f"{'dequantize to bf16':<24} {t_deq:>8.2f} {s.bytes_in / 1e6 / t_deq:>19.0f} {s.bytes_out / 1e6 / t_deq:>20.0f}")
    if t_par:
        print(f"{f'dequantize, {a.workers} workers':<24} {t_par:>8.2f} {s.bytes_in / 1e6 / t_par:>19.0f} "
              f"{s.bytes_out / 1e6 / t_par:>20.0f}")
    print(f"dequantize time / copy time: {t_deq / t_copy:.2f}x (copyfile), {t_deq / t_ucopy:.2f}x (read/write); "
          f"output {s.bytes_out / 1e6:.0f} MB in {s.n_shards} shard(s), {s.bytes_out / nbytes:.2f}x the input bytes")
    # Writing the output at the faster copy's rate is the floor for any dequantizer on this disk: as a share of the
    # copy's input throughput it is input/output bytes, whatever the compute costs.
    t_floor = s.bytes_out / max(nbytes / t_copy, nbytes / t_ucopy)
    print(f"single process: {t_copy / t_deq:.0%} of copyfile's input MB/s; writing the output at the copy's rate "
          f"alone takes {t_floor:.2f} s ({t_copy / t_floor:.0%} of copyfile's input MB/s: the ceiling here), and the "
          f"dequantizer ran at {t_floor / t_deq:.0%} of that ceiling")
    if not a.keep:
        shutil.rmtree(a.dir)


if __name__ == "__main__":
    main()
