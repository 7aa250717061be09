"""GRPO on megatron-core: rollout -> reward -> group advantages -> PPO-clip step -> weight sync, every step.

The trainer is `dsv4.megatron.train.Trainer` (its stage, DDP, optimizer, scheduler, checkpoints and non-finite
monitor) with the SFT loss swapped for the policy loss (`RLTrainer`); the rollout engine is anything that speaks
`dsv4.rl.api.RolloutEngine`, normally the embedded engine in this process. One step:
1. the task's prompts for this step (a pure function of seed and step, so a resumed run sees the same ones),
   `group_size` samples each with sampling seeds derived from (seed, step, index);
2. rewards, group-normalised advantages (`grpo.group_advantages`);
3. `minibatches` optimizer steps, each on its share of the samples: the trainer scores each response under the
   rollout's temperature and allowed tokens, with routing replay (`replay.py`), and takes the PPO-clip loss
   against the policy before the first update (recorded by a forward-only pass; with one update per rollout it
   is the current policy, ratio 1). The trainer/rollout mismatch is reported by `logprob_mismatch`;
4. weight sync: pause -> flush -> begin -> buckets -> end -> continue, `weight_version` = the step, and a read
   back of the engine's weights against the trainer's (`weights_synced`).

Any megatron layout (TP, PP, EP, DP): every rank trains its data-parallel share of the step's samples; rank 0
holds the engine (in its process, or a client of a server elsewhere), rolls out, scores, hands the batch to every
rank, and, after the step, gathers the weights' slices from all ranks (`full_weights`) and syncs them.
"""
from __future__ import annotations

import contextlib
import math
import os
import signal
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from dsv4 import quant
from dsv4.megatron.train import (CheckpointReadError, Outputs, Trainer, TrainConfig, _restore, _stop_nonfinite, peak_memory_gb,
                                 split_micro_batches)
from dsv4.rl import grpo, sync
from dsv4.rl.api import GenerateRequest, SamplingParams
from dsv4.rl.replay import routes_tensor


@dataclass
class RLConfig:
    prompts_per_step: int = 16
    group_size: int = 8
    max_new_tokens: int = 1
    temperature: float = 1.0
    clip_low: float = 0.2
    clip_high: float = 0.28
    kl_coef: float = 0.0
    tis_cap: float = 0.0
    std_normalize: bool = True
    sync_path: str = "inproc"          # inproc | broadcast | disk
    sync_format: str = "full"          # full | fp8
    bucket_mb: int = 1024
    replay: bool = True
    minibatches: int = 1               # optimizer updates per rollout, each on its share of the samples
    dead_steps: int = 5
    seed: int = 0
    allowed_token_ids: list[int] | None = None
    stop_token_ids: list[int] | None = None
    scratch: Path | None = None        # where the disk sync writes its checkpoint (a path the engine can read)
    sync_address: str = "127.0.0.1"    # the trainer's address the engine joins for a broadcast sync


