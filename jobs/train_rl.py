"""Step `train` when PRESET_MODE=rl: GRPO on megatron-core with the embedded rollout engine (dsv4/rl/loop.py).

    python -m jobs.train_rl --run-dir DIR

Reads the run's resolved config (DIR/config.json): the model and layout as the SFT step does, and the
PRESET_RL_* keys. The trainer starts from the converted checkpoint (the `convert` step), or resumes from the
run's latest checkpoint; the rollout engine (in this process, a `v4 rl serve` process this job starts with
V4_ROLLOUT_ENGINE=server, or the launcher's SGLang servers) gets the trainer's weights before the first rollout and
after every step. An engine of this job's that dies is started again with the current weights, within what is left
of the run's PRESET_MAX_RESTARTS (V4_RESTARTS_SPENT: the restarts the run recorded before this job; dsv4/rl/restart.py).
Writes:
  DIR/metrics.jsonl                    one row per step: reward, mismatch, route agreement, sync, loss, ..., and
                                       the step's time by part (time_rollout_s, _logprob_, _train_, _sync_, _wait_)
  DIR/checkpoints/iter_NNNNNNN/        megatron distributed checkpoints
  DIR/steps/train/nonfinite.json       step, rank and first module of a non-finite loss/gradient
  DIR/steps/train/rollout_restarts.jsonl   one line per rollout engine lost and restarted: step, phase, cause, seconds,
                                       samples rolled out again, the job attempt (`v4 runs show` reads them)
  DIR/steps/train/rollout_server.{json,log}  V4_ROLLOUT_ENGINE=server: the `v4 rl serve` process (pid, url, starts) and
                                       its output
Exit codes: 0 done, 1 failed (also: no learning signal for PRESET_RL_DEAD_STEPS steps), 2 bad configuration,
16 non-finite loss or gradient.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

from jobs.common import RunContext, done, fingerprint, log, mark_done, ranks_local, with_compile_cache
from jobs.train_sft import layout_from, model_config, watched, world_size


def rl_config(cfg: dict, task, scratch: Path):
    from dsv4.rl.loop import RLConfig
    return RLConfig(
        prompts_per_step=cfg["PRESET_RL_PROMPTS_PER_STEP"], group_size=cfg["PRESET_RL_GROUP_SIZE"],
        max_new_tokens=cfg["PRESET_RL_MAX_NEW_TOKENS"] or task.max_new_tokens,
        temperature=cfg["PRESET_RL_TEMPERATURE"], clip_low=cfg["PRESET_RL_CLIP_LOW"],
        clip_high=cfg["PRESET_RL_CLIP_HIGH"], kl_coef=cfg["PRESET_RL_KL_COEF"], tis_cap=cfg["PRESET_RL_TIS_CAP"],
        std_normalize=bool(cfg["PRESET_RL_STD_NORMALIZE"]), sync_path=sync_path(cfg),
        sync_format=cfg["PRESET_RL_SYNC_FORMAT"], bucket_mb=cfg["PRESET_RL_SYNC_BUCKET_MB"],
        replay=bool(cfg["PRESET_RL_REPLAY"]), minibatches=max(1, cfg["PRESET_RL_MINIBATCHES"]),
        dead_steps=cfg["PRESET_RL_DEAD_STEPS"], seed=cfg["PRESET_SEED"],
        allowed_token_ids=task.allowed_token_ids, stop_token_ids=task.stop_token_ids, scratch=scratch,
        # rank 0 trains on the head: servers elsewhere join the weight-sync group there
        sync_address=cfg["V4_MASTER_IP"] if cfg.get("V4_ROLLOUT_ENGINE") == "sglang" else "127.0.0.1")


def sync_path(cfg: dict) -> str:
    if cfg["PRESET_RL_SYNC"] == "inproc" and cfg.get("V4_ROLLOUT_ENGINE", "embedded") != "embedded":
        raise ValueError(f"PRESET_RL_SYNC=inproc, but V4_ROLLOUT_ENGINE={cfg['V4_ROLLOUT_ENGINE']} serves from its own "
                         f"process: use broadcast or disk (or auto)")
    if cfg["PRESET_RL_SYNC"] != "auto":
        return cfg["PRESET_RL_SYNC"]
    return "inproc" if cfg.get("V4_ROLLOUT_ENGINE", "embedded") == "embedded" else "broadcast"


def train_config(cfg: dict, rl, prompt_len: int):
    """The SFT step's TrainConfig with the RL batch: a step's samples over PRESET_RL_MINIBATCHES optimizer updates
    (num_steps counts updates), sequences padded to the longest prompt plus the response limit."""
    from dsv4.megatron.model import Objective
    from dsv4.megatron.train import TrainConfig
    m = model_config(cfg)
    n = rl.prompts_per_step * rl.group_size // rl.minibatches       # the samples of one optimizer update
    seq_len = prompt_len + rl.max_new_tokens - 1
    if seq_len > cfg["PRESET_SEQ_LEN"]:
        raise ValueError(f"the task's prompts ({prompt_len} tokens) plus {rl.max_new_tokens} new tokens need "
                         f"PRESET_SEQ_LEN >= {seq_len}, the run has {cfg['PRESET_SEQ_LEN']}")
    mbs = min(cfg["PRESET_MICRO_BATCH_SIZE"], n // max(1, int(cfg.get("DP") or 1)))   # a DP share holds n / DP
    return TrainConfig(
        model=m, layout=layout_from(cfg), objective=Objective(),
        seq_len=seq_len, micro_batch_size=mbs, global_batch_size=n,
        num_steps=cfg["PRESET_NUM_STEPS"] * rl.minibatches, lr=cfg["PRESET_LR"], min_lr=cfg["PRESET_MIN_LR"],
        lr_decay_style=cfg["PRESET_LR_DECAY_STYLE"], lr_warmup_iters=cfg["PRESET_LR_WARMUP_ITERS"],
        weight_decay=cfg["PRESET_WEIGHT_DECAY"], seed=cfg["PRESET_SEED"],
        save_interval=max(1, cfg["PRESET_SAVE_INTERVAL"]), save_retain_interval=cfg.get("PRESET_SAVE_RETAIN_INTERVAL", 0),
        recompute="full" if cfg.get("HW_RECOMPUTE_GRANULARITY") == "full" else "none", device=cfg["HW_DEVICE"])


def rollout_engine(cfg: dict, tc, rl, ctx=None):
    """-> (engine, restarter or None, the server process this job owns or None). The embedded engine in this process; (V4_ROLLOUT_ENGINE=server) the embedded
    engine behind `v4 rl serve`, a process of its own on rank 0's node that this job starts (and starts again when it
    dies, within what is left of the run's PRESET_MAX_RESTARTS: dsv4/rl/restart.py); or (V4_ROLLOUT_ENGINE=sglang)
    the servers the rollout-up step started, one client each behind an EngineGroup. Served weights travel by
    broadcast or disk."""
    from dsv4.rl.restart import Restarter
    budget = int(cfg.get("PRESET_MAX_RESTARTS") or 0)
    # the run's restarts before this job (lost nodes, hangs, engines; across resumes): one budget for the run
    spent, attempt = (int(os.environ.get(k) or 0) for k in ("V4_RESTARTS_SPENT", "V4_STEP_ATTEMPT"))
    record = ctx.step_dir("train") / "rollout_restarts.jsonl" if ctx is not None else None

    def restarter(make):
        return Restarter(make, budget, record, log, spent=spent, attempt=attempt)
    if cfg.get("V4_ROLLOUT_ENGINE") == "server":
        server = rollout_server(cfg, tc, ctx)
        return server.start(), restarter(server.restart), server
    if cfg.get("V4_ROLLOUT_ENGINE", "embedded") == "sglang":
        from dsv4.rl.group import EngineGroup
        from dsv4.rl.http import HTTPEngine
        urls = cfg.get("ROLLOUT_URLS") or []
        shape = (tc.model.n_layers, tc.model.n_activated_experts)
        gpus = int(cfg["V4_ROLLOUT_TP"]) * int(cfg["V4_ROLLOUT_DP"])      # each server's ranks in the sync group
        engine = EngineGroup([HTTPEngine(u, routed_experts_shape=shape) for u in urls], [gpus] * len(urls))
        engine.wait_healthy(float(cfg.get("V4_ROLLOUT_HEALTH_TIMEOUT") or 300))
        return engine, None, None        # the launcher's servers: not restarted from here
    from dsv4.model import Transformer
    from dsv4.rl.engine import EmbeddedEngine

    def build():
        return EmbeddedEngine(Transformer(tc.model, init=False).to(tc.device), max_seq_len=tc.seq_len + 1,
                              model_path="trainer", seed=tc.seed)
    return build(), restarter(build), None


def rollout_server(cfg: dict, tc, ctx):
    """The `v4 rl serve` process of V4_ROLLOUT_ENGINE=server: the run's model (random weights until the first sync)
    on loopback at a port free now, kept for its restarts; its log and pid in RUN/steps/train/rollout_server.*."""
    import os

    from dsv4.megatron.launch import free_port
    from dsv4.rl.restart import ServerProcess
    root = Path(__file__).resolve().parents[1]
    port = free_port()
    overrides = cfg.get("PRESET_MODEL_OVERRIDES") or []
    specs = [s for s in (overrides if isinstance(overrides, list) else [overrides]) if s]
    argv = [sys.executable, "-m", "launcher", "rl", "serve", "--model", cfg["PRESET_MODEL"],
            *[a for s in specs + [f"attn_impl={tc.model.attn_impl}"] for a in ("--model-overrides", s)],
            "--seed", str(tc.seed), "--device", "cuda" if str(tc.device).startswith("cuda") else "cpu", "--host", "127.0.0.1", "--port", str(port)]
    step = ctx.step_dir("train")
    return ServerProcess(argv, f"http://127.0.0.1:{port}", step / "rollout_server.log", step / "rollout_server.json",
                         cwd=str(root), env={**os.environ, "PYTHONPATH": str(root)},
                         health_timeout=float(cfg.get("V4_ROLLOUT_HEALTH_TIMEOUT") or 300))


def make_task(cfg: dict, bf16_dir: Path):
    """The task PRESET_RL_TASK names; the math task tokenizes with the run's checkpoint tokenizer."""
    from dsv4.rl import tasks
    name = cfg["PRESET_RL_TASK"]
    if name == "math" and (bf16_dir / "tokenizer.json").is_file():
        return tasks.make_task(name, tokenizer=str(bf16_dir))
    return tasks.make_task(name)


