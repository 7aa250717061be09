"""Process layout, sequence-parallel mappings, parameter sharding marks and checkpoint shards.

Everything the DSV4 megatron modules need to know about the other ranks lives here, so the layers
read like the reference model plus a few explicit communication calls.

Conventions
* Activations keep the reference layout [B, S, ...]. With tensor parallelism (TP > 1) sequence
  parallelism is always on: between sublayers each TP rank holds S/TP positions of the hc residual
  streams; a sublayer gathers the sequence (`sp_gather`), works on its head/FFN shard, and returns a
  partial sum that `sp_reduce_scatter` adds up and splits again.
* Inside a gathered region every TP rank computes the replicated parts (wq_a, wkv, compressor,
  indexer, router, ...) on the same tokens, and each rank's backward only sees the gradient of its
  own shard's contribution. The true gradient of a replicated parameter is therefore the SUM over TP
  ranks, which megatron's finalize_model_grads does for every parameter marked `sequence_parallel`
  (the same sum that sequence-parallel norms need). So: every parameter is either TP-sharded
  (`mark_tp`) or summed over TP (`mark_replicated`).
* Routed-expert parameters are marked `allreduce=False`: megatron's DDP then averages them over the
  expert-data-parallel group instead of the data-parallel group.
* Context parallelism (CP > 1) splits each sequence over the CP group (megatron-core's
  context-parallel group): the sequence is cut into 2*CP equal chunks and CP rank r holds chunks r
  and 2*CP-1-r, concatenated, so every rank gets the same share of causal attention work. Everything
  but attention is per token and runs unchanged on the local positions; attention exchanges what
  crosses the chunk edges (dsv4/megatron/cp_attention.py). Parameters are replicated over CP and
  megatron's DDP sums their gradients over DP x CP, as for DP.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from dsv4.config import ModelConfig


# ================================================================================================ layout
@dataclass(frozen=True)
class Layout:
    """How one training job splits the model: tensor (tp), pipeline (pp), expert (ep) and expert-tensor
    (etp) parallel sizes, the transformer layers of each pipeline stage (None: an even split), and the
    context-parallel size (cp: ranks that share one sequence). Data parallel size follows from the world
    size: dp = world / (tp * pp * cp)."""
    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int = 1
    stage_layers: tuple[int, ...] | None = None
    cp: int = 1

    def layers_per_stage(self, cfg: ModelConfig) -> tuple[int, ...]:
        if self.stage_layers is not None:
            return tuple(self.stage_layers)
        if cfg.n_layers % self.pp:
            raise ValueError(f"{cfg.n_layers} layers do not split evenly over PP={self.pp}; "
                             f"give the layers of each stage (PRESET_PP_FIRST_LAYERS/LAST_LAYERS or PRESET_PP_LAYOUT)")
        return (cfg.n_layers // self.pp,) * self.pp

    def stage_layer_ids(self, cfg: ModelConfig, stage: int) -> list[int]:
        counts = self.layers_per_stage(cfg)
        start = sum(counts[:stage])
        return list(range(start, start + counts[stage]))

    def validate(self, cfg: ModelConfig, world: int, seq_len: int | None = None) -> "Layout":
        errs = []
        mp = self.tp * self.pp * self.cp
        if self.cp < 1:
            errs.append(f"CP={self.cp} must be >= 1")
        if world % mp:
            errs.append(f"TP*PP*CP = {self.tp}*{self.pp}*{self.cp} does not divide the world size {world}")
        dp = world // mp if mp and world % mp == 0 else 0
        if cfg.n_heads % self.tp or cfg.o_groups % self.tp:
            errs.append(f"TP={self.tp} must divide n_heads={cfg.n_heads} and o_groups={cfg.o_groups}")
        if cfg.vocab_size % self.tp:
            errs.append(f"TP={self.tp} must divide vocab_size={cfg.vocab_size} (vocab-parallel embedding and head)")
        if cfg.moe_inter_dim % self.tp:
            errs.append(f"TP={self.tp} must divide moe_inter_dim={cfg.moe_inter_dim} (shared expert)")
        if self.etp not in (1, self.tp):
            errs.append(f"ETP={self.etp}: dsv4.megatron supports ETP=1 (whole experts) or ETP=TP={self.tp}")
        if cfg.n_routed_experts % self.ep:
            errs.append(f"EP={self.ep} must divide n_routed_experts={cfg.n_routed_experts}")
        if dp and (dp * self.cp * self.tp) % (self.ep * self.etp):
            # megatron folds CP into the expert data-parallel dimension: experts see DP*CP*TP ranks
            errs.append(f"EP*ETP={self.ep}*{self.etp} must divide DP*CP*TP={dp}*{self.cp}*{self.tp}")
        if cfg.moe_inter_dim % self.etp:
            errs.append(f"ETP={self.etp} must divide moe_inter_dim={cfg.moe_inter_dim}")
        if seq_len is not None and self.cp > 1 and seq_len % (2 * self.cp):
            errs.append(f"sequence length {seq_len} must be a multiple of 2*CP={2 * self.cp} "
                        f"(the load-balanced split cuts it into 2*CP equal chunks)")
        elif seq_len is not None and self.tp > 1 and (seq_len // max(self.cp, 1)) % self.tp:
            errs.append(f"sequence length {seq_len} / CP={self.cp} must be a multiple of TP={self.tp} "
                        f"(sequence parallelism)")
        try:
            counts = self.layers_per_stage(cfg)
            if len(counts) != self.pp or sum(counts) != cfg.n_layers or min(counts) < 0:
                errs.append(f"stage layers {list(counts)} must be PP={self.pp} counts summing to n_layers={cfg.n_layers}")
        except ValueError as e:
            errs.append(str(e))
        if errs:
            raise ValueError("invalid parallel layout:\n  " + "\n  ".join(errs))
        return self


def init_parallel(layout: Layout, seed: int) -> None:
    """megatron-core process groups for `layout` (torch.distributed must be initialised) and its
    model-parallel RNG streams."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
                                 context_parallel_size=layout.cp,
                                 expert_model_parallel_size=layout.ep, expert_tensor_parallel_size=layout.etp)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