# ================================================================================================ the trainer
class RLTrainer(Trainer):
    """Trainer whose micro-batches carry RL fields and whose loss is GRPO's. A micro-batch:
    tokens [b, S+1], loss_mask [b, S] (response tokens, in label positions), adv [b], rollout_logp [b, S],
    optional ref_logp [b, S], routes [b, S, L, k] + replay_mask [b, S]."""

    def __init__(self, tc: TrainConfig, rl: RLConfig, init=None):
        super().__init__(tc, init)
        self.rl = rl
        self.allowed = None
        if rl.allowed_token_ids:
            self.allowed = torch.zeros(tc.model.vocab_size, dtype=torch.bool)
            self.allowed[rl.allowed_token_ids] = True
        self._stats: list[dict] = []
        self._agree = self.last_agree = torch.zeros(2)
        self._recording = False

    def _gates(self):
        return {int(i): layer.ffn.gate for i, layer in self.stage.layers.items()}

    def _set_replay(self, mb: dict) -> None:
        from dsv4.megatron.parallel import sp_slice
        routes = mb.get("routes")
        for i, gate in self._gates().items():
            if routes is None or gate.hash:
                gate.replay = None
                continue
            r, m = routes[:, :, i], mb["replay_mask"]
            if self.ranks.tp > 1 and self.ranks.etp == 1:   # each TP rank routes its own sequence slice
                r, m = sp_slice(r), sp_slice(m)
            dev = self.tc.device
            gate.replay = (r.reshape(-1, r.shape[-1]).to(dev), m.reshape(-1).to(dev))

    def clear_replay(self) -> None:
        for gate in self._gates().values():
            gate.replay, gate.replay_agree = None, None

    def _forward_step(self, data_iterator, model):
        mb = next(data_iterator)
        dev, rl = self.tc.device, self.rl
        tokens, mask = mb["tokens"].to(dev), mb["loss_mask"].to(dev)
        ids, labels = tokens[:, :-1], tokens[:, 1:]
        self._set_replay(mb)
        logp = model(ids, labels, mask.float(), score={"temperature": rl.temperature, "allowed": self.allowed})
        for gate in self._gates().values():
            if gate.replay_agree is not None:
                self._agree += gate.replay_agree.detach().cpu()
        adv, rollout = mb["adv"].to(dev), mb["rollout_logp"].to(dev)
        ref = mb.get("ref_logp")

        def loss_func(logp):
            if self._recording:            # the policy before this rollout's updates: the PPO ratio's base
                mb["old_logp"] = logp.detach()
                zero = torch.zeros(2, device=logp.device)
                return logp.sum() * 0, torch.tensor(1, dtype=torch.int, device=logp.device), {"lm": zero, "mtp": zero}
            old = mb.get("old_logp")
            loss, st = grpo.policy_loss(
                logp, logp.detach() if old is None else old, adv, mask, rl.clip_low, rl.clip_high,
                rollout_logp=rollout, tis_cap=rl.tis_cap or None,
                ref_logp=None if ref is None else ref.to(dev), kl_coef=rl.kl_coef)
            # the rollout policy as the trainer computes it: before this rollout's first update
            st.update(grpo.logprob_mismatch(logp.detach() if old is None else old, rollout, mask))
            self._stats.append(st)
            n = st["samples"]
            # megatron divides the summed gradients by the summed counts: sum over samples / samples = mean
            count = torch.tensor(n, dtype=torch.int, device=logp.device)
            sums = torch.stack([loss.detach() * n, torch.tensor(float(n), device=logp.device)])
            return loss * n, count, {"lm": sums, "mtp": torch.zeros_like(sums)}
        return logp, loss_func

    def record_old_logp(self, micro: list[dict]) -> None:
        """A forward-only pass over all of this rank's micro-batches that stores each one's response logprobs
        (`old_logp`), before the first of several updates on the same rollout."""
        self._recording = True
        try:
            self.eval_loss(micro)
        finally:
            self._recording = False
            self.clear_replay()

    def rl_step(self, micro: list[dict]):
        """One optimizer step -> (StepResult, this rank's loss statistics per micro-batch, route agreement of this
        rank's layers or None); `last_agree` keeps the agreement's counts [agreeing rows, replayed rows]."""
        self._stats, self._agree = [], torch.zeros(2)
        try:
            res = self.step(micro)
        finally:
            self.clear_replay()
        self.last_agree = self._agree
        return res, self._stats, (float(self._agree[0] / self._agree[1]) if self._agree[1] > 0 else None)


# ================================================================================================ data
def build_batch(samples, results, advantages: torch.Tensor, seq_len: int, cfg, replay: bool) -> dict:
    """Rollout results -> one global batch of training rows (see RLTrainer), padded to seq_len + 1 tokens."""
    N = len(results)
    tokens = torch.zeros(N, seq_len + 1, dtype=torch.long)
    mask = torch.zeros(N, seq_len, dtype=torch.bool)
    rollout = torch.zeros(N, seq_len)
    for b, (s, res) in enumerate(zip(samples, results)):
        seq = s.prompt_ids + res.output_ids
        if len(seq) > seq_len + 1:
            raise ValueError(f"sample {b}: {len(seq)} tokens exceed the training sequence ({seq_len + 1})")
        tokens[b, :len(seq)] = torch.tensor(seq)
        p, n = len(s.prompt_ids), len(res.output_ids)
        mask[b, p - 1:p + n - 1] = True             # label position t predicts token t + 1
        rollout[b, p - 1:p + n - 1] = torch.tensor(res.logprobs, dtype=torch.float32)
    batch = {"tokens": tokens, "loss_mask": mask, "adv": advantages.float(), "rollout_logp": rollout}
    if replay:
        batch["routes"], batch["replay_mask"] = routes_tensor(
            [(len(s.prompt_ids) + len(r.output_ids), 0, r.routed_experts) for s, r in zip(samples, results)],
            seq_len, cfg.n_layers, cfg.n_activated_experts)
    return batch


