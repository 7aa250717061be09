"""Step `evaluate`: next-token loss on the held-out SFT rows, for the trained checkpoint and (when it
exists) the converted starting checkpoint, at the run's layout.

    python -m jobs.evaluate --run-dir DIR

The held-out rows are the VAL_FRACTION split jobs.train_sft leaves out (same seed). Each
data-parallel rank scores its share; shares are padded to equal length with rows whose loss mask
is 0, because expert-parallel all_to_all needs every rank in the same micro-batch. Writes
DIR/steps/evaluate/eval.json: {"loss", "loss_tokens", "rows", "checkpoint", "step", "loss_initial"?}.
"""
from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

from jobs.common import RunContext, done, fingerprint, foreign_sft_data, log, mark_done, ranks_local
from jobs.train_sft import DATA_SEED_OFFSET, SFTData, tokenizer_dirs, train_config, world_size


@dataclass
class EvalJob:
    run_dir: str
    tc: object
    data: SFTData
    backend: str
    checkpoints: list[str]        # scored in order; the first is the trained one


def rank_rows(ds, dp_rank: int, dp: int, micro: int) -> list[dict]:
    """This DP rank's micro-batches over the whole split; padded rows carry a zero loss mask."""
    import torch
    n = len(ds)
    per = -(-n // dp)
    per = -(-per // micro) * micro
    rows = []
    for i in range(dp_rank * per, (dp_rank + 1) * per):
        r = dict(ds[i % n])
        if i >= n:
            r["loss_mask"] = torch.zeros_like(r["loss_mask"])
        rows.append(r)
    return [{k: torch.stack([r[k] for r in rows[j:j + micro]]) for k in rows[0]} for j in range(0, per, micro)]


def worker(rank: int, world: int, master_addr: str, master_port: int, job: EvalJob) -> int:
    from dsv4.megatron.train import quiet_libraries
    quiet_libraries()
    ctx = RunContext.load(job.run_dir)
    from dsv4.megatron.parallel import init_parallel
    from dsv4.megatron.train import Trainer, init_distributed
    tc = job.tc
    init_distributed(rank, world, job.backend, tc.device, master_addr, master_port)
    init_parallel(tc.layout, tc.seed)
    trainer = Trainer(tc, init=None)
    micro = rank_rows(job.data.dataset(), trainer.ranks.dp_rank, trainer.ranks.dp, tc.micro_batch_size)
    result = {"rows": len(job.data.dataset())}
    for i, ckpt in enumerate(job.checkpoints):
        step = trainer.load(Path(ckpt), with_optimizer=False)
        loss, n = trainer.eval_loss(micro)
        if i == 0:
            result.update(loss=loss, loss_tokens=n, checkpoint=ckpt, step=step)
        else:
            result["loss_initial"] = loss
        if rank == 0:
            log(f"eval loss {loss:.4f} over {n} tokens of {result['rows']} held-out rows ({ckpt})")
    trainer.close()
    if rank == 0:
        out = ctx.step_dir("evaluate") / "eval.json"
        out.write_text(json.dumps(result, indent=2))
    return 0 if math.isfinite(result["loss"]) else 16


def main(argv=None) -> int:
    ctx = RunContext.from_argv(argv, __doc__)
    cfg = ctx.cfg
    try:
        tc = train_config(cfg)
    except (ValueError, KeyError) as e:
        log(f"error: {e}")
        return 2
    if (why := foreign_sft_data(ctx)):
        log(f"error: {why}")
        return 1
    from dsv4.megatron.train import latest_checkpoint
    trained = latest_checkpoint(ctx.paths.checkpoints)
    if trained is None:
        log(f"error: no checkpoint in {ctx.paths.checkpoints}; run the train step first")
        return 1
    step_dir = ctx.step_dir("evaluate")
    inputs = {"checkpoint": str(trained), "data": fingerprint(ctx.paths.sft_data)}
    if done(step_dir, inputs):
        log(f"evaluation of {trained} already done; skipped")
        return 0
    ckpts = [str(trained)] + ([str(ctx.paths.torch_dist_dir)] if done(ctx.paths.torch_dist_dir) else [])
    data = SFTData(str(ctx.paths.sft_data), tokenizer_dirs(cfg), tc.seq_len, cfg["PRESET_SEED"] + DATA_SEED_OFFSET,
                   split="val")
    from dsv4.megatron.launch import launch
    code = launch(worker, world_size(cfg), EvalJob(str(ctx.run_dir), tc, data, cfg["HW_DIST_BACKEND"], ckpts),
                  tc.device, int(cfg.get("V4_DIST_PORT") or 0), log, local=ranks_local(cfg))
    if code == 0:
        mark_done(step_dir, inputs)
    return code


if __name__ == "__main__":
    sys.exit(main())
