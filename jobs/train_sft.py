"""Step `train`: supervised fine-tuning of DeepSeek-V4 on megatron-core.

    python -m jobs.train_sft --run-dir DIR

Reads the run's resolved config (DIR/config.json). World size 1 trains in this process; a larger
world starts one Ray actor per rank (dsv4.megatron.launch). Writes:
  DIR/metrics.jsonl                    one row per optimizer step
  DIR/checkpoints/iter_NNNNNNN/        megatron distributed checkpoints (+ latest_checkpointed_iteration.txt)
  DIR/steps/train/reload_check.json    save -> reload -> next-step losses (the smoke gate reads it)
  DIR/steps/train/nonfinite.json       step, rank and first module of a non-finite loss/gradient
  DIR/steps/train/nan_capture.json     what `v4 nan bisect` needs to replay that step (docs/nan.md)
Exit codes: 0 done, 1 failed, 2 bad configuration, 16 non-finite loss or gradient.
A re-run continues from the latest checkpoint; a finished run (sentinel present) is skipped.
Test hooks (environment): V4_PLANT_NAN="MODULE:STEP[:forward|backward][@COND,...]", V4_KILL_AT_STEP=N;
(config) PRESET_PLANT_HANG="RANK:STEP[@once]" makes a rank sleep before a collective (the hang watchdog's test).
With PRESET_HANG_TIMEOUT > 0 every rank keeps a heartbeat under DIR/heartbeat/ (dsv4/heartbeat.py) that the
launcher's watchdog reads (launcher/watchdog.py).
"""
from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from jobs.common import (RunContext, done, fingerprint, foreign_sft_data, log, mark_done, ranks_local,
                         with_compile_cache)

VAL_FRACTION = 0.1      # held-out share of the SFT rows (jobs.evaluate scores it)
DATA_SEED_OFFSET = 17   # the data order's seed differs from the weights' seed


@dataclass
class SFTData:
    """Picklable recipe for the training rows (rebuilt on every rank)."""
    path: str
    tokenizer_dirs: list[str]
    seq_len: int
    seed: int
    split: str = "train"          # train | val

    def dataset(self):
        from dsv4.data import SFTDataset, train_val_split
        from jobs.verify_template import load_encoder, load_tokenizer
        dirs = [Path(d) for d in self.tokenizer_dirs]
        tokenizer, _ = load_tokenizer(dirs)
        ds = SFTDataset(self.path, tokenizer, self.seq_len, encoder=load_encoder(dirs))
        train, val = train_val_split(ds, VAL_FRACTION, self.seed)
        return train if self.split == "train" else val

    def step_batches(self, rows_per_rank: int):
        """(dp_rank, dp, start_step) -> endless per-step batches for that data-parallel rank."""
        from dsv4.data import batches
        ds = self.dataset()
        return lambda dp_rank, dp, start: batches(ds, rows_per_rank, self.seed, dp_rank, dp, start)


@dataclass
class SFTJob:
    run_dir: str
    tc: object                    # dsv4.megatron.train.TrainConfig
    data: SFTData
    backend: str


def model_config(cfg: dict):
    """The run's model: preset + overrides, with the resolved attention implementation."""
    from dsv4.config import ModelConfig
    overrides = cfg.get("PRESET_MODEL_OVERRIDES") or []
    specs = overrides if isinstance(overrides, list) else [overrides]
    m = ModelConfig.preset(cfg["PRESET_MODEL"]).with_overrides(*[s for s in specs if s])
    return m.with_overrides(attn_impl=cfg.get("ATTN_IMPL") or ("tilelang" if cfg["HW_DEVICE"] == "cuda" else "torch"))


def check_against_checkpoint(m, ckpt_dir: Path) -> None:
    """A real checkpoint must be the model the preset describes (the run trains the preset's shapes)."""
    path = ckpt_dir / "config.json"
    if not path.is_file():
        return
    from dsv4.config import ModelConfig
    c = ModelConfig.from_hf_config(str(path))
    keys = ("dim", "n_layers", "n_heads", "head_dim", "vocab_size", "n_routed_experts", "moe_inter_dim", "compress_ratios")
    bad = [f"{k}: preset {getattr(m, k)} vs checkpoint {getattr(c, k)}" for k in keys if getattr(m, k) != getattr(c, k)]
    if bad:
        raise ValueError(f"{path} does not match PRESET_MODEL/PRESET_MODEL_OVERRIDES: " + "; ".join(bad)
                         + " (pick the preset of this checkpoint, or fix the overrides)")