@dataclass(frozen=True)
class Ranks:
    """This process's coordinates in every megatron group (a snapshot taken after init_parallel)."""
    world: int
    rank: int
    tp: int
    tp_rank: int
    pp: int
    pp_rank: int
    dp: int
    dp_rank: int
    ep: int
    ep_rank: int
    etp: int
    etp_rank: int
    edp_rank: int
    cp: int = 1
    cp_rank: int = 0
    dp_cp_rank: int = 0          # rank among the replicas of this rank's parameters (DP x CP)

    @property
    def first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @classmethod
    def current(cls) -> "Ranks":
        from megatron.core import parallel_state as ps
        return cls(
            world=dist.get_world_size(), rank=dist.get_rank(),
            tp=ps.get_tensor_model_parallel_world_size(), tp_rank=ps.get_tensor_model_parallel_rank(),
            pp=ps.get_pipeline_model_parallel_world_size(), pp_rank=ps.get_pipeline_model_parallel_rank(),
            dp=ps.get_data_parallel_world_size(), dp_rank=ps.get_data_parallel_rank(),
            ep=ps.get_expert_model_parallel_world_size(), ep_rank=ps.get_expert_model_parallel_rank(),
            etp=ps.get_expert_tensor_parallel_world_size(), etp_rank=ps.get_expert_tensor_parallel_rank(),
            edp_rank=ps.get_expert_data_parallel_rank(),
            cp=ps.get_context_parallel_world_size(), cp_rank=ps.get_context_parallel_rank(),
            dp_cp_rank=ps.get_data_parallel_rank(with_context_parallel=True))


# ================================================================================================ SP mappings
# megatron's sequence-parallel mappings split dim 0; the reference layout has the sequence in dim 1.
def _tp_size() -> int:
    from megatron.core import parallel_state as ps
    return ps.get_tensor_model_parallel_world_size()