def sampling_seed(seed: int, step: int, index: int) -> int:
    return (seed * 1_000_003 + step * 65_537 + index) & 0x7FFFFFFF


# ================================================================================================ weight sync
def _atomic_key(name: str) -> str:
    """Tensors a receiver fuses (SGLang packs wq_a+wkv, and each compressor's wkv+wgate) or reads together (a
    weight and its scale) share a key, so a bucket never splits them."""
    base = name.removesuffix(".weight").removesuffix(".scale")
    for fused, group in ((".attn.wq_a", ".attn.qkv"), (".attn.wkv", ".attn.qkv"),
                         (".compressor.wkv", ".compressor"), (".compressor.wgate", ".compressor")):
        if base.endswith(fused):
            return base[:-len(fused)] + group
    return base


def full_weights(trainer) -> dict[str, torch.Tensor] | None:
    """The trainer's weights as whole official-named tensors, on rank 0 (None elsewhere). At world 1 they are the
    parameters themselves; otherwise every rank sends the slices it holds (TP shards, its experts, its pipeline
    stage's layers) and rank 0 assembles them (replicated slices arrive more than once, equal)."""
    params = [(key, p) for key, p, copy in trainer.stage.checkpoint_params() if not copy]
    if trainer.ranks.world == 1:
        return {key: p.detach() for key, p in params}
    from dsv4.megatron.parallel import shard_index
    shapes = trainer.tc.model.param_shapes()
    pieces = [(key, shard_index(p, shapes[key], trainer.ranks), p.detach().cpu()) for key, p in params]
    lead = trainer.ranks.rank == 0
    everyone = [None] * trainer.ranks.world if lead else None
    dist.gather_object(pieces, everyone, dst=0)
    if not lead:
        return None
    full: dict[str, torch.Tensor] = {}
    for rank_pieces in everyone:
        for key, index, t in rank_pieces:
            if key not in full:
                full[key] = torch.empty(shapes[key], dtype=t.dtype)
            full[key][index] = t
    missing = set(shapes) - set(full)
    if missing:
        raise RuntimeError(f"no rank holds {sorted(missing)[:5]}: the gathered weights are incomplete")
    dev = torch.device(trainer.tc.device)
    return {k: v.to(dev) for k, v in full.items()}


def sync_tensors(weights: dict[str, torch.Tensor], cfg, fmt: str) -> list[tuple[str, torch.Tensor]]:
    """The weights to send: as stored, or FP8 e4m3 blocks + power-of-two scales for the weights the release
    stores in FP8 or FP4 (the rollout runs FP8 experts, as SGLang with SGLANG_DSV4_FP4_EXPERTS=0)."""
    out = []
    for name, t in weights.items():
        if fmt == "fp8" and t.dim() == 2 and cfg.storage_format(name) in ("fp8", "fp4"):
            q, s = quant.weight_quant_fp8(t, 128, ue8m0=True)
            out += [(name, q), (name[:-len("weight")] + "scale", s)]
        else:
            out.append((name, t))
    return out


def buckets(named: list[tuple[str, torch.Tensor]], limit_bytes: int) -> list[list[tuple[str, torch.Tensor]]]:
    groups: dict[str, list] = {}
    for n, t in named:
        groups.setdefault(_atomic_key(n), []).append((n, t))
    out, cur, size = [], [], 0
    for g in groups.values():
        nbytes = sum(t.numel() * t.element_size() for _, t in g)
        if cur and size + nbytes > limit_bytes:
            out.append(cur)
            cur, size = [], 0
        cur += g
        size += nbytes
    return out + ([cur] if cur else [])


@dataclass
class SyncReport:
    seconds: float
    bytes: int
    max_err: float          # max |engine - trainer| over the weights read back
    bound_ok: bool          # every read-back value within the format's bound
    version: str


def _is_sglang(engine) -> bool:
    return hasattr(engine, "is_ours") and not engine.is_ours()


