"""One rank of a parallel layout, built on one device: the shapes that rank computes, without the other ranks.

`v4 bench step --rank-of "TP=8 PP=8 EP=8 FIRST=4 LAST=3"` times what rank 0 of that layout computes, and `v4 bench
rollout --rank-of "EP=8"` what one rank of an expert-parallel rollout decodes. A layout gives a rank:
* its pipeline stage's layers. The bench builds a slice of the same length (`slice_layers`): one stage's own layers
  (`--stage N`, first, last), or by default a representative slice ("mixed", as long as the longest stage) that
  holds every attention kind of the model and both routings (hash and score), with the MTP block and the LM head
  that the last stage holds. The slice is a model of its own (`model_config`): its layers keep their kinds
  (compression ratios), the hash-routed ones first, as in the model;
* its local experts, n_routed_experts / EP of them, as a model of that many experts routing top-k. A local expert
  of the layout receives, per micro-batch, EP x (tokens one rank routes) x k / E rows in expectation (every EP rank
  sends it its share); a model of E / EP experts routing the rank's own tokens top-k gives each expert exactly that
  (`tokens_per_expert`). The router's own GEMM is E / EP wide instead of E (0.1 % of a layer at Flash's shapes), and
  imbalance is the model's own over its E / EP experts, not the layout's over E;
* under TP (sequence parallelism always on): its heads (H / TP) and output groups, its slice of the shared expert
  and of the vocabulary, the replicated projections (wq_a, wkv, compressors, indexer) on the whole sequence, and the
  hyper-connections, norms, router and routed experts on its S / TP positions (with ETP = TP the experts' FFN slice
  on the whole sequence). The megatron layers build these shapes from the rank's coordinates (`Ranks`):
  `standin(tp, etp)` gives them TP coordinates while megatron's own groups stay of size one, and replaces the
  sequence-parallel collectives with local stand-ins of the same shapes (a gather repeats the rank's positions, a
  reduce-scatter keeps its own, the backward of each the mirror of it). Its batches draw tokens from its own
  vocabulary slice: the other slices' tokens would embed as zeros (the other ranks' lookups are absent).
What a rank row leaves out, and says so: every collective (TP gathers and reduce-scatters, the EP all-to-all, the
pipeline's sends, DP's gradient reduction), the pipeline bubble, and the distributed optimizer's sharding of Adam's
state over DP; their cost is the layout planner's to add. CP > 1 is not built (its attention exchanges the rows
that cross chunk edges, cp_attention.py), nor a rollout rank under TP (the embedded engine decodes without tensor
parallelism).

The model-FLOP count is dsv4/flops.py's, of the slice at the model's own expert count (`flops_config`); a TP (and CP)
rank does 1/(TP x CP) of the model FLOPs of its tokens (`flops_share`), however much it computes twice.
"""
from __future__ import annotations

import contextlib
import dataclasses
import re
import sys
from dataclasses import dataclass

from dsv4.config import ModelConfig

KEYS = ("TP", "PP", "EP", "ETP", "CP", "DP", "FIRST", "LAST", "LAYOUT")


@dataclass(frozen=True)
class RankLayout:
    """A parallel layout as `v4 bench --rank-of` spells it: "TP=8 PP=8 EP=8", optionally ETP, CP, DP (default: the
    smallest DP that EP x ETP divides DP x CP x TP by) and the pipeline split as the presets give it (FIRST/LAST:
    layers of the first and last stage, PRESET_PP_FIRST_LAYERS/LAST_LAYERS; LAYOUT: PRESET_PP_LAYOUT)."""
    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int = 1
    cp: int = 1
    dp: int = 0
    first: int = 0
    last: int = 0
    layout: str = ""

    @classmethod
    def parse(cls, text: str) -> "RankLayout":
        kw: dict = {}
        for item in text.replace(",", " ").split():
            key, eq, value = item.partition("=")
            key = key.upper()
            if not eq or key not in KEYS or not value:
                raise ValueError(f"--rank-of {text!r}: {item!r} is not KEY=VALUE with KEY one of {', '.join(KEYS)} "
                                 "(e.g. \"TP=8 PP=8 EP=8 FIRST=4 LAST=3\")")
            if key == "LAYOUT":
                kw["layout"] = value
                continue
            if not re.fullmatch(r"\d+", value) or (int(value) < 1 and key not in ("FIRST", "LAST")):
                raise ValueError(f"--rank-of {text!r}: {key}={value} must be a positive integer")
            kw[key.lower()] = int(value)
        lay = cls(**kw)
        if not lay.dp:
            dp = 1
            while (dp * lay.cp * lay.tp) % (lay.ep * lay.etp):
                dp += 1
            lay = dataclasses.replace(lay, dp=dp)
        return lay

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    def __str__(self) -> str:
        parts = [f"TP{self.tp}", f"PP{self.pp}", f"EP{self.ep}"]
        parts += [f"ETP{self.etp}"] if self.etp > 1 else []
        parts += [f"CP{self.cp}"] if self.cp > 1 else []
        return " ".join(parts) + f" (DP{self.dp}, {self.world} GPUs)"


