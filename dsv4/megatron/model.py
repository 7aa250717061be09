"""One pipeline stage of DeepSeek-V4 as a megatron-core module, and the model provider.

A stage holds the global layers the layout gives it (named `layers.{global id}`), the embedding on the
first stage and, on the last, hc_head, the final norm, the vocab-parallel head and the MTP blocks.
Stages exchange the hc residual streams through megatron's pipeline schedules as [S/(CP*TP), B, hc*dim]
(the shape the schedules allocate: sequence, micro-batch, "hidden" = hc*dim). With CP > 1 each stage is
given the whole micro-batch and keeps its CP rank's positions (parallel.CPSplit).

The last stage's losses (LM, MTP, RL's scored log-probabilities) run the head GEMM then the cross-entropy, or both as
one chunked function where ModelConfig.head_loss = "fused" can run (DSV4Stage.fused_head_loss;
dsv4/kernels/head_loss.py).

Parameter names are the official checkpoint names on every rank, so `sharded_state_dict` and
`load_weights` map names one to one; only the slice each rank holds differs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

from dsv4 import model as ref
from dsv4.config import ModelConfig
from dsv4.kernels.head_loss import linear_cross_entropy
from dsv4.megatron.layers import (ParallelBlock, ParallelMTPBlock, SPRMSNorm, VocabParallelEmbedding,
                                  column_linear, region)
from dsv4.megatron.parallel import Layout, Ranks, cp_slice, mark_replicated, shard_index, sharded_tensor, sp_gather


@dataclass(frozen=True)
class Objective:
    """What the training loss adds to next-token cross-entropy (all per loss token):
    mtp_coeff * the MTP blocks' cross-entropy, and cfg.indexer_loss_coeff * the indexer KL loss
    (mean over ratio-4 layers). Parts with a zero coefficient are not computed and their parameters
    are frozen (no gradient, no weight decay)."""
    mtp_coeff: float = 0.0
    indexer_coeff: float = 0.0


def transformer_config(cfg: ModelConfig, layout: Layout):
    """The TransformerConfig megatron's DDP, optimizer and schedules read. Only its parallel sizes,
    dtypes and the pipeline message width matter: our modules do not read it."""
    from megatron.core.transformer import TransformerConfig
    dt = ref.torch_dtype(cfg)
    return TransformerConfig(
        num_layers=cfg.n_layers, hidden_size=cfg.hc_mult * cfg.dim, num_attention_heads=cfg.n_heads,
        tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
        context_parallel_size=layout.cp,      # the schedules' stream shapes are S / (CP * TP)
        expert_model_parallel_size=layout.ep, expert_tensor_parallel_size=layout.etp,
        sequence_parallel=layout.tp > 1, params_dtype=dt, pipeline_dtype=dt, bf16=dt == torch.bfloat16,
        num_moe_experts=cfg.n_routed_experts, moe_router_topk=cfg.n_activated_experts,
        moe_ffn_hidden_size=cfg.moe_inter_dim, add_bias_linear=False,
        calculate_per_token_loss=True,       # grads are sums over loss tokens, divided once by the global count
        use_cpu_initialization=True, batch_p2p_comm=False,
        hidden_dropout=0.0, attention_dropout=0.0)


class DSV4Stage(nn.Module):
    """The layers of one pipeline stage. forward(ids, labels, loss_mask):
    * first/middle stages return the streams for the next stage, [S/(CP*TP), B, hc*dim];
    * the last stage returns sums over this micro-batch's loss tokens, [lm_ce_sum, mtp_ce_sum] (fp32); under
      CP over this rank's positions only (the trainer adds the CP ranks up)."""

    def __init__(self, cfg: ModelConfig, layout: Layout, ranks: Ranks, objective: Objective, config=None):
        super().__init__()
        self.config = config if config is not None else transformer_config(cfg, layout)
        self.cfg, self.layout, self.ranks, self.objective = cfg, layout, ranks, objective
        # attributes megatron's schedules and finalize_model_grads look up on the model
        self.pre_process, self.post_process = ranks.first_stage, ranks.last_stage
        self.share_embeddings_and_output_weights = False
        from megatron.core.enums import ModelType
        self.model_type = ModelType.encoder_or_decoder

        self.train_mtp = objective.mtp_coeff > 0 and cfg.n_mtp_layers > 0
        self.layer_ids = layout.stage_layer_ids(cfg, ranks.pp_rank)
        self.n_indexer_layers = sum(cfg.layer_ratio(i) == 4 for i in range(cfg.n_layers))
        if ranks.first_stage or (ranks.last_stage and self.train_mtp):
            self.embed = VocabParallelEmbedding(cfg, ranks)
            if not ranks.first_stage:
                self.embed.weight.shared = True   # a copy of stage 0's: the grad norm counts it once
        self.layers = nn.ModuleDict({str(i): ParallelBlock(i, cfg, ranks) for i in self.layer_ids})
        if ranks.last_stage:
            self.mtp = nn.ModuleDict({str(k): ParallelMTPBlock(cfg.n_layers + k, cfg, ranks)
                                      for k in range(cfg.n_mtp_layers)})
            self.norm = SPRMSNorm(cfg, cfg.dim)
            self.head = column_linear(cfg.dim, cfg.vocab_size, torch.float32, ranks.tp)
            hc = cfg.hc_mult
            self.hc_head_fn = mark_replicated(nn.Parameter(torch.empty(hc, hc * cfg.dim)))
            self.hc_head_base = mark_replicated(nn.Parameter(torch.empty(hc)))
            self.hc_head_scale = mark_replicated(nn.Parameter(torch.empty(1)))
        self._freeze_untrained()
        ref.set_qat_points(self, cfg)     # the reference model's QAT points, by the same official names
        self.input_tensor: torch.Tensor | None = None
        self.recompute = False            # full activation recomputation per block (Trainer sets it)

    def _freeze_untrained(self) -> None:
        for name, p in self.named_parameters():
            if (name.startswith("mtp.") and not self.train_mtp) or \
               (".indexer." in name and self.objective.indexer_coeff <= 0):
                p.requires_grad_(False)

    # ---------------------------------------------------------------------------------- pipeline glue
    def set_input_tensor(self, tensor) -> None:
        self.input_tensor = tensor[0] if isinstance(tensor, (list, tuple)) else tensor

    def shared_embedding_or_output_weight(self):
        """The embedding copy the last stage keeps for MTP (its gradient is summed with stage 0's)."""
        return self.embed.weight if hasattr(self, "embed") else None

    def _streams_in(self, B: int) -> torch.Tensor:
        S, _, width = self.input_tensor.shape
        return self.input_tensor.view(S, B, self.cfg.hc_mult, width // self.cfg.hc_mult).transpose(0, 1).contiguous()

    @staticmethod
    def _streams_out(X: torch.Tensor) -> torch.Tensor:
        B, S = X.shape[:2]
        return X.transpose(0, 1).reshape(S, B, -1).contiguous()

    # ---------------------------------------------------------------------------------- forward
    def forward(self, ids: torch.Tensor, labels: torch.Tensor | None = None,
                loss_mask: torch.Tensor | None = None, aux_weight: float | None = None,
                score: dict | None = None) -> torch.Tensor:
        """ids/labels/loss_mask [B, S] (every stage gets the whole micro-batch). aux_weight: weight of each
        ratio-4 layer's indexer loss in the backward (None: not computed). score = {"temperature": float,
        "allowed": [V] bool | None} makes the last stage return the log-probability of each label under
        logits / temperature over the allowed tokens, [B, S] fp32 (RL: how the rollout engine sampled)."""
        cfg = self.cfg
        full_ids, full_labels, full_mask = ids, labels, loss_mask
        if self.ranks.cp > 1:
            if score is not None:
                raise NotImplementedError("scoring (RL log-probabilities) under context parallelism: run RL with CP=1")
            # the MTP targets are shifts of the WHOLE sequence, taken before the split (see below)
            ids, labels, loss_mask = (None if t is None else cp_slice(t) for t in (ids, labels, loss_mask))
        if self.ranks.first_stage:
            X = self.embed(ids).unsqueeze(2).repeat(1, 1, cfg.hc_mult, 1)
        else:
            X = self._streams_in(ids.shape[0])
        for layer in self.layers.values():
            if self.recompute and torch.is_grad_enabled():
                # keep only each block's input; its activations are recomputed in backward
                X = torch.utils.checkpoint.checkpoint(layer, X, ids, aux_weight, use_reentrant=False)
            else:
                X = layer(X, ids, aux_weight)
        if not self.ranks.last_stage:
            return self._streams_out(X)
        head = (self.hc_head_fn, self.hc_head_scale, self.hc_head_base, self.norm)
        if score is not None:
            return -self.head_loss(X, *head, labels, score)
        lm = (self.head_loss(X, *head, labels) * loss_mask).sum()
        mtp = torch.zeros((), device=lm.device)
        if self.train_mtp:
            H = X
            for k, blk in enumerate(self.mtp.values()):
                # block k: position t sees token t+k+1 and predicts token t+k+2 = labels[t+k+1]
                H = blk(H, cp_slice(_shift(full_ids, k + 1)), self.embed, aux_weight)
                mtp = mtp + (self.head_loss(H, blk.hc_head_fn, blk.hc_head_scale, blk.hc_head_base, blk.norm,
                                            cp_slice(_shift(full_labels, k + 1)))
                             * cp_slice(_shift(full_mask, k + 1))).sum()
        return torch.stack([lm, mtp])

    def _head_input(self, X, fn, scale, base, norm) -> torch.Tensor:
        """The head's input [B, S, dim]: the final norm's output of the streams X [B, S/TP, hc, dim], gathered."""
        y = region(self.cfg, "hc", X).head(X, fn, scale, base, self.cfg.hc_eps, self.cfg.norm_eps)
        return sp_gather(norm(y))

    def head_logits(self, X, fn, scale, base, norm) -> torch.Tensor:
        """Vocab-parallel logits [B, S, V/TP] (fp32) of the streams X [B, S/TP, hc, dim]."""
        return ref.fp32_linear(self._head_input(X, fn, scale, base, norm), self.head.weight, self.cfg)

    def fused_head_loss(self, X: torch.Tensor) -> bool:
        """Whether head_loss runs the head GEMM and the cross-entropy as one function (dsv4/kernels/head_loss.py):
        cfg.head_loss "fused" at TP = 1 on CUDA with the bf16x3_fwd head GEMM; every other case runs them eagerly."""
        return (self.cfg.head_loss == "fused" and self.ranks.tp == 1 and X.is_cuda
                and self.cfg.fp32_gemm == "bf16x3_fwd")

    def head_loss(self, X, fn, scale, base, norm, labels: torch.Tensor, score: dict | None = None) -> torch.Tensor:
        """Per-token cross-entropy [B, S] (fp32) of `labels` under the head's logits of the streams X, scored as
        `score` says (see forward) when given."""
        if self.fused_head_loss(X):
            t, allowed = self._score_args(score)
            return linear_cross_entropy(self._head_input(X, fn, scale, base, norm), self.head.weight, labels,
                                        t, allowed)
        logits = self.head_logits(X, fn, scale, base, norm)
        if score is not None:
            logits = self._scored_logits(logits, score)
        return self.cross_entropy(logits, labels)

    @staticmethod
    def _score_args(score: dict | None) -> tuple[float, torch.Tensor | None]:
        """(temperature, allowed [V] bool or None) of a score dict (None: plain cross-entropy)."""
        if score is None:
            return 1.0, None
        return float(score.get("temperature") or 1.0), score.get("allowed")

    def _scored_logits(self, logits: torch.Tensor, score: dict) -> torch.Tensor:
        """logits / temperature, tokens outside the allowed set pushed to -1e30 (finite: the vocab-parallel
        cross-entropy subtracts a max; exp underflows to 0 exactly, as -inf would)."""
        t, allowed = self._score_args(score)
        logits = logits / t if t != 1.0 else logits
        if allowed is not None:
            n = logits.shape[-1]                                  # this TP rank's vocabulary slice
            part = allowed.to(logits.device)[self.ranks.tp_rank * n:(self.ranks.tp_rank + 1) * n]
            logits = logits.masked_fill(~part, -1e30)
        return logits

    def cross_entropy(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.ranks.tp == 1:
            return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view(labels.shape)
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
        return vocab_parallel_cross_entropy(logits, labels)

    # ---------------------------------------------------------------------------------- weights
    def checkpoint_params(self):
        """(checkpoint key, parameter, copy index) for every parameter of this stage."""
        for name, p in self.named_parameters():
            copy = 1 if name.startswith("embed.") and not self.ranks.first_stage else 0
            yield name, p, copy

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None) -> dict:
        return {prefix + key: sharded_tensor(prefix + key, p, self.ranks, copy)
                for key, p, copy in self.checkpoint_params()}

    @torch.no_grad()
    def load_weights(self, read: Callable[[str, tuple[slice, ...]], torch.Tensor]) -> None:
        """Fill every parameter from `read(official_name, index)` -> the logical tensor's [index] slice."""
        shapes = self.cfg.param_shapes()
        for key, p, _ in self.checkpoint_params():
            if key not in shapes:
                raise KeyError(f"parameter {key} has no entry in ModelConfig.param_shapes(); the model and the "
                               f"checkpoint inventory disagree")
            p.copy_(read(key, shard_index(p, shapes[key], self.ranks)).to(p.dtype))

    def init_weights(self, seed: int) -> None:
        """The reference model's deterministic initialisation (init_param), sliced to this rank."""
        cfg = self.cfg
        shapes = cfg.param_shapes()
        self.load_weights(lambda key, index: ref.init_param(key, shapes[key], cfg, seed)[index])


def _shift(t: torch.Tensor, n: int) -> torch.Tensor:
    """t[:, n:] padded with n zeros at the end (ids: a valid token; masks: excluded)."""
    return torch.cat([t[:, n:], torch.zeros_like(t[:, :n])], dim=1)


def model_provider(cfg: ModelConfig, layout: Layout, objective: Objective, device: str = "cpu") -> DSV4Stage:
    """Build this rank's stage (parallel_state must be initialised for `layout`)."""
    ranks = Ranks.current()
    with torch.device("meta" if device == "meta" else "cpu"):
        stage = DSV4Stage(cfg, layout, ranks, objective)
    return stage.to(device) if device not in ("cpu", "meta") else stage