def push_weights(engine, weights: dict[str, torch.Tensor], cfg, rl: RLConfig, version: str) -> SyncReport:
    """Send `weights` (whole, official names) to the engine, bracketed as SGLang wants, then read them back. Every
    engine gets the official names, an FP8 weight's scale as `.scale`: SGLang's `DeepseekV4ForCausalLM.load_weights`
    (python/sglang/srt/models/deepseek_v4.py) takes the Hub checkpoint's names and renames them itself, and its FP8
    `wo_a` pre-pass finds a scale only as `.wo_a.scale`; `buckets` keeps a weight with its scale under these
    names."""
    named = sync_tensors(weights, cfg, rl.sync_format)
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    t0 = time.perf_counter()
    engine.pause_generation(mode="retract")
    engine.flush_cache()
    engine.begin_weight_update()
    try:
        parts = buckets(named, rl.bucket_mb << 20)
        if rl.sync_path == "inproc":
            for b in parts:
                _ok(engine.update_weights_from_tensor(b, weight_version=version))
        elif rl.sync_path == "broadcast":
            _broadcast(engine, parts, version, rl.sync_address)
        elif rl.sync_path == "disk":
            _ok(engine.update_weights_from_disk(str(_write_disk(named, cfg, rl.scratch)), weight_version=version))
        else:
            raise ValueError(f"sync path {rl.sync_path!r}: inproc, broadcast or disk")
    finally:
        engine.end_weight_update()
        engine.continue_generation()
    seconds = time.perf_counter() - t0
    err, ok = _read_back(engine, weights, rl.sync_format)
    return SyncReport(seconds, nbytes, err, ok, version)


def _ok(res: dict) -> None:
    if not res.get("success"):
        raise RuntimeError(f"weight update refused by the rollout engine: {res.get('message')}")


def _broadcast(engine, parts, version: str, address: str) -> None:
    """Rank 0 of a fresh group is this trainer; the engine's ranks follow from 1 (its call runs in a thread
    because joining blocks until every member is there, as SGLang's does)."""
    from dsv4.rl.engine import EmbeddedEngine
    # NCCL between this process and an engine in another one (on its own GPUs); an engine in this process
    # shares the trainer's GPU, which one NCCL group cannot hold twice, so its bytes go through gloo
    on_gpu = bool(parts) and parts[0][0][1].is_cuda
    backend = "nccl" if on_gpu and not isinstance(engine, EmbeddedEngine) else "gloo"
    answers: list[dict] = []

    def call(fn, *a, **kw):
        th = threading.Thread(target=lambda: answers.append(fn(*a, **kw)))
        th.start()
        return th

    world = 1 + getattr(engine, "n_ranks", 1)          # the trainer, then every GPU of every server
    listener = sync.listen_socket(address, 0, world)
    port = listener.getsockname()[1]
    th = call(engine.init_weights_update_group, address, port, 1, world, group_name="v4-sync", backend=backend)
    group = sync.weight_group(address, port, 0, world, backend, "v4-sync", listener=listener)
    th.join()
    _ok(answers.pop())
    try:
        for b in parts:
            names = [n for n, _ in b]
            th = call(engine.update_weights_from_distributed, names, [sync.dtype_name(t.dtype) for _, t in b],
                      [list(t.shape) for _, t in b], group_name="v4-sync", weight_version=version)
            for _, t in b:
                sync.broadcast(group, t.contiguous() if backend == "nccl" else t.cpu().contiguous())
            th.join()
            _ok(answers.pop())
    finally:
        engine.destroy_weights_update_group("v4-sync")


def _write_disk(named, cfg, scratch: Path | None) -> Path:
    """A checkpoint directory the engine's update_weights_from_disk reads: official names, config.json."""
    import json

    from safetensors.torch import save_file
    d = Path(scratch or "/tmp") / "rl_sync"
    d.mkdir(parents=True, exist_ok=True)
    save_file({n: t.detach().cpu().contiguous() for n, t in named}, str(d / "model.safetensors.tmp"))
    (d / "model.safetensors.tmp").replace(d / "model.safetensors")
    (d / "config.json").write_text(json.dumps(cfg.to_hf_config(), indent=1))
    return d


