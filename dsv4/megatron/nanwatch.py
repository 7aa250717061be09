"""Where a non-finite value comes from: the training monitor, planted faults, and replay forensics.

* `NonFiniteMonitor` names the first non-finite module of a step: hooks on every module fold "is this output (or
  the gradient reaching it) non-finite?" into one running-minimum tensor (no host sync per module), and after the
  step one `.item()` per phase names the first event (exit 16, `nonfinite.json`). The hooks cost a reduction
  per module output and gradient (thousands of small kernels a step), so by default the trainer attaches them
  only to run a non-finite step again, before any update (`TrainConfig.nonfinite_locate`).
* `PlantSpec` is the fault injection the tests and the staged bisect (`v4 nan bisect`) use: a NaN in one module's
  output or gradient at one step, optionally only under a condition (the TileLang attention, FP8 quantisation,
  bf16, recompute, a parallel layout, or rows holding one token), so that a ladder of switches has a right answer.
* `Forensics` runs only when a captured step is replayed: a host sync per module buys the first non-finite tensor
  with its micro-batch, rows, NaN/Inf counts, and the largest values feeding it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

PLANT_ENV = "V4_PLANT_NAN"
CONDITIONS = ("impl=tilelang", "impl=torch", "fp8", "bf16", "recompute", "tp>1", "ep>1", "pp>1", "world>1", "token=N")


@dataclass
class PlantSpec:
    """Make `module`'s output (or the gradient reaching it) NaN at optimizer step `step`, when every condition in
    `when` holds. From V4_PLANT_NAN="MODULE:STEP[:forward|backward][@COND,...]", e.g. "layers.1.attn:3",
    "layers.1.attn:3@impl=tilelang", "layers.2.ffn:2:backward@tp>1", "layers.0.attn:1@token=77" (only the rows
    holding token 77 turn NaN). Several plants are separated by ";"."""
    module: str
    step: int
    phase: str = "forward"
    when: tuple[str, ...] = ()

    @classmethod
    def parse(cls, spec: str) -> "PlantSpec":
        spec, _, conds = spec.strip().partition("@")
        parts = spec.split(":")
        when = tuple(c.strip() for c in conds.split(",") if c.strip())
        bad = [c for c in when if c not in CONDITIONS[:-1] and not (c.startswith("token=") and c[6:].isdigit())]
        if len(parts) not in (2, 3) or not parts[1].isdigit() or (len(parts) == 3 and parts[2] not in ("forward", "backward")) \
                or bad:
            raise ValueError(f"{PLANT_ENV}={spec + ('@' + conds if conds else '')!r}: expected "
                             f"MODULE:STEP[:forward|backward][@COND,...] with COND one of {', '.join(CONDITIONS)}, "
                             f"e.g. layers.1.attn:3@impl=tilelang" + (f" (unknown: {', '.join(bad)})" if bad else ""))
        return cls(parts[0], int(parts[1]), parts[2] if len(parts) == 3 else "forward", when)

    @classmethod
    def from_env(cls) -> "list[PlantSpec]":
        """Every plant in V4_PLANT_NAN; several are separated by ';' (two faults, each with its own condition)."""
        return [cls.parse(p) for p in os.environ.get(PLANT_ENV, "").split(";") if p.strip()]

    def holds(self, facts: dict) -> bool:
        """Whether the run-wide conditions hold (`token=` is decided per row, in the hook)."""
        for c in self.when:
            if c.startswith("token="):
                continue
            if c.startswith("impl="):
                ok = facts["impl"] == c[5:]
            elif c.endswith(">1"):
                ok = facts[c[:-2]] > 1
            else:
                ok = bool(facts[c])
            if not ok:
                return False
        return True

    @property
    def token(self) -> int | None:
        return next((int(c[6:]) for c in self.when if c.startswith("token=")), None)


def run_facts(cfg, layout, recompute: str, world: int) -> dict:
    """What a plant's conditions are decided on: the model's switches and the parallel layout."""
    return {"impl": cfg.attn_impl, "bf16": cfg.dtype == "bf16", "recompute": recompute == "full",
            "fp8": bool(cfg.qat_kv_fp8 or cfg.qat_indexer_fp4 or cfg.fp8_gemm_inputs or cfg.mxfp4_experts
                        or cfg.qat_rollout_fp8),
            "tp": layout.tp, "ep": layout.ep, "pp": layout.pp, "world": world}


def _rows_with(tokens: torch.Tensor | None, token: int | None, out: torch.Tensor) -> torch.Tensor | None:
    """A [rows] bool mask of the output's leading (batch) dim for the rows holding `token`; None = every row."""
    if token is None or tokens is None:
        return None
    rows = (tokens == token).any(-1)
    if out.dim() and out.shape[0] == rows.shape[0]:
        return rows.to(out.device)
    return rows.any().reshape(1).to(out.device)       # not batch-major: all or nothing


