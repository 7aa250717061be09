"""DeepSeek-V4 layers with tensor, sequence and expert parallelism.

Each class mirrors one class of dsv4.model and calls its math functions (hc_pre, hc_post, rope_tail,
compress, grouped_output, route via Gate, swiglu via Expert, ...); what is new is only which slice of
each weight a rank holds and where activations are gathered or reduced (see parallel.py for the rules).
Submodules that every TP rank holds whole (Compressor, Indexer, Gate, the q/kv norms) ARE the
reference classes. Module and parameter names are the official ones, with global layer and expert
numbers, so a checkpoint converts by name.

With TP = EP = 1 every layer runs the same operations on the same tensors as the reference, so the
single-process model reproduces it bit for bit. With CP > 1 only attention changes (ParallelAttention's
_forward_cp, cp_attention.py): every other layer is per token and runs on the rank's positions as it is.
"""
from __future__ import annotations

from functools import lru_cache, partial
from typing import Callable, NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from dsv4 import model as ref
from dsv4 import quant
from dsv4.config import ModelConfig
from dsv4.kernels import reference as kref
from dsv4.kernels import triton_sinkhorn
from dsv4.stepmemo import Memo, weight_key
from dsv4.megatron import cp_attention as cpa
from dsv4.megatron.parallel import (CPSplit, Ranks, cp_all_reduce_nograd, mark_expert, mark_replicated, mark_tp,
                                    sp_gather, sp_reduce_scatter, sp_slice, tp_all_gather_nograd)


def _replicate_all(module: nn.Module) -> nn.Module:
    for p in module.parameters():
        mark_replicated(p)
    return module