def _read_back(engine, weights: dict[str, torch.Tensor], fmt: str, probe: int = 4096) -> tuple[float, bool | None]:
    """max |engine - trainer| over the first `probe` values of every parameter, and whether each is within the
    format's bound: 0 for full (an exact copy); for FP8 e4m3 blocks with power-of-two scales s, round to nearest
    with a 3-bit mantissa, |w - q| <= 2^-4 |w|, plus 2^-10 s for values in e4m3's subnormal range (spacing 2^-9 s),
    with s bounded by the tensor's largest block scale, pow2ceil(max |w| / 448). None: the engine cannot be read
    by these names (SGLang names its parameters after its own fused layers)."""
    if not hasattr(engine, "get_weights_by_name") or _is_sglang(engine):
        return float("nan"), None
    worst, ok = 0.0, True
    for name, p in weights.items():
        got = torch.tensor(engine.get_weights_by_name(name, truncate_size=probe))
        want = p.detach().flatten()[:probe].float().cpu()
        err = (got - want).abs()
        worst = _nanmax([worst, float(err.max()) if err.numel() else 0.0])
        if fmt == "full" or err.max() == 0:
            ok &= bool(err.max() == 0) if err.numel() else True
        else:
            s_max = float(quant.pow2_ceil(p.detach().abs().max().float().cpu() / 448.0))
            ok &= bool((err <= 2.0 ** -4 * want.abs() + 2.0 ** -10 * s_max).all())
    return worst, ok


