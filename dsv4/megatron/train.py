"""SFT training of the DSV4 megatron model: one rank's worker.

A `Trainer` owns this rank's pipeline stage wrapped in megatron-core's DistributedDataParallel, the
megatron optimizer (Adam, optional distributed optimizer) and LR scheduler, and the non-finite
monitor. `Trainer.step(micro_batches)` runs megatron's forward/backward schedule for one optimizer
step. `train(run)` is the job's loop: resume or load weights, steps, metrics rows, checkpoints, the
save -> reload check, and exit code 16 when a loss or gradient is not finite.

Loss normalisation: every micro-batch returns sums over its loss tokens; megatron
(calculate_per_token_loss) divides the summed gradients once by the number of loss tokens of the
whole global batch. The result is independent of how the batch is split over data-parallel ranks
and micro-batches, which is what lets every layout be compared with one process.
"""
from __future__ import annotations

import gc
import json
import math
import os
import resource
import shutil
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from dsv4 import stepmemo
from dsv4.config import ModelConfig
from dsv4.fileio import atomic_write
from dsv4.heartbeat import Heartbeat
from dsv4.megatron import cpu_shim
from dsv4.megatron.model import DSV4Stage, Objective, model_provider
from dsv4.megatron.nanwatch import NonFiniteMonitor, PlantSpec, run_facts
from dsv4.megatron.parallel import Layout, Ranks, cp_slice, shard_index

EXIT_NONFINITE = 16
LATEST = "latest_checkpointed_iteration.txt"


# ================================================================================================ config
NONFINITE_LOCATE = ("rerun", "every_step", "off")


@dataclass
class TrainConfig:
    model: ModelConfig
    layout: Layout = field(default_factory=Layout)
    objective: Objective = field(default_factory=Objective)
    seq_len: int = 64
    micro_batch_size: int = 1
    global_batch_size: int = 2
    num_steps: int = 2
    lr: float = 1e-4
    min_lr: float = 0.0
    lr_decay_style: str = "constant"      # constant | cosine | linear
    lr_warmup_iters: int = 0
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    clip_grad: float = 1.0
    seed: int = 1234
    save_interval: int = 1
    save_retain_interval: int = 0         # keep every N-th checkpoint as well as the latest (0: latest only)
    distributed_optimizer: bool = False
    recompute: str = "none"               # none | full (recompute each transformer block in backward)
    device: str = "cpu"                   # cpu | cuda
    # how a non-finite step's first module is named (hooks on every module output and gradient):
    # rerun: the step runs again with the hooks, before any update (free while steps are finite);
    # every_step: hooks always on (names a fault that does not repeat); off: exit 16 without a module
    nonfinite_locate: str = "rerun"
    peak_tflops: float = 0.0              # dense bf16 peak of one device: MFU's denominator (0: no MFU)
    adam_kernel: str = "fused"            # fused | foreach: torch's Adam kernels on CUDA (a CPU keeps foreach)
    # progress marks for a hang watchdog (dsv4/heartbeat.py): their directory ("" = none) and the planted-hang test hook
    heartbeat_dir: str = ""
    plant_hang: str = ""

    def micro_batches_per_step(self, dp: int) -> int:
        if self.global_batch_size % (self.micro_batch_size * dp):
            raise ValueError(f"global batch {self.global_batch_size} is not a multiple of micro batch "
                             f"{self.micro_batch_size} x DP {dp}")
        return self.global_batch_size // (self.micro_batch_size * dp)


# ================================================================================================ process setup
def init_distributed(rank: int, world: int, backend: str, device: str, master_addr: str | None = None,
                     master_port: int | None = None, timeout_s: float | None = None) -> None:
    """torch.distributed for this rank, and the CPU shim when no GPU is used. timeout_s: the process group's
    collective timeout (None: torch's default; dsv4.heartbeat.collective_timeout_s under a hang watchdog)."""
    if master_addr:
        os.environ["MASTER_ADDR"] = master_addr
    if master_port:
        os.environ["MASTER_PORT"] = str(master_port)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    cpu_shim.install(device)
    if device == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        # ranks share the cores, and an OpenMP thread spinning on a busy core stalls every small op:
        # measured 0.45 s/step with 1 thread vs 0.7-4.5 s with 2 for the tiny model on a loaded 2-core box
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // (2 * world)))
    bound = {}
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % max(torch.cuda.device_count(), 1))
        if backend == "nccl":      # the group's GPU stated, not guessed at its first barrier (torch warns then)
            bound["device_id"] = torch.device("cuda", torch.cuda.current_device())
    if timeout_s:
        from datetime import timedelta
        bound["timeout"] = timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        if world == 1:      # no peer to meet: an in-process store, and no port for another process to take first
            bound["store"] = dist.HashStore()
        dist.init_process_group(backend, rank=rank, world_size=world, **bound)


def all_finite(tensors: list[torch.Tensor]) -> torch.Tensor:
    """A 0-d bool on the tensors' device: no NaN or infinity in any of them. By each tensor's min and max (NaN
    propagates through both), one reduction that allocates nothing of the tensor's size: `torch.isfinite` holds an
    fp32 copy and three bools at once, 7 bytes an element, 21 GiB on the routed experts' gradient buffer of a
    TP8 EP8 rank (its bench ran out of memory on that copy)."""
    ok = torch.ones((), dtype=torch.bool, device=tensors[0].device if tensors else "cpu")
    for t in tensors:
        if t.numel():
            lo, hi = torch.aminmax(t)
            ok = ok & torch.isfinite(lo) & torch.isfinite(hi)
    return ok