def sp_gather(x: torch.Tensor) -> torch.Tensor:
    """[B, S/TP, ...] -> [B, S, ...]. Backward: reduce-scatter, summing the TP ranks' partial gradients."""
    if _tp_size() == 1:
        return x
    from megatron.core.tensor_parallel import gather_from_sequence_parallel_region
    return gather_from_sequence_parallel_region(x.transpose(0, 1).contiguous()).transpose(0, 1)


def sp_reduce_scatter(x: torch.Tensor) -> torch.Tensor:
    """Partial sums [B, S, ...] -> summed [B, S/TP, ...]. Backward: all-gather."""
    if _tp_size() == 1:
        return x
    from megatron.core.tensor_parallel import reduce_scatter_to_sequence_parallel_region
    return reduce_scatter_to_sequence_parallel_region(x.transpose(0, 1).contiguous()).transpose(0, 1)


def sp_slice(x: torch.Tensor) -> torch.Tensor:
    """This TP rank's sequence slice of a tensor every rank holds whole (no autograd: ids, masks)."""
    tp = _tp_size()
    if tp == 1:
        return x
    from megatron.core import parallel_state as ps
    n = x.shape[1] // tp
    r = ps.get_tensor_model_parallel_rank()
    return x[:, r * n:(r + 1) * n]