# ================================================================================================ the loop
def run_grpo(tc: TrainConfig, rl: RLConfig, task, reward_fn: Callable, engine, out: Outputs,
             on_metrics: Callable[[dict], None] = lambda row: None, log: Callable[[str], None] = print,
             restarter=None) -> int:
    """tc.num_steps // rl.minibatches GRPO steps (resuming from out.checkpoints). Returns 0, 1 (no learning
    signal) or 16.
    Every rank calls it; rank 0 holds the engine (None elsewhere), rolls out, scores, syncs and writes metrics,
    and hands each step's batch to all ranks, each of which trains on its data-parallel share.
    With FP8 sync the trainer's forward goes through the same FP8 quantisation (ModelConfig.qat_rollout_fp8): the
    policy it scores and updates is the one the engine samples with, as miles trains FP8 rollouts. The engine,
    whose weights all arrive through the sync, needs no such point.
    restarter (rank 0, `dsv4.rl.restart.Restarter`): an engine lost during a rollout or a sync is restarted, gets
    the weights last synced, and the step's rollout (all of its samples, same prompts and seeds) or its sync runs
    again; the row counts `rollout_restarts` and `rollout_regenerated_samples`. Without one a lost engine fails
    the job."""
    if rl.sync_format == "fp8":
        tc = replace(tc, model=tc.model.with_overrides(qat_rollout_fp8=True))
    trainer = RLTrainer(tc, rl, init=None)
    ranks = trainer.ranks
    lead = ranks.rank == 0
    say = log if lead else (lambda msg: None)
    try:
        start = _restore(trainer, out, say) // rl.minibatches     # checkpoints count optimizer updates
    except CheckpointReadError as e:
        say(f"error: {e}")
        return 1
    cfg = tc.model
    weights = full_weights(trainer)
    ref_model = _reference_policy(trainer, weights, out, start) if rl.kl_coef > 0 and lead else None
    synced = [weights, str(start)]          # what the engine holds: pushed again to a restarted engine
    lost = {"restarts": 0, "samples": 0}    # this step's

    def on_engine(phase: str, step: int, call: Callable):
        """call(engine), again on a restarted engine while the engine is lost (rank 0)."""
        nonlocal engine
        from dsv4.rl.restart import EngineGone, engine_lost
        while True:
            try:
                return call(engine)
            except Exception as e:  # noqa: BLE001 - engine_lost decides; anything else is raised as it was
                if not engine_lost(e, engine):
                    raise
                if restarter is None:
                    raise EngineGone(f"step {step}: the rollout engine was lost during {phase} ({type(e).__name__}: "
                                     f"{e}); this job restarts no engine") from e
                again = rl.prompts_per_step * rl.group_size if phase == "rollout" else 0
                engine = restarter.restart(e, step, phase, lambda eng: push_weights(eng, synced[0], cfg, rl, synced[1]),
                                           samples=again)
                lost["restarts"] += 1
                lost["samples"] += again

    if lead:
        rep = on_engine("sync", start, lambda eng: push_weights(eng, weights, cfg, rl, str(start)))
        say(f"weights synced to the rollout engine (version {start}, {rep.bytes / 1e6:.1f} MB, {rep.seconds:.2f} s, "
            f"{rl.sync_path}/{rl.sync_format})")
    n = rl.prompts_per_step * rl.group_size
    M = rl.minibatches
    steps = tc.num_steps // M               # tc counts optimizer updates, M to a step
    dead, seen = 0, (math.inf, -math.inf)
    kill_at = int(os.environ.get("V4_KILL_AT_STEP", "0") or 0)     # test hook, as in the SFT loop
    for step in range(start + 1, steps + 1):
        clock = StepClock()
        lost.update(restarts=0, samples=0)
        if step == kill_at and lead:
            say(f"V4_KILL_AT_STEP={kill_at}: killing the job at the start of step {step}")
            os.kill(os.getpid(), signal.SIGKILL)
        with clock.part("rollout"):
            roll = on_engine("rollout", step, lambda eng: _rollout(eng, task, reward_fn, rl, step, tc, cfg, ref_model,
                                                                   trainer.allowed)) if lead else None
        if lead:                               # the reference policy's scoring, timed inside _rollout
            clock.move("rollout", "logprob", roll["ref_s"])
        batch = _share(roll["batch"] if lead else None, ranks)
        per = n // ranks.dp
        mine = {k: v[ranks.dp_rank * per:(ranks.dp_rank + 1) * per] for k, v in batch.items()}
        micro = split_micro_batches(mine, tc.micro_batch_size)
        if M > 1:
            with clock.part("logprob"):
                trainer.record_old_logp(micro)
        k = len(micro) // M
        results, stats, counts = [], [], torch.zeros(2)
        for j in range(M):
            with clock.part("train"):
                res, part, _ = trainer.rl_step(micro[j * k:(j + 1) * k])
            if not res.finite:
                return _stop_nonfinite(trainer, res, out, say)
            results.append(res)
            stats += part
            counts += trainer.last_agree
        trainer.last_agree = counts
        res = _mean_result(results)
        stats, agree = _gather_stats(stats, trainer, ranks)
        with clock.part("sync"):
            weights = full_weights(trainer)
            rep = on_engine("sync", step, lambda eng: push_weights(eng, weights, cfg, rl, str(step))) if lead else None
            synced[:] = [weights, str(step)]
        stop = None
        if lead:
            rewards, live_groups = roll["rewards"], roll["live_groups"]
            step_s = clock.elapsed()
            row = _metrics_row(step, res, stats, rewards, live_groups, roll["results"], roll["rollout_s"], rep,
                               agree, n, tc, step_s)
            row.update(clock.row(step_s))
            row.update(rollout_restarts=lost["restarts"], rollout_regenerated_samples=lost["samples"])
            on_metrics(row)
            say(f"step {step}/{steps} reward {row['reward_mean']:.3f} (live groups {live_groups:.2f}) "
                f"loss {res.loss:.4f} |dlogp| max {row['logprob_diff_max']:.2e} route agree "
                f"{'-' if agree is None else f'{agree:.3f}'} {row['step_time_s']:.2f} s: {clock.line()}")
            seen = (min(seen[0], float(rewards.min())), max(seen[1], float(rewards.max())))
            # no group with differing rewards: solved when every sample earns the best reward the run has seen
            # (and it has seen worse), stuck otherwise (collapsed, or no signal from the start)
            solved = bool((rewards == seen[1]).all()) and seen[0] < seen[1]
            dead = dead + 1 if live_groups == 0 and not solved else 0
            if live_groups == 0 and solved:
                say(f"step {step}: every sample earned the best reward ({seen[1]:g}): nothing left to learn from")
            if dead == 1:
                say(f"warning: step {step}: every group's rewards are equal, so there is no advantage to learn "
                    f"from. Raise PRESET_RL_TEMPERATURE or PRESET_RL_GROUP_SIZE, or use a task whose reward varies "
                    f"at the start (docs/rl.md); the run stops after {rl.dead_steps} such steps in a row")
            if dead >= rl.dead_steps:
                stop = f"error: {dead} steps in a row without a group whose rewards differ: stopping (exit 1)"
        if step % tc.save_interval == 0 or step == steps:
            path = trainer.save(out.checkpoints)
            say(f"saved {path}")
        stop = _share(stop, ranks)            # every rank stops together
        if stop:
            say(stop)
            return 1
    return 0


STEP_PARTS = ("rollout", "logprob", "train", "sync", "wait")