class NonFiniteMonitor:
    """Finds the first module whose output (forward) or gradient (backward) is not finite.

    Each module's forward hook appends the module name to a per-step list and folds "is this output
    non-finite?" into one running-minimum tensor (no host sync per module); a hook on the output
    tensor and one on each parameter do the same for gradients. After the step one `.item()` per
    phase tells which event came first."""

    BIG = 1 << 62

    def __init__(self, stage, plants: list[PlantSpec], facts: dict | None = None):
        self.stage, self.step_no = stage, 0
        self.plants = [p for p in plants if p.holds(facts or {})]
        self.tokens: torch.Tensor | None = None      # the current micro-batch's input ids (token= plants)
        self.handles = []                            # the planted faults' hooks: for the trainer's lifetime
        self.watching: list = []                     # the monitor's hooks while attached
        self.reset()
        mods = dict(stage.named_modules())
        for plant in plants:
            if plant.module not in mods and plant.module != "" and self._plant_here(stage, plant.module):
                raise ValueError(f"{PLANT_ENV}: no module named {plant.module!r}; names look like "
                                 f"'layers.1.attn', 'layers.0.ffn.experts.3.w1', 'head'")
        for plant in self.plants:
            if plant.module and plant.module in mods:
                self.handles.append(mods[plant.module].register_forward_hook(self._planter(plant)))

    @property
    def attached(self) -> bool:
        return bool(self.watching)

    def attach(self) -> None:
        """Hooks on every module output, module-output gradient and parameter gradient. Registered after the
        planted faults' hooks, so that a module's own planted NaN is seen at that module."""
        if self.watching:
            return
        for name, mod in self.stage.named_modules():
            if name:
                self.watching.append(mod.register_forward_hook(self._forward_hook(name)))
        for name, p in self.stage.named_parameters():
            if p.requires_grad:
                self.watching.append(p.register_hook(self._grad_hook(name.rsplit(".", 1)[0] or name, "param_grad")))

    def detach(self) -> None:
        for h in self.watching:
            h.remove()
        self.watching.clear()

    def close(self) -> None:
        self.detach()
        for h in self.handles:
            h.remove()
        self.handles.clear()

    @staticmethod
    def _plant_here(stage, module: str) -> bool:
        """Whether this rank should hold `module` (a layer on another pipeline stage is not an error)."""
        if module.startswith("layers."):
            return module.split(".")[1] in stage.layers
        if module.startswith(("mtp.", "head", "norm")):
            return stage.ranks.last_stage
        if module.startswith("embed"):
            return stage.ranks.first_stage
        return True

    def reset(self) -> None:
        self.events: dict[str, list[tuple[str, str]]] = {"forward": [], "backward": []}
        self.first = {"forward": None, "backward": None}

    def _record(self, phase: str, name: str, kind: str, tensors, neg_inf_ok: bool = False) -> None:
        bad = None
        for t in tensors:
            if torch.is_tensor(t) and t.is_floating_point():
                b = (torch.isnan(t) | torch.isposinf(t)).any() if neg_inf_ok else ~torch.isfinite(t).all()
                bad = b if bad is None else bad | b
        if bad is None:
            return
        seq = len(self.events[phase])
        self.events[phase].append((name, kind))
        hit = torch.where(bad, seq, self.BIG)
        self.first[phase] = hit if self.first[phase] is None else torch.minimum(self.first[phase], hit)

    def _forward_hook(self, name: str):
        def hook(mod, args, out):
            outs = out if isinstance(out, (tuple, list)) else (out,)
            # modules whose output carries -inf by design (masked scores) mark themselves
            self._record("forward", name, "output", outs, getattr(mod, "masked_logits_output", False))
            for t in outs:
                if torch.is_tensor(t) and t.requires_grad:
                    t.register_hook(self._grad_hook(name, "grad_output"))
        return hook

    def _grad_hook(self, name: str, kind: str):
        def hook(grad):
            self._record("backward", name, kind, (grad,))
        return hook

    def _planter(self, plant: PlantSpec):
        def hook(mod, args, out):
            if self.step_no != plant.step or not torch.is_tensor(out):
                return None
            rows = _rows_with(self.tokens, plant.token, out)
            if rows is not None and not bool(rows.any()):
                return None

            def poison(t):
                if rows is None:
                    return t + float("nan")
                shape = (-1,) + (1,) * (t.dim() - 1)
                return torch.where(rows.reshape(shape), t + float("nan"), t)
            if plant.phase == "forward":
                return poison(out)
            if out.requires_grad:
                out.register_hook(poison)
            return None
        return hook

    def first_event(self, phase: str) -> tuple[int, str, str] | None:
        f = self.first[phase]
        if f is None:
            return None
        seq = int(f.item())
        if seq >= self.BIG:
            return None
        name, kind = self.events[phase][seq]
        return seq, name, kind


