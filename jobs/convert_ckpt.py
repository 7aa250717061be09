"""Step `convert`: BF16 checkpoint -> megatron distributed checkpoint at the training layout.

    python -m jobs.convert_ckpt --run-dir DIR

Every rank builds its pipeline stage of the DSV4 megatron model for the run's layout (TP/PP/EP/ETP),
reads exactly its slice of each tensor from the BF16 shards (safetensors slices, by official name or by
the HF-style alias of older output, whichever naming dsv4.checkpoint.detect_naming finds in the index),
and all ranks write one megatron dist_checkpointing checkpoint (model only, iteration 0). The checkpoint
holds logical tensors, so training may also load it at another layout. Conversion runs on CPU over gloo
whatever the training hardware.

Output: CKPT_TORCH_DIST (written under a .tmp name, renamed when complete) and its sentinel,
which records the source and layout; a re-run with the same inputs is skipped.
"""
from __future__ import annotations

import json
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from jobs.common import RunContext, byte_progress, done, fingerprint, log, mark_done, ranks_local, sentinel_path


@dataclass
class ConvertJob:
    run_dir: str
    model: object                # dsv4.config.ModelConfig
    layout: object               # dsv4.megatron.parallel.Layout
    src: str
    dst: str


class BF16Reader:
    """read(official_name, index) -> that slice of the tensor in a BF16 checkpoint (official names, as `v4 ckpt
    dequantize` writes them, or HF-style aliases: the naming is detected from the index keys)."""

    def __init__(self, directory: Path, n_layers: int, progress=None, total: int = 0):
        from dsv4.checkpoint import INDEX, detect_naming, from_official
        self.dir, self.n_layers, self._from_official = Path(directory), n_layers, from_official
        self.progress, self.total, self.done = progress, total, 0      # parameters read, of `total`
        index = self.dir / INDEX
        if index.is_file():
            self.files = json.loads(index.read_text())["weight_map"]
        else:
            from safetensors import safe_open
            self.files = {}
            for f in sorted(self.dir.glob("*.safetensors")):
                with safe_open(f, "pt") as h:
                    self.files.update({k: f.name for k in h.keys()})
        if not self.files:
            raise FileNotFoundError(f"{self.dir}: no safetensors shards (run the dequantize step first)")
        self.naming = detect_naming(self.files, self.dir)          # one naming, the dequantizer's or older aliases
        self._open = {}

    def __call__(self, name: str, index: tuple[slice, ...]):
        from safetensors import safe_open
        key = self._from_official(name, self.naming, self.n_layers)
        if key not in self.files:
            named = "" if key == name else f" (as {key}: the checkpoint has HF-style aliases)"
            raise KeyError(f"{self.dir}: tensor {name}{named} is missing; was the checkpoint made for this model "
                           "preset?")
        f = self.files[key]
        if f not in self._open:
            self._open[f] = safe_open(self.dir / f, "pt")
        t = self._open[f].get_slice(key)[index]
        if self.progress is not None:
            self.done += t.numel()
            self.progress(self.done, self.total, name)
        return t


def worker(rank: int, world: int, master_addr: str, master_port: int, job: ConvertJob) -> int:
    from dsv4.megatron.train import quiet_libraries
    quiet_libraries()
    RunContext.load(job.run_dir)                     # socket interface for gloo
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from dsv4.megatron.model import Objective, model_provider
    from dsv4.megatron.parallel import init_parallel
    from dsv4.megatron.train import _thread_queue_for_checkpoint_writes, init_distributed
    init_distributed(rank, world, "gloo", "cpu", master_addr, master_port)
    init_parallel(job.layout, 0)
    _thread_queue_for_checkpoint_writes()
    # every MTP/indexer parameter must be built (and so converted) whatever the training objective
    stage = model_provider(job.model, job.layout, Objective(mtp_coeff=1.0, indexer_coeff=1.0))
    t0 = time.time()
    n = sum(p.numel() for p in stage.parameters())
    # rank 0 reports its share (the ranks read theirs alongside)
    progress = byte_progress("convert (rank 0 reading)", every=0.2, unit="M params") if rank == 0 else None
    stage.load_weights(BF16Reader(Path(job.src), job.model.n_layers, progress, n))
    if rank == 0:
        log(f"convert: saving the megatron checkpoint ({n / 1e6:.1f} M parameters on rank 0)")
    tmp = Path(f"{job.dst}.tmp-{Path(job.run_dir).name}")      # one name for all ranks; another run's is another
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    dist_checkpointing.save({"model": stage.sharded_state_dict(), "iteration": 0,
                             "model_config": job.model.to_dict()}, str(tmp))
    dist.barrier()
    if rank == 0:
        dst = Path(job.dst)
        if dst.exists():
            shutil.rmtree(dst)
        tmp.rename(dst)
        log(f"rank 0: {n / 1e6:.1f} M parameters read and saved in {time.time() - t0:.1f} s -> {dst}")
    dist.barrier()
    return 0


def main(argv=None) -> int:
    ctx = RunContext.from_argv(argv, __doc__)
    from jobs.train_sft import layout_from, model_config, world_size
    cfg = ctx.cfg
    try:
        model, layout = model_config(cfg), layout_from(cfg)
        world = world_size(cfg)
        layout.validate(model, world)
    except (ValueError, KeyError) as e:
        log(f"error: {e}")
        return 2
    src, dst = ctx.paths.bf16_dir, ctx.paths.torch_dist_dir
    src_done = sentinel_path(src)
    inputs = {"src": str(src), "src_sentinel": src_done.read_text() if src_done.is_file() else fingerprint(src),
              "layout": [layout.tp, layout.pp, layout.ep, layout.etp, list(layout.layers_per_stage(model))],
              "model": model.to_dict()}
    if done(dst, inputs):
        log(f"megatron checkpoint already complete at {dst}; skipped")
        return 0
    if not src.is_dir():
        log(f"error: BF16 checkpoint {src} not found (CKPT_BF16_DIR); run the dequantize step first")
        return 1
    from dsv4.megatron.launch import launch
    log(f"convert {src} -> {dst} at TP={layout.tp} PP={layout.pp} EP={layout.ep} ETP={layout.etp} on {world} rank(s)")
    sentinel_path(dst).unlink(missing_ok=True)
    code = launch(worker, world, ConvertJob(str(ctx.run_dir), model, layout, str(src), str(dst)), "cpu", 0, log,
                  local=ranks_local(ctx.cfg))
    if code == 0:
        mark_done(dst, inputs, world=world)
    return code


if __name__ == "__main__":
    sys.exit(main())