def _fuse_adam(optimizer) -> None:
    """Without TransformerEngine or apex, megatron falls back to torch's Adam, which then picks its foreach
    kernels: several multi-tensor launches for each chunk of parameters and each of the update's
    element-wise ops (22k launches a step at 32 local experts). torch's fused Adam does the same fp32 update
    in one kernel a chunk. Its step counters live on the device, so any loaded as host scalars move there."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if not isinstance(inner, torch.optim.Adam):      # AdamW is a subclass
            continue
        for group in inner.param_groups:
            group["foreach"], group["fused"] = False, True
            for p in group["params"]:
                state = inner.state.get(p)
                if state and "step" in state:
                    state["step"] = torch.as_tensor(state["step"], dtype=torch.float32, device=p.device)


def foreach_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """amp_C.multi_tensor_l2norm's contract, (the fp32 L2 norm of every tensor as one element, None), from foreach
    norms. megatron's own fallback without apex or TransformerEngine builds `torch.tensor` from a list of device
    scalars: a host sync per parameter at every step's gradient norm (480 at 32 local experts)."""
    norms = [n for tensors in tensor_lists if tensors for n in torch._foreach_norm(tensors)]
    if not norms:
        return torch.zeros(1, dtype=torch.float, device=noop_flag.device), None
    return torch.linalg.vector_norm(torch.stack(norms).float()).reshape(1), None


def foreach_scale(chunk_size, noop_flag, tensor_lists, scale):
    """amp_C.multi_tensor_scale's contract, dst = src * scale, in multi-tensor kernels: megatron's fallback runs a
    multiply, a temporary and a copy per parameter, as when it copies the fp32 master weights into the bf16 ones
    (scale 1) after every update."""
    src, dst = tensor_lists
    if scale == 1.0:
        torch._foreach_copy_(dst, src)
    elif all(a is b for a, b in zip(src, dst)):
        torch._foreach_mul_(dst, scale)
    else:
        torch._foreach_copy_(dst, torch._foreach_mul(src, scale))


def _foreach_megatron_fallbacks() -> None:
    """Put the foreach forms above where megatron chose its per-tensor fallbacks (no apex or TransformerEngine)."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads, optimizer
    if getattr(clip_grads, "l2_norm_impl", None) is utils.local_multi_tensor_l2_norm:
        clip_grads.l2_norm_impl = foreach_l2_norm
    for mod in (clip_grads, optimizer):
        if getattr(mod, "multi_tensor_scale_impl", None) is utils.local_multi_tensor_scale:
            mod.multi_tensor_scale_impl = foreach_scale


def quiet_libraries() -> None:
    """Silence library chatter that says nothing about this run: megatron's import-time notices (no
    TransformerEngine/Apex: expected), its once-per-process async-save deprecation notice (our saves are
    synchronous), and torch.distributed.checkpoint's API-change notices."""
    import logging
    import warnings
    warnings.filterwarnings("ignore", module="megatron")
    warnings.filterwarnings("ignore", category=UserWarning, module="torch.distributed.checkpoint")
    logging.getLogger("megatron.core.dist_checkpointing").setLevel(logging.ERROR)


def _thread_queue_for_checkpoint_writes() -> None:
    """megatron's torch_dist writer hands its write results back through a multiprocessing Manager
    queue, made for async saves in a side process. Creating that Manager spawns a process that
    re-imports __main__ (seconds here; inside a Ray actor, the actor's own entrypoint). Our saves are
    synchronous: the writer threads and the reader share one process, so a thread-safe queue does."""
    import queue
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    if not getattr(filesystem_async, "_dsv4_thread_queue", None):
        filesystem_async._dsv4_thread_queue = queue.Queue()
        filesystem_async.get_write_results_queue = lambda mp_mode="spawn": filesystem_async._dsv4_thread_queue