# ================================================================================================ forensics
def _describe(t: torch.Tensor, top: int, neg_inf_ok: bool = False) -> dict:
    """Shape, dtype, NaN/Inf counts and the largest finite magnitudes of one tensor."""
    f = t.detach().float()
    fin = torch.isfinite(f)
    d = {"shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", ""),
         "nan": int(torch.isnan(f).sum()), "posinf": int(torch.isposinf(f).sum()),
         "neginf": int(torch.isneginf(f).sum()), "numel": t.numel()}
    vals = f[fin].abs()
    if vals.numel():
        k = min(top, vals.numel())
        d["absmax"] = float(vals.max())
        d["top_abs"] = [float(v) for v in vals.topk(k).values]
    d["bad"] = d["nan"] + d["posinf"] + (0 if neg_inf_ok else d["neginf"])
    return d


@dataclass
class Forensics:
    """The first non-finite tensor of a replayed step, forward and backward, with its context. A host sync per
    module output and gradient: for replays of one step, not for training."""
    top: int = 5
    batch_rows: int = 0                               # the micro-batch size: dim 0 of batch-major tensors
    found: dict = field(default_factory=dict)         # phase -> the first event
    micro_batch: int = -1
    handles: list = field(default_factory=list)

    def attach(self, stage) -> "Forensics":
        self.handles.append(stage.register_forward_pre_hook(self._next_micro_batch))
        for name, mod in stage.named_modules():
            if name:
                self.handles.append(mod.register_forward_hook(self._forward(name)))
        for name, p in stage.named_parameters():
            if p.requires_grad:
                self.handles.append(p.register_hook(self._grad(name, "param_grad", p)))
        return self

    def detach(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()

    def _next_micro_batch(self, mod, args):
        self.micro_batch += 1

    def _rows(self, t: torch.Tensor) -> list[int] | None:
        """Rows of the micro-batch holding a non-finite value (for batch-major tensors)."""
        if not self.batch_rows or t.dim() < 2 or t.shape[0] != self.batch_rows:
            return None
        bad = ~torch.isfinite(t.detach().float()).flatten(1).all(-1)
        return [int(i) for i in bad.nonzero().flatten()]

    def _forward(self, name: str):
        def hook(mod, args, out):
            if "forward" in self.found:
                return
            neg_ok = getattr(mod, "masked_logits_output", False)
            outs = [t for t in (out if isinstance(out, (tuple, list)) else (out,))
                    if torch.is_tensor(t) and t.is_floating_point()]
            described = [_describe(t, self.top, neg_ok) for t in outs]
            bad = [i for i, d in enumerate(described) if d["bad"]]
            if not bad:
                for t in outs:
                    if t.requires_grad:
                        t.register_hook(self._grad(name, "grad_output", None))
                return
            inputs = [_describe(a, self.top) for a in args if torch.is_tensor(a) and a.is_floating_point()]
            # non-finite parameters first, then the largest
            params = sorted(((n, _describe(p, self.top)) for n, p in mod.named_parameters(recurse=True)),
                            key=lambda x: (x[1]["bad"] == 0, -x[1].get("absmax", 0.0)))
            kind = ("parameter" if any(d["bad"] for _, d in params) else
                    "input" if any(d["bad"] for d in inputs) else "output")
            self.found["forward"] = {
                "module": name, "kind": kind, "micro_batch": self.micro_batch, "rows": self._rows(outs[bad[0]]),
                "output": described[bad[0]], "inputs": inputs,
                "params": [{"name": n, **d} for n, d in params[:3]]}
        return hook

    def _grad(self, name: str, kind: str, param):
        def hook(grad):
            if "backward" in self.found or not torch.is_tensor(grad):
                return
            d = _describe(grad, self.top)
            if d["bad"]:
                self.found["backward"] = {"module": name.rsplit(".", 1)[0] if param is not None else name,
                                          "kind": kind, "micro_batch": self.micro_batch,
                                          "rows": self._rows(grad) if param is None else None, "gradient": d}
        return hook
