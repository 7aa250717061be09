"""Preflight: checks that every node can run the job, each PASS | WARN | FAIL (or SKIP when it does
not apply) with a fix, per node, gathered in parallel.

Facts are collected once per node (one SSH round trip running `node_scripts/node_facts.py`, and on a
node with several GPUs a second one timing an all-reduce across them, `node_scripts/nccl_bw.py`), then
every registered check judges them; checks that compare nodes (versions, clocks, the shared
directory) see all nodes' facts. `v4 run` refuses to start on a FAIL unless the check is skipped.
"""
from __future__ import annotations

import difflib
import json
import os
from dataclasses import asdict

from launcher.errors import ConfigError
from launcher.preflight.registry import CHECKS, CheckResult, RequiredInput
from launcher.preflight import checks as _checks  # noqa: F401 - registers the checks
from launcher.table import table

SCHEMA = 1
STATUSES = ("PASS", "WARN", "FAIL", "SKIP")

__all__ = ["CHECKS", "CheckResult", "RequiredInput", "check_names", "run_checks", "render_table", "to_json",
           "failed"]


class Results(list):
    """The CheckResults, plus the facts gathered per node (for the run manifest)."""
    facts: dict[str, dict]


def check_names(cfg=None) -> list[str]:
    return list(CHECKS)


def select_checks(only=(), skip=()) -> list[str]:
    """The check names to run; unknown names are a usage error with a did-you-mean."""
    for name in (*only, *skip):
        if name not in CHECKS:
            close = difflib.get_close_matches(name, list(CHECKS), n=1)
            raise ConfigError(f"unknown preflight check {name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""),
                              fix=f"checks: {', '.join(CHECKS)}")
    return [n for n in CHECKS if (not only or n in only) and n not in skip]


def required_inputs(cfg) -> list[RequiredInput]:
    """The pipeline's declared inputs: `launcher.plan.required_inputs(cfg)` when the pipeline has one."""
    try:
        from launcher import plan
    except ImportError:
        return []
    hook = getattr(plan, "required_inputs", None)
    return list(hook(cfg)) if hook else []


def run_checks(cfg, only=(), skip=(), nodes=None, inputs=None, run=None) -> Results:
    """Every selected check on every node; one result per (check, node). `run`: the registry run these
    checks are for (a resumed one may already hold checkpoints, or have finished training)."""
    from launcher.nodes import opened
    from launcher.preflight.gather import gather

    names = select_checks(only, skip)
    inputs = required_inputs(cfg) if inputs is None else list(inputs)
    with opened(cfg, nodes) as nodes:          # SSH connections made here are closed here
        ctx = gather(cfg, nodes, inputs, measure_nccl="nccl" in names, probe_wandb="wandb" in names,
                     measure_gpu=bool({"gpu_perf", "gpu_errors"} & set(names)), measure_pairs="nccl_pairs" in names)
    if run is not None:
        ctx.run_ckpt_gb = _tree_gb(run.dir / "checkpoints")
        ctx.run_trained = run.step_status("train").get("status") == "done"
    results = Results()
    results.facts = ctx.facts
    for name in names:
        for node in ctx.order:
            r = CHECKS[name].judge(node, ctx)
            if r is not None:
                results.append(r)
    # A node whose facts could not be gathered is judged by no check that needs them: whatever was selected (`--only
    # nccl`), the ssh or python check that says why is its row, never a table without it that passes.
    judged = {r.node for r in results if r.name in ("ssh", "python")}
    for node, (stage, _) in ctx.errors.items():
        if node not in judged and stage in CHECKS and (r := CHECKS[stage].judge(node, ctx)) is not None:
            results.append(r)
    return results


def _tree_gb(path) -> float:
    """Bytes of the files under `path` (0 if it does not exist), in GB as df reports them."""
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:                    # removed meanwhile (a retention sweep)
                pass
    return total / 1e9


def failed(results, strict: bool = False) -> list[CheckResult]:
    return [r for r in results if r.status == "FAIL" or (strict and r.status == "WARN")]


def summary(results) -> dict[str, int]:
    return {s: sum(r.status == s for r in results) for s in STATUSES}


def to_json(results, strict: bool = False) -> dict:
    """`ok` is what the exit code says: under `strict` a WARN fails too."""
    return {"schema": SCHEMA, "ok": not failed(results, strict), "strict": strict, "summary": summary(results),
            "results": [asdict(r) for r in results]}


def render_table(results, strict: bool = False) -> str:
    if not results:
        return "no checks selected"
    rows = [("CHECK", "NODE", "STATUS", "DETAIL")]
    for r in results:
        rows.append((r.name, r.node, r.status, r.detail))
        if r.fix and r.status in ("WARN", "FAIL"):
            rows.append(("", "", "", f"fix: {r.fix}"))
    lines = [table(rows)]
    s = summary(results)
    verdict = (" -- preflight FAILED" if s["FAIL"] else
               " -- preflight FAILED (strict: a WARN fails)" if strict and s["WARN"] else " -- preflight passed")
    lines.append(", ".join(f"{n} {k}" for k, n in s.items() if n) + verdict)
    return "\n".join(lines)


def dumps(results, strict: bool = False) -> str:
    return json.dumps(to_json(results, strict), indent=2)