def _kind(cfg: ModelConfig, layer_id: int) -> tuple[str, str]:
    return cfg.attn_kind(layer_id), "hash" if cfg.is_hash_layer(layer_id) else "score"


def slice_layers(cfg: ModelConfig, n: int) -> tuple[list[int], list[tuple[str, str]]]:
    """n real layer ids standing for a stage of n layers: the first layer of each (attention kind, routing) pair the
    model has, in layer order, then the layers after the last of those, in order (the model's own mix). Returns the
    ids and the pairs that did not fit (n smaller than the number of pairs)."""
    first: dict[tuple[str, str], int] = {}
    for i in range(cfg.n_layers):
        first.setdefault(_kind(cfg, i), i)
    ids = sorted(first.values())
    left_out = [k for k, i in first.items() if i in ids[n:]]
    ids = ids[:n]
    nxt = (ids[-1] + 1) if ids else 0
    while len(ids) < n and nxt < cfg.n_layers:
        if nxt not in ids:
            ids.append(nxt)
        nxt += 1
    return ids, left_out


@dataclass(frozen=True)
class RankShape:
    """What rank 0 of `layout` computes, as a model of its own (see the module docstring)."""
    full: ModelConfig            # the model the layout trains
    layout: RankLayout
    stage_layers: tuple[int, ...]
    stage: int | None            # None: the representative ("mixed") slice
    layer_ids: tuple[int, ...]   # the real layers the slice's layers stand for, in order
    mtp: bool                    # the slice holds the MTP block(s) (the last stage does, where MTP trains)
    left_out: tuple[tuple[str, str], ...] = ()

    # ---------------------------------------------------------------------------------- the model
    def slice_overrides(self, experts: int | None = None) -> dict:
        """The model fields that make the slice of the full model (at `experts` routed experts, default the rank's
        local ones): what `model_config` applies, and what the cost model is given as model overrides
        (launcher.costmodel.BenchShape), so that the planner predicts the model the bench builds."""
        full = self.full
        mtp = list(range(full.n_layers, full.n_layers + full.n_mtp_layers)) if self.mtp else []
        return {"n_layers": len(self.layer_ids), "n_mtp_layers": len(mtp),
                "compress_ratios": [full.layer_ratio(i) for i in list(self.layer_ids) + mtp],
                "n_hash_layers": sum(full.is_hash_layer(i) for i in self.layer_ids),
                "n_routed_experts": self.local_experts if experts is None else experts}

    def model_config(self) -> ModelConfig:
        """The slice with the rank's local experts."""
        return self.full.with_overrides(**self.slice_overrides())

    def flops_config(self) -> ModelConfig:
        """The slice at the model's own expert count: what dsv4/flops.py counts model FLOPs of."""
        return self.full.with_overrides(**self.slice_overrides(self.full.n_routed_experts))

    @property
    def flops_share(self) -> float:
        return 1.0 / (self.layout.tp * self.layout.cp)

    @property
    def local_experts(self) -> int:
        return self.full.n_routed_experts // self.layout.ep

    def routed_tokens(self, seq_len: int, micro_batch: int) -> int:
        """Tokens one rank routes a micro-batch: its sequence shard under TP with ETP 1, the whole one with ETP TP."""
        lay = self.layout
        return micro_batch * seq_len // lay.cp // (1 if lay.etp > 1 else lay.tp)

    def tokens_per_expert(self, seq_len: int, micro_batch: int) -> float:
        """Rows a local expert receives a micro-batch, in expectation (EP ranks x tokens a rank routes x k / E)."""
        return self.routed_tokens(seq_len, micro_batch) * self.full.n_activated_experts / self.local_experts

    # ---------------------------------------------------------------------------------- words
    def stage_name(self) -> str:
        if self.stage is None:
            return "mixed"
        return f"stage {self.stage} of {self.layout.pp}"

    def describe(self, seq_len: int, micro_batch: int, train: bool = True) -> list[str]:
        """Lines for the bench's output: the layout, the slice, the experts and tokens, and what is absent."""
        full, lay = self.full, self.layout
        kinds = ", ".join(f"{i}:{full.attn_kind(i)}{'/hash' if full.is_hash_layer(i) else ''}" for i in self.layer_ids)
        extra = (" + MTP" if self.mtp else "") + " + LM head"
        held = ""
        if self.stage is not None and self.stage != lay.pp - 1:
            held = f" (stage {self.stage} holds no LM head: the slice computes one)"
        experts = f"  {self.local_experts} of {full.n_routed_experts} experts, top-{full.n_activated_experts}: "
        if train:
            experts += (f"{self.tokens_per_expert(seq_len, micro_batch):,.0f} tokens per expert a micro-batch of "
                        f"{micro_batch} x {seq_len} ({self.routed_tokens(seq_len, micro_batch):,} tokens routed by "
                        "the rank)")
        else:
            experts += (f"a decode step of B tokens gives each expert B x {full.n_activated_experts} / "
                        f"{self.local_experts} rows (its EP peers' tokens included)")
        lines = [f"rank 0 of {lay}: {self.stage_name()}, {len(self.layer_ids)} layers [{kinds}]{extra}{held}", experts]
        if lay.tp > 1:
            lines.append(f"  TP{lay.tp}: {full.n_heads // lay.tp} of {full.n_heads} heads, 1/{lay.tp} of the shared "
                         f"expert and the vocabulary, {seq_len // lay.tp} positions between sublayers"
                         + (f"; ETP{lay.etp}: 1/{lay.etp} of each expert's FFN on the whole sequence" if lay.etp > 1
                            else ""))
        if self.left_out:
            lines.append("  left out of the slice (too few layers): "
                         + ", ".join(f"{a}/{r}" for a, r in self.left_out))
        share = f"; model FLOPs are the rank's share, 1/{lay.tp} of its tokens'" if lay.tp > 1 else ""
        lines.append("  communication absent (one device): no TP/EP/PP/DP collectives, no pipeline bubble, no "
                     f"optimizer sharding{share}" if train else
                     "  communication absent (one device): no EP all-to-all; every rank decodes its own batch")
        return lines

    def summary(self, seq_len: int, micro_batch: int, train: bool = True) -> dict:
        """The rank shape as JSON (the bench's report and its records); a rollout rank's rows per expert are its
        decode rows' (batch x k / local experts)."""
        out = {"layout": str(self.layout), "tp": self.layout.tp, "pp": self.layout.pp, "ep": self.layout.ep,
                "etp": self.layout.etp, "cp": self.layout.cp, "dp": self.layout.dp, "world": self.layout.world,
                "stage": self.stage_name(), "stage_layers": list(self.stage_layers),
                "layer_ids": list(self.layer_ids), "mtp": self.mtp,
                "layer_kinds": [f"{self.full.attn_kind(i)}/{'hash' if self.full.is_hash_layer(i) else 'score'}"
                                for i in self.layer_ids],
                "local_experts": self.local_experts, "experts": self.full.n_routed_experts,
                "heads": self.full.n_heads // self.layout.tp,
                "tokens_per_expert": self.tokens_per_expert(seq_len, micro_batch),
                "routed_tokens": self.routed_tokens(seq_len, micro_batch), "seq_len": seq_len,
                "micro_batch": micro_batch, "flops_share": self.flops_share,
                "left_out": [f"{a}/{r}" for a, r in self.left_out], "communication": "absent"}
        if not train:
            for key in ("tokens_per_expert", "routed_tokens", "seq_len", "micro_batch", "flops_share"):
                out.pop(key)
        return out