class StepClock:
    """One RL step's wall time by part, on rank 0: rollout (generation, rewards, advantages, the batch), logprob
    (scoring the responses apart from training: the reference policy's for the KL term, the policy's before several
    updates), train (the optimizer updates, their forward and backward included), sync (gathering the weights and
    pushing them to the engine, read-back check included) and wait (the rest: handing the batch to the ranks,
    waiting for them at the gathers, the metrics). The parts add up to the step's time (`time_*_s` in its row)."""

    def __init__(self):
        self.t0 = time.perf_counter()
        self.s = dict.fromkeys(STEP_PARTS, 0.0)
        self.last: dict = {}

    @contextlib.contextmanager
    def part(self, name: str):
        t = time.perf_counter()
        try:
            yield
        finally:
            self.s[name] += time.perf_counter() - t

    def move(self, src: str, dst: str, seconds: float) -> None:
        """Count `seconds` timed inside part `src` under `dst` instead."""
        self.s[src] -= seconds
        self.s[dst] += seconds

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def row(self, total: float) -> dict:
        """The parts as a metrics row's `time_<part>_s` keys, `total` (the step's time) split among them."""
        out = {f"time_{p}_s": self.s[p] for p in STEP_PARTS[:-1]}
        out["time_wait_s"] = max(total - sum(out.values()), 0.0)
        self.last = out
        return out

    def line(self) -> str:
        return ", ".join(f"{k[5:-2]} {v:.2f}" for k, v in self.last.items()) + " s"


def _mean_result(results: list):
    """One step's figures from its updates: mean loss and gradient norm, the last learning rate, the total time."""
    if len(results) == 1:
        return results[0]
    last = results[-1]
    return replace(last, loss=sum(r.loss for r in results) / len(results),
                   grad_norm=sum(r.grad_norm for r in results) / len(results),
                   loss_tokens=sum(r.loss_tokens for r in results), step_time_s=sum(r.step_time_s for r in results))


def _rollout(engine, task, reward_fn, rl: RLConfig, step: int, tc, cfg, ref_model, allowed) -> dict:
    """Rank 0's part of a step: prompts, rollouts on the last synced weights, rewards, advantages, the batch."""
    from dsv4.rl.tasks import score
    prompts = task.prompts(step, rl.prompts_per_step, rl.seed)
    samples = [s for s in prompts for _ in range(rl.group_size)]
    reqs = [GenerateRequest(s.prompt_ids, SamplingParams(
                max_new_tokens=rl.max_new_tokens, temperature=rl.temperature,
                allowed_token_ids=rl.allowed_token_ids, stop_token_ids=rl.stop_token_ids,
                sampling_seed=sampling_seed(rl.seed, step, i)),
                return_logprob=True, return_routed_experts=rl.replay) for i, s in enumerate(samples)]
    t = time.perf_counter()
    results = engine.generate(reqs)
    rollout_s = time.perf_counter() - t
    ref_s = 0.0
    stale = {r.meta_info.get("weight_version") for r in results} - {str(step - 1)}
    if stale:
        raise RuntimeError(f"step {step}: rollouts came from weight version(s) {sorted(stale)}, expected "
                           f"{step - 1}: the engine did not take the last sync")
    rewards = torch.tensor(score(reward_fn, samples, [r.output_ids for r in results]))
    adv, live = grpo.group_advantages(rewards, rl.group_size, rl.std_normalize)
    batch = build_batch(samples, results, adv, tc.seq_len, cfg, rl.replay)
    if ref_model is not None:
        t = time.perf_counter()
        batch["ref_logp"] = _ref_logp(ref_model, batch, rl, allowed)
        ref_s = time.perf_counter() - t
    return {"batch": batch, "results": results, "rewards": rewards, "rollout_s": rollout_s, "ref_s": ref_s,
            "live_groups": float(live.view(-1, rl.group_size)[:, 0].float().mean())}