def _mixed_dtype_optimizer_checkpoints() -> None:
    """megatron's bf16 optimizer (Float16OptimizerWithFloat16Params) builds its checkpoint map as if
    every parameter were 16-bit: it numbers optimizer states by walking only the 16-bit parameters,
    while torch's Adam numbers them over the param groups, where DSV4's fp32 parameters (norms, hc_*,
    attn_sink, ape, compressor, head) sit in between. Saving then fails ("Optimizer shape (4, 512) does
    not match model shape (512, 128)"), or pairs states with the wrong parameters. This replacement
    numbers them over the param groups, like the optimizer does.
    The fp32 master copies are keyed {group: {index: tensor}} instead of nested lists: a param group
    without 16-bit parameters (the no-weight-decay group holds only fp32 ones) is an empty list, and
    dist_checkpointing's split into sharded and common parts drops list positions around it, so the
    merge on load fails ("Cannot merge two lists with different lengths (0 and 37)")."""
    from megatron.core.dist_checkpointing.optimizer import (get_param_id_to_sharded_param_map,
                                                            make_sharded_optimizer_tensor,
                                                            optim_state_to_sharding_state)
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params as F16
    if getattr(F16, "_dsv4_mixed_dtype", False):
        return

    def sharded_state_dict(self, model_sharded_state_dict, is_loading: bool = False, metadata=None):
        if is_loading:
            self.init_state_fn(self.optimizer, self.config)
        state_dict = self.state_dict()
        model_of = {}                                  # id(optimizer's param) -> model parameter
        for model_group, main_group in zip(self.float16_groups, self.fp32_from_float16_groups):
            model_of.update({id(main): m for m, main in zip(model_group, main_group)})
        for group in self.fp32_from_fp32_groups:
            model_of.update({id(p): p for p in group})
        in_order = [model_of[id(p)] for g in self.optimizer.param_groups for p in g["params"]]
        id_map = get_param_id_to_sharded_param_map(model_sharded_state_dict, in_order)
        masters = {}
        for g, (state_group, fp32_group) in enumerate(zip(state_dict["optimizer"]["param_groups"],
                                                         state_dict["fp32_from_fp16_params"])):
            state_id = {id(p): sid for sid, p in zip(state_group["params"], self.optimizer.param_groups[g]["params"])}
            masters[str(g)] = {str(i): make_sharded_optimizer_tensor(id_map[state_id[id(p)]], p,
                                                                     prefix="optimizer.state.fp32_param")
                               for i, p in enumerate(fp32_group)}
        state_dict["fp32_from_fp16_params"] = masters
        step = self._extract_common_per_param_step(state_dict["optimizer"])
        optim_state_to_sharding_state(state_dict["optimizer"], id_map, exclude_keys="step")
        if step:
            state_dict["optimizer"]["state"]["common_step"] = step
        return state_dict

    original_load = F16.load_state_dict

    def load_state_dict(self, state_dict):
        masters = state_dict.get("fp32_from_fp16_params")
        if isinstance(masters, dict):      # written by sharded_state_dict above: back to nested lists
            state_dict = {**state_dict, "fp32_from_fp16_params": [
                [masters[str(g)][str(i)] for i in range(len(masters[str(g)]))] for g in range(len(masters))]}
        return original_load(self, state_dict)

    F16.sharded_state_dict = sharded_state_dict
    F16.load_state_dict = load_state_dict
    F16._dsv4_mixed_dtype = True


def peak_memory_gb(device: str) -> float:
    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 2 ** 30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20   # Linux: KiB


class CheckpointReadError(RuntimeError):
    """A checkpoint directory that exists but cannot be loaded."""


def _cause(e: BaseException) -> str:
    """`EOFError` rather than torch's CheckpointException, whose text carries every rank's traceback."""
    failures = getattr(e, "failures", None)
    if failures:
        first = next(iter(failures.values()))
        e = first[0] if isinstance(first, tuple) else first
    text = str(e).strip().splitlines()[0][:160] if str(e).strip() else ""
    return type(e).__name__ + (f": {text}" if text else "")


# ================================================================================================ trainer
@dataclass
class StepResult:
    loss: float                  # LM cross-entropy per loss token over the global batch
    mtp_loss: float | None
    grad_norm: float
    lr: float
    loss_tokens: int
    step_time_s: float
    finite: bool
    nonfinite: dict | None = None