def rank_shape(full: ModelConfig, layout: RankLayout, stage_layers: tuple[int, ...], stage: str = "mixed",
               layers: int | None = None, train: bool = True, seq_len: int | None = None) -> RankShape:
    """Rank 0's shape of `layout` for the model `full`. stage: "mixed" (default), "first", "last" or a stage number;
    layers: the slice's length instead of the stage's (a stage that does not fit one device's memory, say);
    train=False: a rollout rank (TP 1, no MTP: decoding runs the main layers only)."""
    from dsv4.megatron.parallel import Layout
    Layout(tp=layout.tp, pp=layout.pp, ep=layout.ep, etp=layout.etp, stage_layers=tuple(stage_layers),
           cp=layout.cp).validate(full, layout.world, seq_len)
    if layout.cp > 1:
        raise ValueError(f"CP={layout.cp}: a context-parallel rank's attention exchanges rows across chunk edges, "
                         "which one device does not build; time CP=1 (its cost is the layout planner's)")
    if not train and (layout.tp > 1 or layout.etp > 1):
        raise ValueError(f"TP={layout.tp}: the embedded rollout engine decodes without tensor parallelism; give "
                         "EP (and PP) only")
    if full.n_routed_experts // layout.ep < full.n_activated_experts:
        raise ValueError(f"EP={layout.ep} leaves {full.n_routed_experts // layout.ep} local experts, fewer than "
                         f"top-{full.n_activated_experts}: a model of that many cannot route as the layout does")
    pp = layout.pp
    if stage == "mixed":
        n = layers or max(stage_layers)
        ids, left_out = slice_layers(full, n)
        return RankShape(full, layout, tuple(stage_layers), None, tuple(ids), train and full.n_mtp_layers > 0,
                         tuple(left_out))
    index = {"first": 0, "last": pp - 1}.get(stage)
    if index is None:
        if not re.fullmatch(r"\d+", str(stage)) or int(stage) >= pp:
            raise ValueError(f"--stage {stage!r}: mixed, first, last or a stage number 0..{pp - 1}")
        index = int(stage)
    start = sum(stage_layers[:index])
    ids = list(range(start, start + stage_layers[index]))[:layers or None]
    return RankShape(full, layout, tuple(stage_layers), index, tuple(ids),
                     train and index == pp - 1 and full.n_mtp_layers > 0)