@dataclass
class RLJob:
    """What every rank needs (picklable: tasks and the engine are rebuilt from the config on each rank)."""
    run_dir: str
    tc: object              # dsv4.megatron.train.TrainConfig
    rl: object              # dsv4.rl.loop.RLConfig
    backend: str


def _task_and_reward(cfg: dict, bf16_dir: Path):
    from dsv4.rl import tasks
    task = make_task(cfg, bf16_dir)
    return task, (tasks.load_reward(cfg["PRESET_RL_REWARD"]) if cfg.get("PRESET_RL_REWARD") else task.reward)


def worker(rank: int, world: int, master_addr: str, master_port: int, job: RLJob) -> int:
    """One rank of the RL job (in process, a local process, or a Ray actor). Rank 0 also holds the rollout engine."""
    from dsv4.megatron.parallel import init_parallel
    from dsv4.megatron.train import Outputs, init_distributed, quiet_libraries
    from dsv4.rl.loop import run_grpo
    quiet_libraries()
    ctx = RunContext.load(job.run_dir)
    on_metrics = with_compile_cache(ctx.write_metrics)      # counted before anything compiles, as the SFT step does
    cfg = ctx.cfg
    tc, pg_timeout_s = watched(job.tc, ctx, rank, world, master_addr)     # the hang watchdog's heartbeat
    init_distributed(rank, world, job.backend, tc.device, master_addr, master_port, timeout_s=pg_timeout_s)
    init_parallel(tc.layout, tc.seed)
    task, reward_fn = _task_and_reward(cfg, ctx.paths.bf16_dir)
    torch_dist = ctx.paths.torch_dist_dir
    out = Outputs(checkpoints=ctx.paths.checkpoints, init_checkpoint=torch_dist if done(torch_dist) else None,
                  nonfinite=ctx.step_dir("train") / "nonfinite.json")
    from dsv4.rl.restart import EngineGone
    engine, restarter, server = rollout_engine(cfg, tc, job.rl, ctx) if rank == 0 else (None, None, None)
    try:
        return run_grpo(tc, job.rl, task, reward_fn, engine, out, on_metrics=on_metrics, log=log,
                        restarter=restarter)
    except EngineGone as e:
        log(f"error: {e}")
        return 1
    finally:
        if server is not None:
            server.stop()