def tp_all_gather_nograd(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Concatenate every TP rank's `x` along `dim` (forward only, e.g. head shards for the indexer loss)."""
    tp = _tp_size()
    if tp == 1:
        return x
    from megatron.core import parallel_state as ps
    parts = [torch.empty_like(x) for _ in range(tp)]
    dist.all_gather(parts, x.contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=dim)


# ================================================================================================ CP mappings
@dataclass(frozen=True)
class CPSplit:
    """Which positions of an S-token sequence CP rank `rank` holds: chunks `rank` and 2*cp-1-`rank` of
    2*cp equal chunks of L = S/(2*cp) tokens, in that order. The early chunk's queries see little of the
    sequence and the late one's almost all of it, so each rank does the same attention work."""
    cp: int
    rank: int
    S: int

    @property
    def L(self) -> int:
        return self.S // (2 * self.cp)

    @property
    def chunks(self) -> tuple[int, int]:
        return self.rank, 2 * self.cp - 1 - self.rank

    @property
    def starts(self) -> tuple[int, int]:
        return tuple(c * self.L for c in self.chunks)

    def owner(self, chunk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(CP rank, slot 0|1) holding each chunk id in `chunk`."""
        late = chunk >= self.cp
        return torch.where(late, 2 * self.cp - 1 - chunk, chunk), late.long()

    def positions(self, device=None) -> torch.Tensor:
        """Global position of each local row, [2L] int64."""
        return torch.cat([torch.arange(g, g + self.L, device=device) for g in self.starts])

    @classmethod
    def local(cls, S_local: int) -> "CPSplit":
        """This rank's split of a sequence of which it holds S_local positions."""
        from megatron.core import parallel_state as ps
        cp = ps.get_context_parallel_world_size()
        return cls(cp, ps.get_context_parallel_rank(), S_local * cp)


def _cp_group():
    from megatron.core import parallel_state as ps
    return ps.get_context_parallel_group()


def cp_size() -> int:
    from megatron.core import parallel_state as ps
    return ps.get_context_parallel_world_size() if ps.model_parallel_is_initialized() else 1


def cp_slice(x: torch.Tensor) -> torch.Tensor:
    """This CP rank's positions of a [B, S, ...] tensor every rank holds whole (ids, labels, masks)."""
    cp = cp_size()
    if cp == 1:
        return x
    sp = CPSplit.local(x.shape[1] // cp)
    return torch.cat([x[:, g:g + sp.L] for g in sp.starts], dim=1)


class _CPAllGather(torch.autograd.Function):
    """x [n, ...] -> [CP, n, ...], every CP rank's x. Each rank's copy of another rank's rows feeds its
    own part of the loss, so the gradient of a rank's x is the SUM over CP of the gradients of its copies:
    backward is a reduce-scatter."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        n = dist.get_world_size(group)
        x = x.contiguous()
        out = torch.empty((n * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
        dist.all_gather_into_tensor(out, x, group=group)   # gloo and NCCL both want the flat dim-0 layout
        return out.view((n,) + tuple(x.shape))

    @staticmethod
    def backward(ctx, grad):
        n = grad.shape[0]
        grad = grad.contiguous().view((n * grad.shape[1],) + tuple(grad.shape[2:]))
        out = torch.empty((grad.shape[0] // n,) + tuple(grad.shape[1:]), dtype=grad.dtype, device=grad.device)
        dist.reduce_scatter_tensor(out, grad, group=ctx.group)
        return out, None


def cp_all_gather(x: torch.Tensor) -> torch.Tensor:
    """[n, ...] -> [CP, n, ...] with the reduce-scatter backward (see _CPAllGather)."""
    return _CPAllGather.apply(x, _cp_group())


def cp_all_reduce_nograd(x: torch.Tensor) -> torch.Tensor:
    """Sum over the CP group, outside autograd (counts)."""
    if cp_size() == 1:
        return x
    x = x.detach().clone()
    dist.all_reduce(x, group=_cp_group())
    return x


# ================================================================================================ marks
def mark_tp(param: torch.Tensor, dim: int) -> torch.Tensor:
    """`param` holds 1/TP of the logical tensor along `dim` (megatron's tensor-parallel attributes)."""
    from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes
    set_tensor_model_parallel_attributes(param, True, dim, 1)
    return param


def mark_replicated(param: torch.Tensor) -> torch.Tensor:
    """Every TP rank holds the whole tensor and a partial gradient: finalize sums it over TP."""
    param.sequence_parallel = True
    return param


def mark_expert(param: torch.Tensor) -> torch.Tensor:
    """A routed-expert parameter: gradients reduce over the expert-data-parallel group."""
    param.allreduce = False
    return param


def shard_index(param: torch.Tensor, full_shape: tuple[int, ...], ranks: Ranks) -> tuple[slice, ...]:
    """The slice of the logical (checkpoint) tensor this rank's `param` holds."""
    idx = [slice(None)] * len(full_shape)
    if getattr(param, "tensor_model_parallel", False):
        dim = param.partition_dim
        rank = ranks.etp_rank if not getattr(param, "allreduce", True) else ranks.tp_rank
        n = param.shape[dim]
        if n * (ranks.etp if not getattr(param, "allreduce", True) else ranks.tp) != full_shape[dim]:
            raise ValueError(f"shard of {tuple(param.shape)} along dim {dim} does not tile {full_shape}")
        idx[dim] = slice(rank * n, (rank + 1) * n)
    elif tuple(param.shape) != tuple(full_shape):
        raise ValueError(f"parameter of shape {tuple(param.shape)} does not match the checkpoint's {full_shape}")
    return tuple(idx)


def sharded_tensor(key: str, param: torch.Tensor, ranks: Ranks, copy_index: int = 0):
    """A megatron ShardedTensor for `param` under checkpoint key `key` (the official name). `copy_index`
    > 0 marks an extra copy of a tensor another stage owns (the MTP's embedding on the last stage)."""
    from megatron.core.dist_checkpointing import ShardedTensor
    expert = not getattr(param, "allreduce", True)
    offsets = []
    if getattr(param, "tensor_model_parallel", False):
        rank, size = (ranks.etp_rank, ranks.etp) if expert else (ranks.tp_rank, ranks.tp)
        offsets.append((param.partition_dim, rank, size))
        tp_replica = 0
    else:
        tp_replica = 0 if expert else ranks.tp_rank   # whole experts are unique across TP when EP spans it
    # CP ranks hold identical replicas too: without the CP coordinate two ranks would claim the same replica
    replica_id = (copy_index, tp_replica, ranks.edp_rank if expert else ranks.dp_cp_rank)
    return ShardedTensor.from_rank_offsets(key, param, *offsets, replica_id=replica_id)