# ================================================================================================ the TP stand-in
def _keep_own(tp: int):
    """sp_reduce_scatter's stand-in: [B, S, ...] partial sums -> this rank's [B, S/TP, ...] (the other ranks' partial
    sums are absent); backward repeats the gradient over the sequence, as the all-gather fills it."""
    import torch

    class KeepOwn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x[:, :x.shape[1] // tp].contiguous()

        @staticmethod
        def backward(ctx, g):
            return g.repeat(1, tp, *([1] * (g.dim() - 2)))
    return KeepOwn.apply


@contextlib.contextmanager
def standin(tp: int, etp: int = 1):
    """Inside: the megatron layers see TP coordinates (tp ranks, this one rank 0; ETP etp) and build rank 0's
    shards, while megatron's process groups stay of size one; the sequence-parallel collectives of
    dsv4.megatron.parallel run as local stand-ins of the same shapes (see the module docstring). Nothing changes
    with tp = 1."""
    if tp == 1 and etp == 1:
        yield
        return
    import torch

    from dsv4.megatron import parallel
    keep = _keep_own(tp)

    def gather(x):                         # [B, S/TP, ...] -> [B, S, ...]; backward sums the copies' gradients
        return x.repeat(1, tp, *([1] * (x.dim() - 2)))

    def reduce_scatter(x):
        return keep(x)

    def slice_(x):
        return x[:, :x.shape[1] // tp]

    def all_gather_nograd(x, dim):
        return torch.cat([x] * tp, dim=dim)

    stand = {"sp_gather": gather, "sp_reduce_scatter": reduce_scatter, "sp_slice": slice_,
             "tp_all_gather_nograd": all_gather_nograd}
    originals = {name: getattr(parallel, name) for name in stand}
    patched = []
    for mod in list(sys.modules.values()):
        if getattr(mod, "__name__", "").startswith("dsv4."):
            for name, fn in originals.items():
                if getattr(mod, name, None) is fn:
                    setattr(mod, name, stand[name])
                    patched.append((mod, name, fn))
    current = parallel.Ranks.__dict__["current"]

    def ranks(cls):
        return dataclasses.replace(current.__func__(cls), tp=tp, tp_rank=0, etp=etp, etp_rank=0)
    parallel.Ranks.current = classmethod(ranks)
    try:
        yield
    finally:
        parallel.Ranks.current = current
        for mod, name, fn in patched:
            setattr(mod, name, fn)
