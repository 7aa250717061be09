"""The check registry: a check is a named function judging one node from the gathered facts."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass(frozen=True)
class CheckResult:
    name: str
    node: str
    status: str          # PASS | WARN | FAIL | SKIP (does not apply here)
    detail: str
    fix: str = ""


@dataclass(frozen=True)
class RequiredInput:
    """A path the run needs before it starts, and the file inside it that marks it complete."""
    path: str
    what: str
    sentinel: str = ""       # relative to `path` ("" = existence is enough)
    fix: str = ""


@dataclass
class Context:
    """What every check sees: the config, each node's facts (or why there are none), the inputs."""
    cfg: Any
    order: list[str]                                   # node names, head first
    facts: dict[str, dict] = field(default_factory=dict)
    errors: dict[str, tuple[str, str]] = field(default_factory=dict)   # node -> (stage, message)
    inputs: list[RequiredInput] = field(default_factory=list)
    token: str = ""                                    # what the head wrote into V4_WORK
    token_error: str = ""
    clock: dict[str, tuple[float, float]] = field(default_factory=dict)  # node -> (offset, uncertainty) s
    ssh_seconds: dict[str, float] = field(default_factory=dict)
    # container mode: V4_CONTAINER on each node's host, as `cluster.container_state` reports it
    containers: dict[str, dict] = field(default_factory=dict)
    where: dict[str, str] = field(default_factory=dict)   # node -> host / container / node: where its facts were read
    # a resumed run: its checkpoints already on disk count toward the room it needs; none if trained
    run_ckpt_gb: float = 0.0
    run_trained: bool = False
    # nccl_pairs: one all-reduce result a ring pair of nodes (probes.nccl_pairs); None: not measured
    pairs: list[dict] | None = None

    @property
    def head(self) -> str:
        return self.order[0]

    def on_host(self, node: str) -> bool:
        """Container mode, but this node's facts come from its host: the container does not run (yet), or is not
        the one `v4 cluster up` would use. The image's software is not visible there."""
        return node in self.facts and self.where.get(node) == "host"

    def majority(self, fn: Callable[[dict], Any], where: Callable[[str], bool] = lambda n: True) -> Any:
        """The most common value of fn(facts) over the nodes with facts (and `where(node)`; ties: the head's)."""
        values = [fn(self.facts[n]) for n in self.order if n in self.facts and where(n)]
        if not values:
            return None
        counts = Counter(map(repr, values))
        best = max(counts.values())
        head_value = fn(self.facts[self.head]) if self.head in self.facts and where(self.head) else None
        if head_value is not None and counts[repr(head_value)] == best:
            return head_value
        return next(v for v in values if counts[repr(v)] == best)


Verdict = tuple[str, str, str] | tuple[str, str] | None


@dataclass(frozen=True)
class Check:
    name: str
    doc: str
    fn: Callable[[str, Context], Verdict]
    needs_facts: bool = True          # False: judged even when the node could not be reached

    def judge(self, node: str, ctx: Context) -> CheckResult | None:
        if self.needs_facts and node not in ctx.facts:
            return None               # the ssh/python check already reports this node as FAIL
        try:
            verdict = self.fn(node, ctx)
        except Exception as e:   # noqa: BLE001 - a broken check is a FAIL, never a silent pass
            verdict = ("FAIL", f"check raised {type(e).__name__}: {e}", "report this as a launcher bug")
        if verdict is None:
            return None
        status, detail, *fix = verdict
        return CheckResult(self.name, node, status, detail, fix[0] if fix else "")


CHECKS: dict[str, Check] = {}


def check(name: str, doc: str, needs_facts: bool = True):
    """Register `fn(node, ctx) -> (status, detail[, fix])` as the check `name` (order = run order)."""
    def register(fn):
        CHECKS[name] = Check(name, doc, fn, needs_facts)
        return fn
    return register