def column_linear(in_features: int, out_features: int, dtype, tp: int) -> ref.Linear:
    """Output features split over TP (each rank computes its slice of y)."""
    lin = ref.Linear(in_features, out_features // tp, dtype)
    mark_tp(lin.weight, 0)
    return lin


def row_linear(in_features: int, out_features: int, dtype, tp: int) -> ref.Linear:
    """Input features split over TP (each rank computes a partial y; the caller reduces)."""
    lin = ref.Linear(in_features // tp, out_features, dtype)
    mark_tp(lin.weight, 1)
    return lin


class Norm(ref.RMSNorm):
    """The reference RMSNorm, compiled where cfg.compiled names "norm"."""

    def __init__(self, cfg: ModelConfig, dim: int):
        super().__init__(dim, cfg.norm_eps)
        self.cfg = cfg

    def forward(self, x):
        return region(self.cfg, "norm", x)(x, self.weight, self.eps)


class SPRMSNorm(Norm):
    """The norm on a sequence shard: per-token math is unchanged, the weight's gradient is a partial sum over
    this rank's positions, so it is marked for the TP sum."""

    def __init__(self, cfg: ModelConfig, dim: int):
        super().__init__(cfg, dim)
        mark_replicated(self.weight)


class AttachAuxLoss(torch.autograd.Function):
    """Identity on `x` whose backward also sends d(total)/d(aux) = `weight` into `aux`'s graph, so a loss
    computed in the middle of a pipeline stage (the indexer KL loss) trains without travelling to the
    last stage (the same device as megatron's MoEAuxLossAutoScaler)."""

    @staticmethod
    def forward(ctx, x, aux, weight: float):
        ctx.weight = weight
        ctx.save_for_backward(aux)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        (aux,) = ctx.saved_tensors
        return grad, torch.full_like(aux, ctx.weight), None


# ================================================================================================ compiled regions
# Regions of the layers that cfg.compiled sends through torch.compile (inductor) on CUDA. Eagerly each is a chain
# of elementwise ops and small reductions, one kernel (and for big tensors one memory round trip) per op, forward
# and backward; compiled, a few fused kernels. Each is a function of tensors (parameters are arguments), so one
# graph serves every layer. A region may compile a form of its math written for inductor (same math, fp32 sums in
# another order) where the eager form's op is one that inductor leaves to a poorly shaped library kernel.
class HCFunctions(NamedTuple):
    pre: Callable
    post: Callable
    head: Callable


EAGER_HC = HCFunctions(ref.hc_pre, ref.hc_post, ref.hc_head)
FUSABLE_HC = HCFunctions(partial(ref.hc_pre, mixes=ref.hc_mixes_split), ref.hc_post_unrolled,
                         partial(ref.hc_head, mixes=ref.hc_mixes_split))


def q_heads(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float) -> torch.Tensor:
    """Each query head RMS-normed (no weight), then its rope dims rotated."""
    return ref.rope_tail(ref.rms_norm(q, None, eps), cos, sin)


def unrope(o: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return ref.rope_tail(o, cos, sin, inverse=True)


def combine_rows(out: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """fp32 [T, dim]: for each token the sum of its k rows of `out` (the experts' outputs, rows sorted by expert),
    pos [T, k] their rows in ascending expert order, added one after another in that order as the reference loop
    adds them (0 + a = a exactly, so the same bits for the same rows)."""
    rows = out[pos].float()
    acc = rows[:, 0]
    for j in range(1, pos.shape[1]):
        acc = acc + rows[:, j]
    return acc


def spread_rows(g: torch.Tensor, tok: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """combine_rows' gradient: each row gets its token's gradient (tok [T*k]: the token of each sorted row)."""
    return g[tok].to(dtype)


class _Combine(torch.autograd.Function):
    """combine_rows with spread_rows as its backward: a gather and a sum where `index_add` of the fp32 rows into
    zeros took an fp32 copy of every row and atomic adds (in no fixed order on a GPU), and its backward gathered
    fp32 rows to cast them after."""

    @staticmethod
    def forward(ctx, out, pos, tok, fwd, bwd):
        ctx.save_for_backward(tok)
        ctx.bwd, ctx.dtype = bwd, out.dtype
        return fwd(out, pos)

    @staticmethod
    def backward(ctx, g):
        (tok,) = ctx.saved_tensors
        return ctx.bwd(g, tok, ctx.dtype), None, None, None, None


# region -> (its eager form, the cfg.compiled group that compiles it); the form compiled is the eager one unless
# _FUSABLE names another
_REGIONS = {"hc": (EAGER_HC, "hc"), "q_heads": (q_heads, "attn"), "unrope": (unrope, "attn"),
            "gated": (ref.gated, "moe"), "combine": (combine_rows, "moe"), "spread": (spread_rows, "moe"),
            "norm": (ref.rms_norm, "norm")}
_FUSABLE = {"hc": FUSABLE_HC,
            "hc+sinkhorn": FUSABLE_HC._replace(pre=partial(FUSABLE_HC.pre, sinkhorn=triton_sinkhorn.sinkhorn))}


@lru_cache(maxsize=None)
def _compiled(name: str):
    form = _FUSABLE[name] if name in _FUSABLE else _REGIONS[name][0]
    if isinstance(form, HCFunctions):
        return HCFunctions(*(torch.compile(f, dynamic=False) for f in form))
    return torch.compile(form, dynamic=False)


def region(cfg: ModelConfig, name: str, x: torch.Tensor):
    """Region `name`, compiled where cfg.compiled names its group and x is on CUDA, else its eager form."""
    eager, group = _REGIONS[name]
    if group not in cfg.compiled_regions or not x.is_cuda:
        return eager
    if name == "hc" and "sinkhorn" in cfg.compiled_regions and triton_sinkhorn.available(x, cfg.hc_mult):
        return _compiled("hc+sinkhorn")
    return _compiled(name)


# ================================================================================================ embedding
class VocabParallelEmbedding(nn.Module):
    """Rows of the vocabulary split over TP; the partial lookups are summed (and sequence-split)."""

    def __init__(self, cfg: ModelConfig, ranks: Ranks):
        super().__init__()
        self.tp, self.tp_rank = ranks.tp, ranks.tp_rank
        self.rows = cfg.vocab_size // ranks.tp
        self.weight = mark_tp(nn.Parameter(torch.empty(self.rows, cfg.dim, dtype=ref.torch_dtype(cfg))), 0)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [B, S] -> [B, S/TP, dim]."""
        if self.tp == 1:
            return F.embedding(ids, self.weight)
        start = self.tp_rank * self.rows
        outside = (ids < start) | (ids >= start + self.rows)
        out = F.embedding((ids - start).masked_fill(outside, 0), self.weight)
        return sp_reduce_scatter(out.masked_fill(outside.unsqueeze(-1), 0.0))


# ================================================================================================ attention
class ParallelAttention(nn.Module):
    """dsv4.model.Attention with the heads (and their output groups) split over TP. The query/KV
    projections, compressor and indexer are replicated: one latent KV head serves all heads (MQA)."""

    def __init__(self, layer_id: int, cfg: ModelConfig, ranks: Ranks):
        super().__init__()
        self.cfg, self.layer_id, self.tp, self.cp = cfg, layer_id, ranks.tp, ranks.cp
        self.ratio = cfg.layer_ratio(layer_id)
        dt = ref.torch_dtype(cfg)
        tp, H, D = ranks.tp, cfg.n_heads, cfg.head_dim
        self.n_local_heads, self.n_local_groups = H // tp, cfg.o_groups // tp
        self.head_dim, self.softmax_scale = D, D ** -0.5
        self.attn_sink = mark_tp(nn.Parameter(torch.zeros(H // tp, dtype=torch.float32)), 0)
        self.wq_a = ref.Linear(cfg.dim, cfg.q_lora_rank, dt)
        self.q_norm = Norm(cfg, cfg.q_lora_rank)
        self.wq_b = column_linear(cfg.q_lora_rank, H * D, dt, tp)
        self.wkv = ref.Linear(cfg.dim, D, dt)
        self.kv_norm = Norm(cfg, D)
        self.wo_a = column_linear(H * D // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank, dt, tp)
        self.wo_b = row_linear(cfg.o_groups * cfg.o_lora_rank, cfg.dim, dt, tp)
        if self.ratio:
            self.compressor = ref.Compressor(cfg, self.ratio, D)
        if self.ratio == 4:
            self.indexer = ref.Indexer(cfg)
            self.indexer.masked_logits_output = True     # its scores are -inf where an entry is not yet complete
        for name, p in self.named_parameters():
            if not getattr(p, "tensor_model_parallel", False):
                mark_replicated(p)
        self.register_buffer("freqs", ref.layer_rope_freqs(cfg, layer_id), persistent=False)

    def forward(self, x_sp: torch.Tensor, aux_weight: float | None = None) -> torch.Tensor:
        """x_sp [B, S/TP, dim] -> [B, S/TP, dim]. aux_weight: when set (ratio-4 layers), the indexer KL
        loss joins the backward with this weight."""
        cfg = self.cfg
        x = sp_gather(x_sp)
        if self.cp > 1:
            return self._forward_cp(x, aux_weight)
        B, S, _ = x.shape
        cos, sin = ref.rope_cos_sin(self.freqs, torch.arange(S, device=x.device))
        qr = self.q_norm(self.wq_a(x))
        q = self.wq_b(qr).unflatten(-1, (self.n_local_heads, self.head_dim))
        q = region(cfg, "q_heads", q)(q, cos, sin, cfg.norm_eps)
        kv = ref.rope_tail(self.kv_norm(self.wkv(x)), cos, sin)
        if cfg.qat_kv_fp8:
            kv = ref._kv_fp8_qat(kv, cfg.rope_head_dim)
        idx = ref.window_topk_idxs(S, cfg.window_size, x.device).expand(B, -1, -1)
        kv_all, cmp_idx, index_logits = kv, None, None
        if self.ratio:
            kv_all = torch.cat([kv, self.compressor(x, self.freqs)], dim=1)
            if self.ratio == 4:
                cmp_idx, index_logits = self.indexer(x.detach(), qr.detach(), cos, sin, self.freqs)
                idx_c = torch.where(cmp_idx >= 0, cmp_idx + S, -1)
            else:
                idx_c = ref.compress_topk_idxs(S, self.ratio, S, x.device).expand(B, -1, -1)
            idx = torch.cat([idx, idx_c], dim=-1)
        idx = idx.int().contiguous()
        o = ref.sparse_attn(q, kv_all, self.attn_sink, idx, self.softmax_scale, impl=cfg.attn_impl)
        o = region(cfg, "unrope", o)(o, cos, sin)
        out = sp_reduce_scatter(self.wo_b(ref.grouped_output(o, self.wo_a.qat_weight_value(), self.n_local_groups)))
        if aux_weight is not None and index_logits is not None and cmp_idx.shape[-1] > 0:   # as dsv4.model
            out = AttachAuxLoss.apply(out, self.indexer_loss(q, kv_all, idx, cmp_idx, index_logits, S), aux_weight)
        return out

    def indexer_loss(self, q, kv_all, idx, cmp_idx, index_logits, S) -> torch.Tensor:
        """The reference KL loss (compressed rows of kv_all start at row S); its target sums attention over
        ALL heads, so the heads are gathered. Every TP rank then holds the whole loss: its gradient is divided
        by TP because the replicated indexer's gradients are summed over TP. Under CP the loss is a mean over
        the rows of the whole sequence: each rank's mean is weighted by its share of those rows, and DDP's
        sum over CP adds the shares up."""
        with torch.no_grad():
            _, lse = kref.sparse_attn_gather_lse(q, kv_all, self.attn_sink, idx, self.softmax_scale)
            q_all = tp_all_gather_nograd(q.detach(), dim=2)
            lse_all = tp_all_gather_nograd(lse, dim=2)
        loss = ref.indexer_kl_loss(index_logits, cmp_idx, q_all, kv_all[:, S:].detach(), lse_all, self.softmax_scale)
        if self.cp > 1:
            rows = (cmp_idx >= 0).any(-1).sum().to(loss.dtype)
            loss = loss * rows / cp_all_reduce_nograd(rows).clamp(min=1)
        self.last_indexer_loss = loss.detach()
        return loss / self.tp

    # ---------------------------------------------------------------------------------- context parallel
    def _forward_cp(self, x: torch.Tensor, aux_weight: float | None) -> torch.Tensor:
        """forward() on this CP rank's two chunks (x [B, 2L, dim], see cp_attention): the same math at the
        tokens' global positions, with the window and the compressed entries gathered across the split."""
        cfg = self.cfg
        B, S_loc, _ = x.shape
        split = CPSplit.local(S_loc)
        pos = split.positions(x.device)
        cos, sin = ref.rope_cos_sin(self.freqs, pos)
        qr = self.q_norm(self.wq_a(x))
        q = self.wq_b(qr).unflatten(-1, (self.n_local_heads, self.head_dim))
        q = region(cfg, "q_heads", q)(q, cos, sin, cfg.norm_eps)
        ext = cpa.extend_chunks(x, split, cpa.halo_reach(cfg.window_size, self.ratio))
        kv_rows, win, offset = [], [], 0
        for (e, start), g in zip(ext, split.starts):
            ecos, esin = ref.rope_cos_sin(self.freqs, torch.arange(start, start + e.shape[1], device=x.device))
            kv = ref.rope_tail(self.kv_norm(self.wkv(e)), ecos, esin)
            if cfg.qat_kv_fp8:
                kv = ref._kv_fp8_qat(kv, cfg.rope_head_dim)
            kv_rows.append(kv)
            win.append(cpa.window_idxs(g, split.L, split.S, cfg.window_size, start, offset, x.device))
            offset += e.shape[1]
        kv_all = torch.cat(kv_rows, dim=1)
        idx = torch.cat(win).expand(B, -1, -1)
        cmp_idx, index_logits = None, None
        if self.ratio:
            mine = [cpa.chunk_entries(self.compressor, e, start, g, split.L, self.freqs, x.dtype)
                    for (e, start), g in zip(ext, split.starts)]
            cmp = cpa.gather_entries(mine, split, self.ratio, anchor=self.compressor.ape)
            kv_all = torch.cat([kv_all, cmp], dim=1)
            if self.ratio == 4:
                cmp_idx, index_logits = self._indexer_cp(x.detach(), qr.detach(), cos, sin, ext, split)
                idx_c = torch.where(cmp_idx >= 0, cmp_idx + offset, -1)
            else:
                idx_c = cpa.compressed_idxs(pos, self.ratio, cmp.shape[1], offset).expand(B, -1, -1)
            idx = torch.cat([idx, idx_c], dim=-1)
        idx = idx.int().contiguous()
        o = ref.sparse_attn(q, kv_all, self.attn_sink, idx, self.softmax_scale, impl=cfg.attn_impl)
        o = region(cfg, "unrope", o)(o, cos, sin)
        out = sp_reduce_scatter(self.wo_b(ref.grouped_output(o, self.wo_a.qat_weight_value(), self.n_local_groups)))
        if aux_weight is not None and index_logits is not None and cmp_idx.shape[-1] > 0:
            out = AttachAuxLoss.apply(out, self.indexer_loss(q, kv_all, idx, cmp_idx, index_logits, offset),
                                      aux_weight)
        return out

    def _indexer_cp(self, x, qr, cos, sin, ext, split: CPSplit):
        """dsv4.model.Indexer.forward with the keys of every rank's chunks and top-k over all of them.
        x and qr arrive detached, and so do the halo rows its compressor reads."""
        ix, cfg = self.indexer, self.cfg
        q = ix.wq_b(qr).unflatten(-1, (ix.n_heads, ix.head_dim))
        q = ref.hadamard(ref.rope_tail(q, cos, sin))
        if cfg.qat_indexer_fp4:
            q = quant.fp4_act_qdq(q, 32)
        mine = [cpa.chunk_entries(ix.compressor, e.detach(), start, g, split.L, self.freqs, x.dtype)
                for (e, start), g in zip(ext, split.starts)]
        k = cpa.gather_entries(mine, split, 4, anchor=ix.compressor.ape)
        w = ix.weights_proj(x).float() * (ix.head_dim ** -0.5 * ix.n_heads ** -0.5)
        logits = cpa.indexer_logits(q, k, w, split, cfg.attn_impl)
        return kref.indexer_topk(logits, cfg.index_topk), logits


# ================================================================================================ MoE
class _HostOffsets:
    """The groups' ends copied to pinned host memory in the forward, without waiting: the backward's per-expert
    GEMMs need them as host integers, and by the time the backward runs the copy is long done, so reading them
    then waits for that copy alone instead of draining the launch queue (what `offs.tolist()` would do)."""

    def __init__(self, offs: torch.Tensor):
        self.host = torch.empty(offs.shape, dtype=offs.dtype, pin_memory=True)
        self.host.copy_(offs, non_blocking=True)
        self.ready = torch.cuda.Event()
        self.ready.record()
        self._bounds: list[int] | None = None

    def bounds(self) -> list[int]:
        if self._bounds is None:
            self.ready.synchronize()
            self._bounds = [0] + self.host.tolist()
        return self._bounds


_STACKS = Memo("expert stacks")


class _ExpertGemm(torch.autograd.Function):
    """a @ W_e^T for each expert's rows (one grouped GEMM), whose backward adds each expert's weight gradient
    straight into its fp32 `main_grad` (megatron's gradient buffer) with one GEMM per expert accumulating in its
    epilogue (cuBLAS beta = 1), and returns no weight gradient. What it replaces: a grouped GEMM writing bf16
    gradients, then megatron's hook adding each into main_grad, the unvectorised mixed-dtype add that took
    3.3 ms a layer and micro-batch at 32 experts on the H200 (`megatron-core`'s gradient_accumulation_fusion,
    which needs TransformerEngine or apex, does the same for its own linears)."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, offs: torch.Tensor, host: _HostOffsets | None, *weights: torch.Tensor):
        """host None: the weight gradients by one Triton grouped GEMM (moe_impl=grouped_triton), which reads the
        groups' bounds on the device."""
        # [E, out, in], once a step under stepmemo.weights_fixed(): a step's micro-batches read the same weights
        stacked = _STACKS.get(tuple(weight_key(w) for w in weights), lambda: torch.stack(weights))
        ctx.save_for_backward(a, offs, stacked)
        ctx.host, ctx.weights = host, weights
        return torch._grouped_mm(a, stacked.transpose(1, 2), offs=offs)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        a, offs, stacked = ctx.saved_tensors
        da = torch._grouped_mm(dy, stacked, offs=offs) if ctx.needs_input_grad[0] else None
        if ctx.host is None:
            from dsv4.kernels import triton_grouped_wgrad      # imports Triton: only where this path runs
            triton_grouped_wgrad.accumulate(dy.contiguous(), a.contiguous(), offs, [w.main_grad for w in ctx.weights])
            return (da, None, None) + (None,) * len(ctx.weights)
        b = ctx.host.bounds()
        for e, w in enumerate(ctx.weights):
            if b[e + 1] > b[e]:
                torch.addmm(w.main_grad, dy[b[e]:b[e + 1]].t(), a[b[e]:b[e + 1]], out_dtype=torch.float32,
                            out=w.main_grad)
        return (da, None, None) + (None,) * len(ctx.weights)


def _accumulates_in_main_grad(weights: list[torch.Tensor], a: torch.Tensor) -> bool:
    """_ExpertGemm applies: plain bf16 weights (no QAT point between parameter and GEMM) that megatron's DDP gave
    an fp32 main_grad, and a gradient wanted (not under no_grad, as in evaluation)."""
    w = weights[0]
    return (torch.is_grad_enabled() and w.requires_grad and w.dtype == a.dtype
            and getattr(w, "main_grad", None) is not None and w.main_grad.dtype == torch.float32)


class GroupedExperts(nn.Module):
    """Experts' FFNs on rows grouped by expert (offs: each group's end), each of w1, w3, w2 one grouped GEMM over
    all experts (torch._grouped_mm) where the reference runs three GEMMs per expert. The experts' weights are
    stacked into one operand, a copy of the layer's routed weights: under megatron's DDP once a step, for all its
    micro-batches (_ExpertGemm, which also sends the weight gradients straight into main_grad); through their QAT
    points at each call. No
    parameters of its own: the experts stay the reference modules, by their official names."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg

    def forward(self, rows: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, experts: list) -> torch.Tensor:
        host = None

        def gemm(a, name):                       # a @ W^T for each expert's rows, as its Linear would
            nonlocal host
            lin = [getattr(e, name) for e in experts]
            if lin[0].qat_input == "fp8":
                a = quant.fp8_act_qdq(a, 128)
            if (self.cfg.moe_impl in ("grouped", "grouped_triton") and lin[0].qat_weight is None
                    and _accumulates_in_main_grad([m.weight for m in lin], a)):
                if self.cfg.moe_impl == "grouped":
                    host = host or _HostOffsets(offs)
                return _ExpertGemm.apply(a, offs, host, *[m.weight for m in lin])
            stacked = torch.stack([m.qat_weight_value().to(a.dtype) for m in lin]).transpose(1, 2)   # [E, in, out]
            return torch._grouped_mm(a, stacked, offs=offs)
        a, b = gemm(rows, "w1"), gemm(rows, "w3")
        return gemm(region(self.cfg, "gated", a)(a, b, w, experts[0].swiglu_limit, rows.dtype), "w2")


class ParallelMoE(nn.Module):
    """dsv4.model.MoE with routed experts split over EP (token dispatch by all_to_all) and, with ETP = TP,
    each expert's FFN split over TP; the shared expert is split over TP.

    Tokens: with ETP = 1 each rank routes its own sequence shard and experts are whole; with ETP = TP the
    TP group gathers the sequence, every TP rank routes the same tokens and computes its FFN slice."""

    def __init__(self, layer_id: int, cfg: ModelConfig, ranks: Ranks):
        super().__init__()
        self.cfg, self.tp, self.etp = cfg, ranks.tp, ranks.etp
        dt = ref.torch_dtype(cfg)
        self.gate = _replicate_all(ref.Gate(layer_id, cfg))
        self.n_local = cfg.n_routed_experts // ranks.ep
        first = ranks.ep_rank * self.n_local
        self.experts = nn.ModuleDict({str(e): self._expert(cfg, dt, cfg.moe_inter_dim, ranks.etp, cfg.swiglu_limit)
                                      for e in range(first, first + self.n_local)})
        for p in self.experts.parameters():
            mark_expert(p)
        limit = cfg.swiglu_limit if cfg.shared_expert_clamp else 0.0
        self.shared_experts = self._expert(cfg, dt, cfg.moe_inter_dim, ranks.tp, limit)
        self.grouped = GroupedExperts(cfg)

    @staticmethod
    def _expert(cfg, dt, inter: int, split: int, limit: float) -> ref.Expert:
        e = ref.Expert(cfg.dim, inter // split, dt, limit)
        if split > 1:
            mark_tp(e.w1.weight, 0), mark_tp(e.w3.weight, 0), mark_tp(e.w2.weight, 1)
        return e

    def forward(self, x_sp: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x_sp [B, S/TP, dim], ids [B, S] (whole sequence) -> [B, S/TP, dim]."""
        d, dtype = x_sp.shape[-1], x_sp.dtype
        if self.etp > 1:
            x = sp_gather(x_sp)                                            # the TP group shares the tokens
            xt, tok_ids = x.reshape(-1, d), ids.reshape(-1)
        else:
            xt, tok_ids = x_sp.reshape(-1, d), sp_slice(ids).reshape(-1)    # this rank's own tokens
        weights, idx = self.gate(xt, tok_ids)
        self.last_expert_idx = idx.detach()
        y = self.routed(xt, weights, idx)                                  # fp32; partial over TP iff ETP > 1
        if self.tp == 1:
            return (y + self.shared_experts(xt).float()).to(dtype).view(x_sp.shape)
        if self.etp > 1:
            y = y + self.shared_experts(xt).float()
            return sp_reduce_scatter(y.to(dtype).view(x.shape))
        shared = sp_reduce_scatter(self.shared_experts(sp_gather(x_sp)))
        return (y.to(dtype).view(x_sp.shape) + shared)

    def routed(self, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """sum_j w_j expert_{idx_j}(x) for every token, fp32 [T, dim]. Assignments are sorted by expert
        (tokens ascending within an expert), sent to the EP rank that holds the expert, computed there,
        sent back and added up."""
        from megatron.core import parallel_state as ps
        P = ps.get_expert_model_parallel_world_size()
        if P == 1:
            return self._routed_local(x, weights, idx)
        T, k = idx.shape
        E = self.cfg.n_routed_experts
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)
        tok = order // k
        counts = torch.bincount(flat, minlength=E)                         # assignments per expert
        send_x, send_w = x[tok], weights.reshape(-1)[order].unsqueeze(-1)
        from megatron.core.tensor_parallel import all_to_all
        ep_group = ps.get_expert_model_parallel_group()
        send_counts = counts.view(P, self.n_local)                         # row p: experts held by EP rank p
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=ep_group)
        splits_out, splits_in = send_counts.sum(1).tolist(), recv_counts.sum(1).tolist()
        recv_x = all_to_all(ep_group, send_x, splits_in, splits_out)
        recv_w = all_to_all(ep_group, send_w, splits_in, splits_out)
        out = all_to_all(ep_group, self._run_local(recv_x, recv_w, recv_counts), splits_out, splits_in)
        # back in (token, slot) order, then a sum over the k slots: no atomics, so deterministic on GPU
        return out.float()[torch.argsort(order)].view(T, k, -1).sum(1)

    def _routed_local(self, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """EP = 1: the reference loop itself (same ops in the same order, so gradients match bit for bit), or on CUDA
        with moe_impl "grouped" the same sums through grouped GEMMs."""
        if self.cfg.moe_impl.startswith("grouped") and x.is_cuda and x.dtype == torch.bfloat16:   # CUDA kernels: bf16
            return self._routed_grouped(x, weights, idx)
        y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for e in torch.unique(idx).tolist():
            tok, slot = torch.where(idx == e)
            y = y.index_add(0, tok, self.experts[str(e)](x[tok], weights[tok, slot].unsqueeze(-1)).float())
        return y

    def _routed_grouped(self, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """The reference loop's sums through GroupedExperts: assignments sorted by expert, each token's
        contributions added in expert order, as the loop adds them (_Combine), no host sync for the expert counts."""
        T, k = idx.shape
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)
        tok = order // k
        offs = torch.cumsum(torch.bincount(flat, minlength=self.cfg.n_routed_experts), 0).to(torch.int32)
        out = self.grouped(x[tok], weights.reshape(-1)[order].unsqueeze(-1), offs, list(self.experts.values()))
        # each assignment's row in the sorted order; a token's rows ascending = its experts ascending
        pos = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
        pos = pos.view(T, k).sort(-1).values
        return _Combine.apply(out, pos, tok, region(self.cfg, "combine", x), region(self.cfg, "spread", x))

    def _run_local(self, rows: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """rows arrive grouped by source rank, then by local expert (counts [sources, n_local]); regroup by
        expert, run each expert once on all its rows, and restore the arrival order. On CUDA with moe_impl
        "grouped*" the local experts run as EP = 1 runs them (GroupedExperts: the grouped GEMMs, the weight gradients
        into main_grad), which is what `v4 bench step --rank-of` times for an EP rank; else one GEMM an expert."""
        if counts.shape[0] > 1:
            expert_of_row = torch.arange(self.n_local, device=rows.device).repeat(counts.shape[0])
            perm = torch.argsort(torch.repeat_interleave(expert_of_row, counts.reshape(-1)), stable=True)
            rows, w = rows[perm], w[perm]
        # not where a QAT point changes the expert weights (RL with FP8 sync): the grouped form would stack their
        # QAT'd values afresh at every forward, a copy of the local experts a micro-batch in flight, where the loop's
        # GEMMs read the step's stored values (63 GiB more at rl_dryrun's TP8 PP8 EP8 by the cost model)
        if (self.cfg.moe_impl.startswith("grouped") and rows.is_cuda and rows.dtype == torch.bfloat16
                and rows.shape[0] > 0 and next(iter(self.experts.values())).w1.qat_weight is None):
            out = self._run_grouped(rows, w, counts.sum(0))
        else:
            out = self._run_loop(rows, w, counts.sum(0).tolist())
        if counts.shape[0] > 1:
            out = out[torch.argsort(perm)]
        return out

    def _run_grouped(self, rows: torch.Tensor, w: torch.Tensor, per_expert: torch.Tensor) -> torch.Tensor:
        """rows sorted by local expert, per_expert [n_local] their counts (on the device: no host sync)."""
        offs = torch.cumsum(per_expert, 0).to(torch.int32)
        return self.grouped(rows, w, offs, list(self.experts.values()))

    def _run_loop(self, rows: torch.Tensor, w: torch.Tensor, per_expert: list[int]) -> torch.Tensor:
        outs, start = [], 0
        for expert, n in zip(self.experts.values(), per_expert):
            if n:
                outs.append(expert(rows[start:start + n], w[start:start + n]))
            start += n
        return torch.cat(outs) if outs else rows[:0].clone()


# ================================================================================================ blocks
class ParallelBlock(nn.Module):
    """dsv4.model.Block: hyper-connection pre/post around attention and MoE, on sequence shards."""

    def __init__(self, layer_id: int, cfg: ModelConfig, ranks: Ranks):
        super().__init__()
        self.cfg, self.layer_id = cfg, layer_id
        hc, mix = cfg.hc_mult, (2 + cfg.hc_mult) * cfg.hc_mult
        for sub in ("attn", "ffn"):
            self.register_parameter(f"hc_{sub}_fn", mark_replicated(nn.Parameter(torch.empty(mix, hc * cfg.dim))))
            self.register_parameter(f"hc_{sub}_base", mark_replicated(nn.Parameter(torch.empty(mix))))
            self.register_parameter(f"hc_{sub}_scale", mark_replicated(nn.Parameter(torch.empty(3))))
        self.attn = ParallelAttention(layer_id, cfg, ranks)
        self.attn_norm = SPRMSNorm(cfg, cfg.dim)
        self.ffn_norm = SPRMSNorm(cfg, cfg.dim)
        self.ffn = ParallelMoE(layer_id, cfg, ranks)

    def _hc_pre(self, hc: HCFunctions, X, sub):
        c = self.cfg
        return hc.pre(X, getattr(self, f"hc_{sub}_fn"), getattr(self, f"hc_{sub}_scale"),
                      getattr(self, f"hc_{sub}_base"), c.hc_mult, c.hc_sinkhorn_iters, c.hc_eps, c.norm_eps)

    def forward(self, X: torch.Tensor, ids: torch.Tensor, aux_weight: float | None = None) -> torch.Tensor:
        """X [B, S/TP, hc, dim] streams, ids [B, S]."""
        hc = region(self.cfg, "hc", X)
        x, post, comb = self._hc_pre(hc, X, "attn")
        X = hc.post(self.attn(self.attn_norm(x), aux_weight), X, post, comb)
        x, post, comb = self._hc_pre(hc, X, "ffn")
        return hc.post(self.ffn(self.ffn_norm(x), ids), X, post, comb)


class ParallelMTPBlock(ParallelBlock):
    """dsv4.model.MTPBlock. Runs over the whole (sequence-split) length with the next-token ids padded at
    the end: every op is causal or per token, so positions 0..S-2 equal the reference's S-1 positions
    and the padded last one is masked out of the loss."""

    def __init__(self, layer_id: int, cfg: ModelConfig, ranks: Ranks):
        super().__init__(layer_id, cfg, ranks)
        dt = ref.torch_dtype(cfg)
        self.e_proj = ref.Linear(cfg.dim, cfg.dim, dt)
        self.h_proj = ref.Linear(cfg.dim, cfg.dim, dt)
        self.enorm = SPRMSNorm(cfg, cfg.dim)
        self.hnorm = SPRMSNorm(cfg, cfg.dim)
        self.norm = SPRMSNorm(cfg, cfg.dim)
        hc = cfg.hc_mult
        self.hc_head_fn = nn.Parameter(torch.empty(hc, hc * cfg.dim))
        self.hc_head_base = nn.Parameter(torch.empty(hc))
        self.hc_head_scale = nn.Parameter(torch.empty(1))
        for p in (self.e_proj.weight, self.h_proj.weight, self.hc_head_fn, self.hc_head_base, self.hc_head_scale):
            mark_replicated(p)

    def forward(self, H: torch.Tensor, next_ids: torch.Tensor, embed: VocabParallelEmbedding,
                aux_weight: float | None = None) -> torch.Tensor:
        e = self.enorm(embed(next_ids))
        X = self.e_proj(e).unsqueeze(2) + self.h_proj(self.hnorm(H))
        return super().forward(X, next_ids, aux_weight)