def main(argv=None) -> int:
    ctx = RunContext.from_argv(argv, __doc__)
    cfg = ctx.cfg
    from dsv4.rl import tasks
    try:
        task, _ = _task_and_reward(cfg, ctx.paths.bf16_dir)
        rl = rl_config(cfg, task, ctx.step_dir("train"))
        prompt_len = max(len(s.prompt_ids) for s in task.prompts(1, rl.prompts_per_step, rl.seed))
        tc = train_config(cfg, rl, prompt_len)
        world = world_size(cfg)
        tc.layout.validate(tc.model, world, tc.seq_len)
    except (ValueError, KeyError, tasks.RewardSpecError) as e:
        log(f"error: {e}")
        return 2
    step_dir = ctx.step_dir("train")
    inputs = {"config": fingerprint(ctx.run_dir / "config.json")}
    if done(step_dir, inputs):
        log(f"training already finished ({step_dir}); skipped")
        return 0
    log(f"train (RL): {tc.model.n_layers}-layer {cfg['PRESET_MODEL']} model on {tc.device}, world {world}, task "
        f"{cfg['PRESET_RL_TASK']}, {tc.num_steps} steps of {rl.prompts_per_step} prompts x {rl.group_size} samples, "
        f"sync {rl.sync_path}/{rl.sync_format}, replay {'on' if rl.replay else 'off'}")
    from dsv4.megatron.launch import launch
    code = launch(worker, world, RLJob(str(ctx.run_dir), tc, rl, cfg["HW_DIST_BACKEND"]), tc.device,
                  int(cfg.get("V4_DIST_PORT") or 0), log, local=ranks_local(cfg))
    if code == 0:
        mark_done(step_dir, inputs, steps=tc.num_steps)
    return code


if __name__ == "__main__":
    sys.exit(main())