def _share(obj, ranks):
    """Rank 0's object on every rank (nothing to send at world 1)."""
    if ranks.world == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _gather_stats(stats: list[dict], trainer: RLTrainer, ranks) -> tuple[list[dict], float | None]:
    """The loss statistics (on the last pipeline stage's ranks, one list per data-parallel share) and the route
    agreement (counted on every rank for its own layers) of all ranks, on rank 0."""
    agree = trainer.last_agree
    if ranks.world == 1:
        return stats, (float(agree[0] / agree[1]) if agree[1] > 0 else None)
    counts = agree.clone().to(trainer._comm_device())
    dist.all_reduce(counts)
    mine = stats if ranks.last_stage and ranks.tp_rank == 0 else []     # TP ranks hold the same numbers
    everyone = [None] * ranks.world if ranks.rank == 0 else None
    dist.gather_object(mine, everyone, dst=0)
    merged = [st for part in everyone for st in part] if ranks.rank == 0 else []
    counts = counts.cpu()
    return merged, (float(counts[0] / counts[1]) if counts[1] > 0 else None)


def _nanmax(values: list[float]) -> float:
    """max that a NaN wins (Python's max keeps whichever comes first, so a NaN could pass a gate unseen)."""
    return float(torch.tensor(values, dtype=torch.float64).max()) if values else float("nan")


def _metrics_row(step, res, stats, rewards, live_groups, results, rollout_s, rep, agree, n, tc, step_s) -> dict:
    def tok_mean(key):
        toks = sum(s["tokens"] for s in stats)
        return sum(s[key] * s["tokens"] for s in stats) / toks if toks else float("nan")
    out_tokens = sum(len(r.output_ids) for r in results)
    all_tokens = sum(r.meta_info["prompt_tokens"] + len(r.output_ids) for r in results)
    row = {"step": step, "loss": res.loss, "grad_norm": res.grad_norm, "lr": res.lr,
           "reward_mean": float(rewards.mean()), "reward_std": float(rewards.std()) if len(rewards) > 1 else 0.0,
           "live_groups": live_groups, "response_len": out_tokens / len(results),
           "logprob_diff_mean": tok_mean("train_rollout_logprob_abs_diff"),
           "logprob_diff_max": _nanmax([s["train_rollout_logprob_abs_diff_max"] for s in stats]),
           "rollout_kl": tok_mean("train_rollout_kl"), "pg_clipfrac": tok_mean("pg_clipfrac"),
           "pg_clipfrac_lower": tok_mean("pg_clipfrac_lower"), "ppo_kl": tok_mean("ppo_kl"), "route_agree": agree,
           "rollout_s": rollout_s, "rollout_tokens_per_s": all_tokens / rollout_s,
           "sync_s": rep.seconds, "sync_gb_s": rep.bytes / rep.seconds / 1e9, "sync_max_err": rep.max_err,
           "weights_synced": rep.bound_ok, "weight_version": rep.version, "samples": n,
           "tokens": all_tokens, "step_time_s": step_s, "tokens_per_s": all_tokens / step_s,
           "peak_mem_gb": peak_memory_gb(tc.device)}
    if any("kl" in s for s in stats):
        row["kl"] = tok_mean("kl")
    if any("tis_mean" in s for s in stats):
        row["tis_mean"] = tok_mean("tis_mean")
    return row


def _reference_policy(trainer: RLTrainer, weights: dict[str, torch.Tensor], out: Outputs, start: int):
    """The frozen policy the KL term pulls toward: the weights this RL run started from, kept in the run's
    checkpoint directory so that a resumed run uses the same reference. Rank 0 only."""
    from dsv4.model import Transformer
    path = Path(out.checkpoints) / "reference_policy.pt"
    model = Transformer(trainer.tc.model, init=False).to(trainer.tc.device).eval()
    if start == 0 or not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({n: t.detach().cpu() for n, t in weights.items()}, path)
    model.load_state_dict(torch.load(path, weights_only=True), strict=False)
    for p in model.parameters():
        p.requires_grad_(False)
    return model


@torch.no_grad()
def _ref_logp(model, batch: dict, rl: RLConfig, allowed) -> torch.Tensor:
    from dsv4.rl.replay import replayed_routes
    dev = next(model.parameters()).device
    tokens = batch["tokens"].to(dev)
    ids, labels = tokens[:, :-1], tokens[:, 1:]
    if "routes" in batch:
        with replayed_routes(model, batch["routes"].to(dev), batch["replay_mask"].to(dev)):
            logits = model(ids).logits
    else:
        logits = model(ids).logits
    logits = logits / rl.temperature
    if allowed is not None:
        logits = logits.masked_fill(~allowed.to(dev), float("-inf"))
    return torch.log_softmax(logits, -1).gather(-1, labels.unsqueeze(-1))[..., 0].cpu()