def layout_from(cfg: dict):
    from dsv4.megatron.parallel import Layout
    stages = cfg.get("PP_STAGE_LAYERS")
    return Layout(tp=cfg["PRESET_TP"], pp=cfg["PRESET_PP"], ep=cfg["PRESET_EP"], etp=cfg.get("PRESET_ETP", 1),
                  stage_layers=tuple(stages) if stages else None, cp=cfg.get("PRESET_CP", 1))


def train_config(cfg: dict):
    from dsv4.megatron.model import Objective
    from dsv4.megatron.train import TrainConfig
    m = model_config(cfg)
    return TrainConfig(
        model=m, layout=layout_from(cfg),
        objective=Objective(mtp_coeff=float(cfg.get("PRESET_MTP_LOSS_COEFF", 0.0) or 0.0),
                            indexer_coeff=m.indexer_loss_coeff),
        seq_len=cfg["PRESET_SEQ_LEN"], micro_batch_size=cfg["PRESET_MICRO_BATCH_SIZE"],
        global_batch_size=cfg["PRESET_GLOBAL_BATCH_SIZE"], num_steps=cfg["PRESET_NUM_STEPS"],
        lr=cfg["PRESET_LR"], min_lr=cfg["PRESET_MIN_LR"], lr_decay_style=cfg["PRESET_LR_DECAY_STYLE"],
        lr_warmup_iters=cfg["PRESET_LR_WARMUP_ITERS"], weight_decay=cfg["PRESET_WEIGHT_DECAY"],
        seed=cfg["PRESET_SEED"], save_interval=max(1, cfg["PRESET_SAVE_INTERVAL"]),
        save_retain_interval=cfg.get("PRESET_SAVE_RETAIN_INTERVAL", 0),
        recompute="full" if cfg.get("HW_RECOMPUTE_GRANULARITY") == "full" else "none",
        device=cfg["HW_DEVICE"], peak_tflops=float(cfg.get("HW_PEAK_TFLOPS") or 0.0),
        nonfinite_locate=cfg.get("PRESET_NONFINITE_LOCATE") or TrainConfig.nonfinite_locate)   # older run configs lack it


def world_size(cfg: dict) -> int:
    return int(cfg.get("WORLD_SIZE") or cfg["V4_NUM_NODES"] * cfg["V4_NUM_GPUS_PER_NODE"])


def tokenizer_dirs(cfg: dict) -> list[str]:
    from jobs.verify_template import checkpoint_dirs
    return [str(d) for d in checkpoint_dirs(cfg)]


def watched(tc, ctx: RunContext, rank: int, world: int, master_addr: str):
    """`tc` with the hang watchdog's heartbeat (under RUN/heartbeat when PRESET_HANG_TIMEOUT > 0) and the planted
    hang (PRESET_PLANT_HANG); the rank's first mark, made before the rendezvous; the process group's timeout.
    Shared by the SFT and RL workers."""
    import megatron.core  # noqa: F401 - seconds of imports, before the first mark: not a stretch to judge
    from dsv4.heartbeat import HEARTBEAT_DIR, Heartbeat, collective_timeout_s
    hang_s = float(ctx.cfg.get("PRESET_HANG_TIMEOUT") or 0)
    tc = dataclasses.replace(tc, heartbeat_dir=str(ctx.run_dir / HEARTBEAT_DIR) if hang_s > 0 else "",
                             plant_hang=planted_hang(ctx.cfg))
    Heartbeat(tc.heartbeat_dir, rank, world, master_addr, plant=tc.plant_hang).mark(0, "start")
    return tc, collective_timeout_s(str(ctx.cfg.get("HW_DIST_BACKEND") or "gloo"), hang_s)