class Trainer:
    def __init__(self, tc: TrainConfig, init: str | Callable | None = "reference"):
        """Build this rank's stage, DDP wrapper, optimizer and scheduler. `init`: "reference" (the
        reference model's deterministic init), None (leave uninitialised: a checkpoint load follows), or
        a reader `read(official_name, index) -> tensor` (conversion, tests)."""
        from megatron.core.distributed import (DistributedDataParallel, DistributedDataParallelConfig,
                                               finalize_model_grads)
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        self.tc = tc
        cfg = tc.model
        _thread_queue_for_checkpoint_writes()
        _mixed_dtype_optimizer_checkpoints()
        _foreach_megatron_fallbacks()
        self.ranks = Ranks.current()
        tc.layout.validate(cfg, self.ranks.world, tc.seq_len)
        self.n_micro = tc.micro_batches_per_step(self.ranks.dp)
        stage = model_provider(cfg, tc.layout, tc.objective)
        if init == "reference":
            stage.init_weights(cfg.seed)
        elif callable(init):
            stage.load_weights(init)
        if tc.device == "cuda":
            stage = stage.cuda()
        stage.recompute = tc.recompute == "full"
        self.heartbeat = Heartbeat(tc.heartbeat_dir, self.ranks.rank, self.ranks.world, plant=tc.plant_hang)
        self.stage = stage
        self.config = stage.config
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                   use_distributed_optimizer=tc.distributed_optimizer)
        self.ddp = DistributedDataParallel(self.config, ddp_config, stage)
        self.config.finalize_model_grads_func = self._finalize_grads
        self._megatron_finalize = finalize_model_grads
        self.config.no_sync_func = self.ddp.no_sync
        self.config.grad_sync_func = None
        opt_config = OptimizerConfig(
            optimizer="adam", lr=tc.lr, min_lr=tc.min_lr, weight_decay=tc.weight_decay,
            adam_beta1=tc.adam_beta1, adam_beta2=tc.adam_beta2, adam_eps=1e-8, clip_grad=tc.clip_grad,
            bf16=self.config.bf16, params_dtype=self.config.params_dtype,
            use_distributed_optimizer=tc.distributed_optimizer)
        self.optimizer = get_megatron_optimizer(opt_config, [self.ddp])
        if tc.device == "cuda" and tc.adam_kernel == "fused":
            _fuse_adam(self.optimizer)
        decay_steps = max(tc.num_steps, 1)
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=0.0 if tc.lr_warmup_iters else tc.lr, max_lr=tc.lr, min_lr=tc.min_lr,
            lr_warmup_steps=tc.lr_warmup_iters, lr_decay_steps=decay_steps, lr_decay_style=tc.lr_decay_style,
            start_wd=tc.weight_decay, end_wd=tc.weight_decay, wd_incr_steps=decay_steps, wd_incr_style="constant")
        if tc.adam_kernel not in ("fused", "foreach"):
            raise ValueError(f"adam_kernel={tc.adam_kernel!r}: fused or foreach")
        if tc.nonfinite_locate not in NONFINITE_LOCATE:
            raise ValueError(f"nonfinite_locate={tc.nonfinite_locate!r}: one of {', '.join(NONFINITE_LOCATE)}")
        self.monitor = NonFiniteMonitor(stage, PlantSpec.from_env(),
                                        run_facts(cfg, tc.layout, tc.recompute, self.ranks.world))
        if tc.nonfinite_locate == "every_step":
            self.monitor.attach()
        self.iteration = 0

    # ---------------------------------------------------------------------------------- one step
    def _finalize_grads(self, model_chunks, num_tokens=None, *args, **kwargs):
        self._megatron_finalize(model_chunks, num_tokens, *args, **kwargs)
        # MTP trained across a pipeline: the last stage's embedding copy and stage 0's embedding get
        # the sum of both gradients (megatron's embedding group joins exactly these two stages).
        if self.stage.train_mtp and self.ranks.pp > 1:
            from megatron.core import parallel_state as ps
            w = self.stage.shared_embedding_or_output_weight()
            if w is not None and (self.ranks.first_stage or self.ranks.last_stage):
                dist.all_reduce(w.main_grad, group=ps.get_embedding_group())

    def _forward_step(self, data_iterator, model):
        mb = next(data_iterator)
        dev = self.tc.device
        tokens, loss_mask = mb["tokens"].to(dev), mb["loss_mask"].to(dev).float()
        ids, labels = tokens[:, :-1], tokens[:, 1:]
        self.monitor.tokens = ids
        n_tokens = loss_mask.sum()
        obj, stage = self.tc.objective, self.stage
        aux = None
        if obj.indexer_coeff > 0 and stage.n_indexer_layers:
            # the micro-batch's whole count also under CP: each CP rank's indexer loss is its share of the mean
            aux = obj.indexer_coeff * float(n_tokens) / stage.n_indexer_layers
        out = model(ids, labels, loss_mask, aux_weight=aux)
        # the loss sums cover this CP rank's positions; megatron adds the counts up over DP x CP
        n_mine = cp_slice(loss_mask).sum()

        def loss_func(sums):
            loss = sums[0] + obj.mtp_coeff * sums[1] if stage.train_mtp else sums[0]
            n = n_mine.to(torch.int)
            return loss, n, {"lm": torch.stack([sums[0].detach(), n_mine]),
                             "mtp": torch.stack([sums[1].detach(), n_mine])}
        return out, loss_func

    def step(self, micro_batches: list[dict], update: bool = True, on_grads: Callable | None = None) -> StepResult:
        """One optimizer step over this DP rank's micro-batches (each {tokens [b, S+1], loss_mask [b, S]}).
        update=False stops after the gradients; on_grads() runs once they are reduced (tests read them)."""
        if len(micro_batches) != self.n_micro:
            raise ValueError(f"step needs {self.n_micro} micro-batches on this rank, got {len(micro_batches)}")
        t0 = time.perf_counter()
        self.monitor.step_no = self.iteration + 1
        self.monitor.reset()
        self.heartbeat.mark(self.iteration + 1, "step")
        loss, mtp, n_tok = self._forward_backward(micro_batches)
        if on_grads is not None:
            on_grads()
        self.heartbeat.mark(self.iteration + 1, "grads_finite")
        grads_finite = self._grads_finite()
        finite = math.isfinite(loss) and grads_finite
        grad_norm, lr = float("nan"), self.optimizer.param_groups[0]["lr"]
        updated = False
        if finite and update:
            self.heartbeat.mark(self.iteration + 1, "optimizer")
            ok, grad_norm, _ = self.optimizer.step()
            updated = bool(ok)
            grad_norm = float(grad_norm) if grad_norm is not None else float("nan")
            finite = bool(ok) and math.isfinite(grad_norm)
            if finite:
                self.scheduler.step(1)
                self.iteration += 1
        elif finite:
            grad_norm = self._grad_norm_only()
        if self.tc.device == "cuda":
            torch.cuda.synchronize()
        res = StepResult(loss, mtp if self.stage.train_mtp else None, grad_norm, lr, n_tok,
                         time.perf_counter() - t0, finite)
        if not finite:
            rerun = self.tc.nonfinite_locate == "rerun" and not updated
            if rerun:       # the weights are the step's own: its faults (and the planted ones) come back
                self.monitor.reset()
                self.monitor.attach()
                try:
                    self._forward_backward(micro_batches)
                finally:
                    self.monitor.detach()
            res.nonfinite = self._locate_nonfinite(res, rerun)
        return res

    def _forward_backward(self, micro_batches: list[dict]) -> tuple[float, float, int]:
        """Megatron's forward/backward schedule over the micro-batches into freshly zeroed gradient buffers;
        the reduced (loss, MTP loss, loss tokens)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        self.ddp.train()
        # no weight changes inside the schedule: split the fp32 weights, and quantise the QAT ones, once
        with stepmemo.weights_fixed():
            store = get_forward_backward_func()(
                forward_step_func=self._forward_step, data_iterator=iter(micro_batches), model=[self.ddp],
                num_microbatches=self.n_micro, seq_length=self.tc.seq_len,
                micro_batch_size=self.tc.micro_batch_size, forward_only=False)
        return self._reduce_losses(store)

    def _reduce_losses(self, store) -> tuple[float, float, int]:
        """Sum the last stage's per-micro-batch loss sums over DP and CP and share them with every rank."""
        t = torch.zeros(3, dtype=torch.float64)
        if self.ranks.last_stage and self.ranks.tp_rank == 0:
            for d in store:
                t += torch.tensor([float(d["lm"][0]), float(d["mtp"][0]), float(d["lm"][1])], dtype=torch.float64)
        t = t.to(self._comm_device())
        self.heartbeat.mark(self.iteration + 1, "reduce_losses")
        dist.all_reduce(t)
        lm, mtp, n = t.tolist()
        return lm / max(n, 1), mtp / max(n, 1), int(n)

    def _comm_device(self):
        return "cuda" if self.tc.device == "cuda" else "cpu"

    def _grads_finite(self) -> bool:
        """Every rank's gradients finite (one all-reduce) over megatron DDP's few flat buffers (each parameter's
        main_grad a view of one)."""
        grads = [b.grad_data for b in self.ddp.buffers + self.ddp.expert_parallel_buffers]
        bad = (~all_finite(grads)).float().to(self._comm_device())
        dist.all_reduce(bad)
        return bad.item() == 0

    def _grad_norm_only(self) -> float:
        """Global gradient norm without an update (the reload check's second run, eval)."""
        sq = torch.zeros((), dtype=torch.float64, device=self._comm_device())
        for p in self.stage.parameters():
            g = getattr(p, "main_grad", None)
            if p.requires_grad and g is not None and self._counts_for_norm(p):
                sq += g.double().pow(2).sum()
        dist.all_reduce(sq)
        return math.sqrt(sq.item())

    def _counts_for_norm(self, p) -> bool:
        """Each logical gradient element once: replicas over TP count on TP rank 0 only; whole experts
        are unique per rank in their expert-tensor group (whose data-parallel rank folds CP in); DP and CP
        replicas count on their rank 0."""
        if getattr(p, "shared", False):                  # the last stage's copy of the embedding
            return False
        expert = not getattr(p, "allreduce", True)
        if expert:
            return self.ranks.edp_rank == 0
        return self.ranks.dp_cp_rank == 0 and (getattr(p, "tensor_model_parallel", False) or self.ranks.tp_rank == 0)

    def _locate_nonfinite(self, res: StepResult, rerun: bool) -> dict:
        """The first non-finite module: earliest forward output on the earliest pipeline stage; else the
        first backward event on the latest stage (backward runs from the last stage to the first). `rerun`:
        the events come from the step's second run (a fault that did not come back names no module)."""
        mine = {"rank": self.ranks.rank, "pp_rank": self.ranks.pp_rank, "tp_rank": self.ranks.tp_rank,
                "dp_rank": self.ranks.dp_rank}
        for phase in ("forward", "backward"):
            ev = self.monitor.first_event(phase)
            mine[phase] = None if ev is None else {"seq": ev[0], "module": ev[1], "kind": ev[2]}
        everyone = [None] * self.ranks.world
        dist.all_gather_object(everyone, mine)
        fwd = [r for r in everyone if r["forward"]]
        bwd = [r for r in everyone if r["backward"]]
        if fwd:
            r = min(fwd, key=lambda r: (r["pp_rank"], r["forward"]["seq"], r["rank"]))
            first = {"phase": "forward", **r["forward"], "rank": r["rank"]}
        elif bwd:
            r = min(bwd, key=lambda r: (-r["pp_rank"], r["backward"]["seq"], r["rank"]))
            first = {"phase": "backward", **r["backward"], "rank": r["rank"]}
        else:
            where = "loss" if not math.isfinite(res.loss) else "gradient after reduction"
            if rerun:
                note = (" when the step ran again with the hooks: the fault did not repeat (nonfinite_locate="
                        "'every_step', PRESET_NONFINITE_LOCATE in a run, watches each step's first run)")
            elif self.tc.nonfinite_locate == "off":
                note = " (hooks off)"
            elif self.tc.nonfinite_locate == "rerun":
                note = " (the update had run, so the step could not run again)"
            else:
                note = ""
            first = {"phase": "unknown", "module": None, "kind": where, "rank": None,
                     "note": "no module hook fired" + note}
        return {"step": self.iteration + 1, "rank": first["rank"], "module": first["module"],
                "phase": first["phase"], "kind": first["kind"], "note": first.get("note", ""), "loss": res.loss,
                "located_by": "rerun" if rerun else self.tc.nonfinite_locate, "per_rank": everyone}

    # ---------------------------------------------------------------------------------- eval
    @torch.no_grad()
    def eval_loss(self, micro_batches: list[dict]) -> tuple[float, int]:
        from megatron.core.pipeline_parallel import get_forward_backward_func
        self.ddp.eval()
        with stepmemo.weights_fixed():      # as in a training step: no weight changes across the micro-batches
            store = get_forward_backward_func()(
                forward_step_func=self._forward_step, data_iterator=iter(micro_batches), model=[self.ddp],
                num_microbatches=len(micro_batches), seq_length=self.tc.seq_len,
                micro_batch_size=self.tc.micro_batch_size, forward_only=True)
        loss, _, n = self._reduce_losses(store)
        return loss, n

    # ---------------------------------------------------------------------------------- checkpoints
    def save(self, root: Path, iteration: int | None = None) -> Path:
        """Distributed checkpoint of model, optimizer and scheduler under root/iter_NNNNNNN; the
        `latest` pointer moves only after every rank finished writing."""
        from megatron.core import dist_checkpointing
        it = self.iteration if iteration is None else iteration
        self.heartbeat.mark(it, "save")
        path = Path(root) / f"iter_{it:07d}"
        if self.ranks.rank == 0:
            if path.exists():
                shutil.rmtree(path)
            path.mkdir(parents=True)
        dist.barrier()
        model_sd = self.stage.sharded_state_dict()
        state = {"model": model_sd, "optimizer": self.optimizer.sharded_state_dict(model_sd),
                 "scheduler": self.scheduler.state_dict(), "iteration": it,
                 "model_config": self.tc.model.to_dict()}
        dist_checkpointing.save(state, str(path))
        dist.barrier()
        if self.ranks.rank == 0:
            atomic_write(Path(root) / LATEST, str(it))
            self._prune(Path(root), it)
        dist.barrier()
        return path

    def _prune(self, root: Path, keep: int) -> None:
        retain = self.tc.save_retain_interval
        for d in root.glob("iter_*"):
            it = int(d.name.split("_")[1])
            if it != keep and not (retain and it % retain == 0):
                shutil.rmtree(d, ignore_errors=True)

    def load(self, path: Path, with_optimizer: bool = True) -> int:
        """Load a checkpoint directory written by `save` (or model-only by jobs.convert_ckpt)."""
        from megatron.core import dist_checkpointing
        self.heartbeat.mark(self.iteration, "restore")
        model_sd = self.stage.sharded_state_dict()
        request = {"model": model_sd}
        if with_optimizer:
            request["optimizer"] = self.optimizer.sharded_state_dict(model_sd, is_loading=True)
        try:
            loaded = dist_checkpointing.load(request, str(path))
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:   # torch's CheckpointException (a BaseException) wrapping EOFError, pickle errors...
            raise CheckpointReadError(
                f"{path}: cannot be read ({_cause(e)}): the checkpoint is truncated "
                f"or corrupted (a disk that filled during the save, an interrupted copy). Move it aside and the run "
                f"resumes from the checkpoint before it, or starts from the converted weights") from e
        missing = set(self.stage.state_dict()) - set(loaded["model"])
        if missing:
            raise RuntimeError(f"{path}: checkpoint lacks {sorted(missing)[:5]} ...")
        self.stage.load_state_dict(loaded["model"], strict=True)
        if with_optimizer:
            self.optimizer.load_state_dict(loaded["optimizer"])
            if self.tc.device == "cuda" and self.tc.adam_kernel == "fused":
                _fuse_adam(self.optimizer)       # the loaded param groups carry the saving run's choice
            self.scheduler.load_state_dict(loaded["scheduler"])
            self.iteration = int(loaded["iteration"])
        else:
            # a fresh optimizer starts from the loaded weights: refresh its fp32 master copies
            self.optimizer.reload_model_params()
        return int(loaded.get("iteration", 0))

    # ---------------------------------------------------------------------------------- grads (tests)
    def full_grads(self) -> dict[str, tuple[tuple[slice, ...], torch.Tensor]]:
        """This rank's reduced gradients keyed by official name, each with the slice of the logical
        tensor it covers (tests assemble them and compare with one process)."""
        shapes = self.tc.model.param_shapes()
        out = {}
        for key, p, copy in self.stage.checkpoint_params():
            g = getattr(p, "main_grad", None)
            if p.requires_grad and g is not None and copy == 0:
                out[key] = (shard_index(p, shapes[key], self.ranks), g.detach().float().cpu().clone())
        return out

    def close(self) -> None:
        self.monitor.close()


