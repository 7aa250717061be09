"""Step `dequantize`: official FP8/MXFP4 checkpoint -> BF16 shards + index, under the official names (which
transformers and SGLang load).

Streaming and resumable (dsv4.checkpoint.dequantize_checkpoint); the sentinel records which source
it was made from, so a re-run skips and a changed source is redone.
"""
from __future__ import annotations

import sys

from jobs.common import RunContext, byte_progress, done, fingerprint, log, mark_done, sentinel_path


def main(argv=None) -> int:
    ctx = RunContext.from_argv(argv, __doc__)
    src, dst = ctx.paths.hf_dir, ctx.paths.bf16_dir
    src_done = sentinel_path(src)
    # a downloaded release has no sentinel of ours: its file names, sizes and mtimes stand for it
    inputs = {"src": str(src), "src_sentinel": src_done.read_text() if src_done.is_file() else fingerprint(src)}
    if done(dst, inputs):
        log(f"BF16 checkpoint already complete at {dst}; skipped")
        return 0
    from dsv4.checkpoint import CheckpointError, default_workers, dequantize_checkpoint

    log(f"dequantizing {src} -> {dst}")
    try:
        # force only when what is there was made from another source (ours, stale); an interrupted
        # run into the same destination is resumed by the dequantizer itself
        stale = sentinel_path(dst).is_file()
        s = dequantize_checkpoint(src, dst, force=stale, progress=byte_progress("dequantize"),
                                  workers=default_workers())
    except CheckpointError as e:
        log(f"error: {e}")
        return 1
    mark_done(dst, inputs, tensors=s.n_tensors, shards=s.n_shards, bytes_out=s.bytes_out)
    log(f"{s.n_tensors} tensors -> {s.n_shards} shard(s) ({s.shards_written} written, {s.shards_skipped} resumed), "
        f"{s.bytes_in / 1e6:.1f} MB in, {s.bytes_out / 1e6:.1f} MB out")
    return 0


if __name__ == "__main__":
    sys.exit(main())
