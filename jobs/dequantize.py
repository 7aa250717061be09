"""Step `dequantize`: official FP8/MXFP4 checkpoint -> BF16 shards + index, under the official names (which
transformers and SGLang load).

Streaming and resumable (dsv4.checkpoint.dequantize_checkpoint); the sentinel records which source
it was made from, so a re-run skips and a changed source is redone. As a Ray job on a cluster of several nodes
the output shards are spread over them (one task a node, pinned there, each converting shards i, i+n, ... into
the destination, which the nodes share: preflight's `shared_work`), and this process then finishes the
conversion (it finds their shards complete and writes the index). A destination made from another source is
converted again on this node alone.
"""
from __future__ import annotations

import os
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
        # force only when what is there was made from another source (ours, stale): then this node converts it
        # all; an interrupted run into the same destination is resumed by the dequantizer itself
        stale = sentinel_path(dst).is_file()
        nodes = [] if stale else _ray_nodes()
        if len(nodes) > 1:
            _spread(src, dst, nodes)
        s = dequantize_checkpoint(src, dst, force=stale, progress=byte_progress("dequantize"),
                                  workers=default_workers())
    except CheckpointError as e:
        log(f"error: {e}")
        return 1
    mark_done(dst, inputs, tensors=s.n_tensors, shards=s.n_shards, bytes_out=s.bytes_out)
    log(f"{s.n_tensors} tensors -> {s.n_shards} shard(s) ({s.shards_written} written, {s.shards_skipped} resumed), "
        f"{s.bytes_in / 1e6:.1f} MB in, {s.bytes_out / 1e6:.1f} MB out")
    return 0


def _ray_nodes() -> list[dict]:
    """The alive nodes of the Ray cluster this process runs on as a Ray job's entrypoint ([] when it is not one:
    the job supervisor sets RAY_JOB_CONFIG_JSON_ENV_VAR for its entrypoint)."""
    if "RAY_JOB_CONFIG_JSON_ENV_VAR" not in os.environ:
        return []
    import ray
    ray.init(log_to_driver=False)
    return sorted((n for n in ray.nodes() if n["Alive"]), key=lambda n: n["NodeManagerAddress"])


def _spread(src, dst, nodes: list[dict], shard_bytes: int | None = None) -> None:
    """Node i of `nodes` converts output shards i, i+n, ... (`shard_bytes`: the shard size the finishing call uses,
    default the dequantizer's)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    @ray.remote(num_cpus=0)       # like the probe's: the step owns the cluster while it runs
    def part(i: int, n: int) -> dict:
        from dsv4.checkpoint import DEFAULT_SHARD_BYTES, default_workers, dequantize_checkpoint
        from dsv4.procenv import undo_ray_thread_cap
        undo_ray_thread_cap()     # Ray starts the task with OMP_NUM_THREADS=1: this node's cores, as the entrypoint's
        s = dequantize_checkpoint(src, dst, workers=default_workers(), part=(i, n),
                                  shard_bytes=shard_bytes or DEFAULT_SHARD_BYTES)
        import torch
        return {"ip": ray.util.get_node_ip_address(), "written": s.shards_written, "skipped": s.shards_skipped,
                "threads": torch.get_num_threads()}

    n = len(nodes)
    log(f"dequantize: output shards spread over {n} nodes (node i converts shards i, i+{n}, ...)")
    refs = [part.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)).remote(i, n)
            for i, node in enumerate(nodes)]
    for i, r in enumerate(ray.get(refs)):
        log(f"dequantize: part {i}/{n} on {r['ip']}: {r['written']} shard(s) written, {r['skipped']} already complete "
            f"({r['threads']} CPU threads)")


if __name__ == "__main__":
    sys.exit(main())