def latest_checkpoint(root: Path) -> Path | None:
    p = Path(root) / LATEST
    if not p.is_file():
        return None
    d = Path(root) / f"iter_{int(p.read_text().strip()):07d}"
    return d if d.is_dir() else None


def split_micro_batches(batch: dict, micro_batch_size: int) -> list[dict]:
    n = batch["tokens"].shape[0]
    return [{k: v[i:i + micro_batch_size] for k, v in batch.items()} for i in range(0, n, micro_batch_size)]


# ================================================================================================ the SFT loop
@dataclass
class Outputs:
    """Where a training run writes. `init_checkpoint`: model-only checkpoint (jobs.convert_ckpt) to start
    from when `checkpoints` holds none; None starts from the reference initialisation."""
    checkpoints: Path
    init_checkpoint: Path | None = None
    reload_check: Path | None = None      # JSON of the save -> reload -> next-step check (None: skip it)
    nonfinite: Path | None = None         # JSON naming the first non-finite module, written before exit 16


def run_sft(tc: TrainConfig, step_batches: Callable[[int, int, int], Iterator[dict]], out: Outputs,
            on_metrics: Callable[[dict], None] = lambda row: None, log: Callable[[str], None] = print) -> int:
    """Train tc.num_steps optimizer steps (resuming from the latest checkpoint in out.checkpoints), then
    run the reload check. step_batches(dp_rank, dp, start_step) yields, per step, this DP rank's rows
    {tokens [gbs/dp, S+1], loss_mask [gbs/dp, S]}. Returns the exit code: 0, or 16 (non-finite)."""
    trainer = Trainer(tc, init=None)
    r = trainer.ranks
    say = log if r.rank == 0 else (lambda msg: None)
    try:
        start = _restore(trainer, out, say)
    except CheckpointReadError as e:
        say(f"error: {e}")
        return 1
    batches = step_batches(r.dp_rank, r.dp, start)
    tokens_per_step = tc.global_batch_size * tc.seq_len
    from dsv4.flops import train_flops_per_token
    flops_per_token, _ = train_flops_per_token(tc.model, tc.seq_len, mtp=tc.objective.mtp_coeff > 0,
                                               recompute=tc.recompute == "full")
    kill_at = int(os.environ.get("V4_KILL_AT_STEP", "0") or 0)     # test hook: die inside this step
    ckpt = latest_checkpoint(out.checkpoints)
    say(f"training steps {start + 1}..{tc.num_steps} on {r.world} rank(s): TP={r.tp} PP={r.pp} CP={r.cp} EP={r.ep} "
        f"ETP={r.etp} DP={r.dp}, {trainer.n_micro} micro-batch(es) of {tc.micro_batch_size} x {tc.seq_len} per rank"
        + (f" ({tc.seq_len // r.cp} positions each over CP)" if r.cp > 1 else ""))
    for step in range(start + 1, tc.num_steps + 1):
        micro = split_micro_batches(next(batches), tc.micro_batch_size)
        if step == kill_at and r.rank == 0:
            say(f"V4_KILL_AT_STEP={kill_at}: killing rank 0 in the middle of step {step}")
            os.kill(os.getpid(), signal.SIGKILL)
        res = trainer.step(micro)
        if not res.finite:
            return _stop_nonfinite(trainer, res, out, say, micro)
        peak = torch.tensor([peak_memory_gb(tc.device)], device=trainer._comm_device())
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        row = {"step": step, "loss": res.loss, "grad_norm": res.grad_norm, "lr": res.lr,
               "tokens": tokens_per_step, "loss_tokens": res.loss_tokens, "step_time_s": res.step_time_s,
               "tokens_per_s": tokens_per_step / res.step_time_s, "peak_mem_gb": float(peak.item()),
               "world": r.world}
        row["model_tflops"] = flops_per_token * row["tokens_per_s"] / 1e12          # all ranks together
        if tc.peak_tflops:
            row["mfu"] = row["model_tflops"] / (tc.peak_tflops * r.world)
        if res.mtp_loss is not None:
            row["mtp_loss"] = res.mtp_loss
        if r.rank == 0:
            on_metrics(row)
        mfu = f" MFU {row['mfu']:.1%}" if "mfu" in row else ""
        say(f"step {step}/{tc.num_steps} loss {res.loss:.4f} grad_norm {res.grad_norm:.3f} lr {res.lr:.2e} "
            f"{res.step_time_s:.2f} s {row['tokens_per_s']:.0f} tok/s {row['model_tflops']:.3g} TFLOP/s{mfu} "
            f"peak {row['peak_mem_gb']:.2f} GB")
        if step % tc.save_interval == 0 or step == tc.num_steps:
            ckpt = trainer.save(out.checkpoints)
            say(f"saved {ckpt}")
    if out.reload_check is not None:
        if ckpt is None:   # nothing trained and nothing saved (num_steps = 0): save the start point
            ckpt = trainer.save(out.checkpoints)
        return reload_check(trainer, tc, ckpt, next(batches), out, say)
    return 0