def planted_hang(cfg: dict) -> str:
    """PRESET_PLANT_HANG as the heartbeat takes it: "RANK:STEP[:PHASE]" hangs every job of the step, with "@once" only
    its first (V4_STEP_ATTEMPT 0: a restart then goes through, launcher/recovery.py)."""
    spec = str(cfg.get("PRESET_PLANT_HANG") or "")
    if spec.endswith("@once"):
        return "" if int(os.environ.get("V4_STEP_ATTEMPT") or 0) else spec[:-len("@once")]
    return spec


def worker(rank: int, world: int, master_addr: str, master_port: int, job: SFTJob) -> int:
    """One rank of the training job (in process, or inside a Ray actor)."""
    from dsv4.megatron.train import quiet_libraries
    quiet_libraries()
    ctx = RunContext.load(job.run_dir)           # also exports the socket interface for gloo/NCCL
    on_metrics = with_compile_cache(ctx.write_metrics)      # counted before anything compiles
    from dsv4.megatron.parallel import init_parallel
    from dsv4.megatron.train import Outputs, init_distributed, run_sft
    tc, pg_timeout_s = watched(job.tc, ctx, rank, world, master_addr)
    init_distributed(rank, world, job.backend, tc.device, master_addr, master_port, timeout_s=pg_timeout_s)
    init_parallel(tc.layout, tc.seed)
    step_dir = Path(job.run_dir) / "steps" / "train"
    torch_dist = Path(ctx.cfg["CKPT_TORCH_DIST"]) if ctx.cfg.get("CKPT_TORCH_DIST") else None
    out = Outputs(checkpoints=ctx.paths.checkpoints,
                  init_checkpoint=torch_dist if torch_dist and done(torch_dist) else None,
                  reload_check=step_dir / "reload_check.json", nonfinite=step_dir / "nonfinite.json")
    rows_per_rank = tc.global_batch_size // (world // (tc.layout.tp * tc.layout.pp * tc.layout.cp))
    return run_sft(tc, job.data.step_batches(rows_per_rank), out, on_metrics=on_metrics, log=log)


def main(argv=None) -> int:
    ctx = RunContext.from_argv(argv, __doc__)
    cfg = ctx.cfg
    try:
        tc = train_config(cfg)
        tc.layout.validate(tc.model, world_size(cfg), tc.seq_len)
        if cfg.get("PRESET_WEIGHTS") == "hf":
            check_against_checkpoint(tc.model, ctx.paths.bf16_dir)
    except (ValueError, KeyError) as e:
        log(f"error: {e}")
        return 2
    if (why := foreign_sft_data(ctx)):
        log(f"error: {why}")
        return 1
    step_dir = ctx.step_dir("train")
    inputs = {"config": fingerprint(ctx.run_dir / "config.json"), "data": fingerprint(ctx.paths.sft_data)}
    if done(step_dir, inputs):
        log(f"training already finished ({step_dir}); skipped")
        return 0
    torch_dist = ctx.paths.torch_dist_dir
    if not done(torch_dist):
        log(f"note: no converted checkpoint at {torch_dist} (sentinel missing): training starts from the "
            f"reference initialisation")
    data = SFTData(str(ctx.paths.sft_data), tokenizer_dirs(cfg), tc.seq_len, cfg["PRESET_SEED"] + DATA_SEED_OFFSET)
    job = SFTJob(str(ctx.run_dir), tc, data, cfg["HW_DIST_BACKEND"])
    from dsv4.megatron.launch import launch
    world = world_size(cfg)
    log(f"train: {tc.model.n_layers}-layer {cfg['PRESET_MODEL']} model, world {world}, "
        f"{tc.num_steps} steps of {tc.global_batch_size} x {tc.seq_len} tokens on {tc.device}")
    code = launch(worker, world, job, tc.device, int(cfg.get("V4_DIST_PORT") or 0), log,
                  local=ranks_local(cfg))
    if code == 0:
        mark_done(step_dir, inputs, steps=tc.num_steps)
    return code


if __name__ == "__main__":
    sys.exit(main())