def drop_unfinished_saves(root: Path, say=lambda msg: None) -> list[Path]:
    """Remove the iter_* directories past the `latest` pointer (every one when there is no pointer yet): saves cut
    short, by a killed job or a lost node. The pointer moves only once every rank has written its part, so it alone
    says which checkpoint is whole; a directory past it holds a part of one, or nothing."""
    root = Path(root)
    try:
        latest = int((root / LATEST).read_text().strip())
    except FileNotFoundError:
        latest = -1
    except (OSError, ValueError):
        return []                          # a pointer that cannot be read: nothing is known to be unfinished
    gone = []
    for d in sorted(root.glob("iter_*")) if root.is_dir() else []:
        try:
            it = int(d.name.split("_", 1)[1])
        except ValueError:
            continue
        if it > latest and d.is_dir():
            shutil.rmtree(d, ignore_errors=True)
            gone.append(d)
            say(f"removed {d}: a save cut short (the pointer {root / LATEST} names "
                + (f"iter_{latest:07d}" if latest >= 0 else "no checkpoint") + ")")
    return gone


def _restore(trainer: Trainer, out: Outputs, say) -> int:
    """Resume from the latest checkpoint, else load the converted weights, else the reference init."""
    if trainer.ranks.rank == 0:
        drop_unfinished_saves(out.checkpoints, say)
    ckpt = latest_checkpoint(out.checkpoints)
    if ckpt is not None:
        start = trainer.load(ckpt)
        say(f"resumed from {ckpt} (step {start})")
        return start
    if out.init_checkpoint is not None:
        trainer.load(out.init_checkpoint, with_optimizer=False)
        say(f"loaded weights from {out.init_checkpoint}")
    else:
        trainer.stage.init_weights(trainer.tc.model.seed)
        trainer.optimizer.reload_model_params()
        say("no checkpoint given: reference initialisation")
    return 0


def _stop_nonfinite(trainer: Trainer, res: StepResult, out: Outputs, say, micro: list[dict] | None = None) -> int:
    """Name the first non-finite module (nonfinite.json), keep what a replay of the step needs, exit 16.
    The capture costs nothing until a step fails: the weights the failing step started from (the update was
    skipped, so they are the trainer's now) as a checkpoint unless the latest one is them, and each data-parallel
    rank's rows of the step by content hash, so that `v4 nan bisect` can check it replays the same data."""
    info = res.nonfinite
    where = (f"module {info['module']!r} ({info['phase']} {info['kind']})" if info["module"] else
             f"{info['kind']} ({info['note']})" if info.get("note") else info["kind"])
    say(f"error: non-finite loss or gradient at step {info['step']} (loss {res.loss}); first at {where} "
        f"on rank {info['rank']}; stopping with exit code {EXIT_NONFINITE}")
    capture = None
    if out.nonfinite is not None:
        latest = latest_checkpoint(out.checkpoints)
        ckpt = latest if latest is not None and latest.name == f"iter_{trainer.iteration:07d}" \
            else trainer.save(out.checkpoints)
        rows = [row_hash(t) for mb in (micro or []) for t in mb["tokens"]]
        everyone = [None] * trainer.ranks.world
        dist.all_gather_object(everyone, {"rank": trainer.ranks.rank, "dp_rank": trainer.ranks.dp_rank, "rows": rows})
        capture = {"step": info["step"], "checkpoint": str(ckpt), "iteration": trainer.iteration,
                   "rows_by_dp_rank": {str(r["dp_rank"]): r["rows"] for r in everyone},
                   "micro_batch_size": trainer.tc.micro_batch_size, "plant": os.environ.get("V4_PLANT_NAN", "")}
    if trainer.ranks.rank == 0 and out.nonfinite is not None:
        atomic_write(out.nonfinite, json.dumps(info, indent=2, default=str))
        atomic_write(out.nonfinite.with_name("nan_capture.json"), json.dumps(capture, indent=2))
        say(f"kept the step for a replay: {ckpt} and {out.nonfinite.with_name('nan_capture.json')}; "
            f"next: v4 nan bisect {out.nonfinite.parents[2].name}")
    dist.barrier()
    return EXIT_NONFINITE


def row_hash(tokens: torch.Tensor) -> str:
    """A sample's identity across replays: the hash of its token ids."""
    import hashlib
    return hashlib.sha1(tokens.detach().to(torch.int64).cpu().numpy().tobytes()).hexdigest()[:16]


def reload_check(trainer: Trainer, tc: TrainConfig, ckpt: Path, batch: dict, out: Outputs, say) -> int:
    """Save -> reload -> the next step gives the identical loss. Step N+1 runs on the live trainer, then a
    fresh model and optimizer load checkpoint N and run step N+1 on the same batch. Both the step's loss
    and gradient norm, and the loss after the update (which needs the optimizer state), are recorded."""
    micro = split_micro_batches(batch, tc.micro_batch_size)
    a = trainer.step(micro)
    a_after = trainer.eval_loss(micro)[0] if a.finite else float("nan")
    trainer.close()
    del trainer
    gc.collect()
    if tc.device == "cuda":
        torch.cuda.empty_cache()
    fresh = Trainer(tc, init=None)
    fresh.load(ckpt)
    b = fresh.step(micro)
    b_after = fresh.eval_loss(micro)[0] if b.finite else float("nan")
    result = {"step": fresh.iteration, "checkpoint": str(ckpt),
              "loss_continued": a.loss, "loss_reloaded": b.loss,
              "grad_norm_continued": a.grad_norm, "grad_norm_reloaded": b.grad_norm,
              "loss_after_update_continued": a_after, "loss_after_update_reloaded": b_after}
    # the gate's criterion is the loss: the forward is deterministic. Gradients may differ in the last
    # bits on a GPU (atomics in attention backward), so their equality is reported apart.
    result["identical"] = a.loss == b.loss
    result["grad_norm_identical"] = a.grad_norm == b.grad_norm
    result["after_update_identical"] = a_after == b_after
    say(f"reload check at step {result['step']}: loss {a.loss!r} continued vs {b.loss!r} reloaded; "
        f"after update {a_after!r} vs {b_after!r} -> {'identical' if result['identical'] else 'DIFFERENT'}")
    if fresh.ranks.rank == 0:
        atomic_write(out.reload_check, json.dumps(result, indent=2))
    fresh.close()
    dist.barrier()
    return 0
