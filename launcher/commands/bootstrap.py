"""`v4 bootstrap --cluster NAME`: BOOTSTRAP.md's checklist as commands, resumable.

Each step is a `v4` command run as a child process (so it is exactly what a user would type, and its exit code
is the verdict). What passed is recorded in V4_WORK/.v4-bootstrap/<cluster>.json with a fingerprint of the
cluster and hardware values: a second call continues at the first step that has not passed, and an edit of the
cluster file starts the checklist again. A failed step stops the walk with its own exit code and says how to go on.
"""
from __future__ import annotations

import hashlib
import json
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import click

from launcher.cli_options import config_options, load_config

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Step:
    name: str
    args: tuple[str, ...]        # the v4 subcommand, before the selection flags
    what: str


STEPS = (
    Step("validate", ("config", "validate"), "types, counts, addresses, placeholders, paths"),
    Step("ssh", ("preflight", "--only", "ssh"), "every node answers over SSH with a pinned host key"),
    Step("preflight", ("preflight",), "software, GPUs, network, shared storage, ports, limits on every node"),
    Step("up", ("cluster", "up"), "Ray head and workers; ready when the GCS reports every node"),
    Step("probe", ("cluster", "probe"), "a Ray job with a task on every node"),
    Step("nccl", ("preflight", "--only", "nccl"), "all-reduce across each node's GPUs, bus bandwidth"),
    Step("smoke", ("run", "--preset", "smoke"), "stage A: the whole pipeline on a small model, gates"),
    Step("dryrun_plan", ("run", "--preset", "dryrun", "--dry-run"), "stage B0's plan on the real topology"),
)
NAMES = [s.name for s in STEPS]


def fingerprint(cfg) -> str:
    """The cluster and hardware values (not the preset's): what the checklist's verdicts depend on."""
    from launcher.config.schema import SCHEMA
    keys = sorted(k for k in cfg.values if k in SCHEMA and SCHEMA[k].layer in ("cluster", "hw"))
    text = json.dumps({k: cfg.values[k] for k in keys}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def state_path(cfg) -> Path:
    return Path(str(cfg["V4_WORK"])) / ".v4-bootstrap" / f"{cfg['V4_CLUSTER_NAME']}.json"


def load_state(cfg) -> dict:
    p = state_path(cfg)
    try:
        state = json.loads(p.read_text())
    except (OSError, ValueError):
        return {"fingerprint": fingerprint(cfg), "steps": {}}
    if state.get("fingerprint") != fingerprint(cfg):
        return {"fingerprint": fingerprint(cfg), "steps": {}, "reset": "the cluster's configuration changed"}
    return state


def save_state(cfg, state: dict) -> None:
    from dsv4.fileio import atomic_write
    p = state_path(cfg)
    p.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(p, json.dumps({k: v for k, v in state.items() if k != "reset"}, indent=2))


def command(step: Step, flags: list[str]) -> str:
    """The step as a shell command line (flags are already shell words)."""
    return " ".join(["v4", *map(shlex.quote, step.args), *flags])


@click.command("bootstrap")
@config_options()
@click.option("--until", type=click.Choice(NAMES), help="stop after this step")
@click.option("--from", "start", type=click.Choice(NAMES), help="run again from this step (it and later ones)")
@click.option("--dry-run", is_flag=True, help="list the steps, their commands and what has passed; run nothing")
@click.option("--json", "as_json", is_flag=True, help="the steps and their status as JSON on stdout")
def bootstrap(selection, until, start, dry_run, as_json):
    """Walk a new cluster through BOOTSTRAP.md: validate, SSH, preflight, Ray up, probe, NCCL, the smoke stage,
    the dry-run plan. Resumable: a second call continues at the first step that has not passed."""
    from launcher.pipeline import config_flags
    if selection.preset:
        raise click.UsageError("bootstrap runs its own presets (smoke, dryrun); drop --preset")
    cfg = load_config(selection)
    flags = config_flags(cfg)
    state = load_state(cfg)
    if state.get("reset"):
        click.echo(f"{state['reset']} since the last bootstrap: starting again", err=True)
    if start:
        for name in NAMES[NAMES.index(start):]:
            state["steps"].pop(name, None)
    last = NAMES.index(until) + 1 if until else len(STEPS)
    todo = STEPS[:last]
    if dry_run or as_json:
        rows = [{"step": s.name, "command": command(s, flags), "what": s.what,
                 "status": state["steps"].get(s.name, {}).get("status", "pending")} for s in todo]
        if as_json:
            click.echo(json.dumps({"cluster": cfg["V4_CLUSTER_NAME"], "state": str(state_path(cfg)), "steps": rows},
                                  indent=2))
        else:
            for i, r in enumerate(rows, 1):
                click.echo(f"{i}. {r['step']:<12} {r['status']:<8} {r['command']}\n   {r['what']}")
        if dry_run:
            return
    say = lambda m: click.echo(m, err=True)
    for i, step in enumerate(todo, 1):
        done = state["steps"].get(step.name, {})
        if done.get("status") == "passed":
            say(f"[{i}/{len(todo)}] {step.name}: passed {time.strftime('%Y-%m-%d %H:%M', time.localtime(done['at']))}")
            continue
        cmd = command(step, flags)
        say(f"[{i}/{len(todo)}] {step.name}: {step.what}\n  $ {cmd}")
        t0 = time.time()
        # config_flags are shell words ("--set 'K=a b'"): the child gets them as the shell would pass them
        code = subprocess.call([sys.executable, "-m", "launcher", *step.args, *shlex.split(" ".join(flags))], cwd=ROOT)
        state["steps"][step.name] = {"status": "passed" if code == 0 else "failed", "exit_code": code,
                                     "at": time.time(), "seconds": round(time.time() - t0, 1), "command": cmd}
        try:
            save_state(cfg, state)
        except OSError as e:
            say(f"warning: cannot record the step under {state_path(cfg).parent} ({e.strerror}); a later call "
                "starts again")
        if code != 0:
            again = " ".join(["v4 bootstrap", *flags])
            say(f"\nbootstrap stopped at step {i}/{len(todo)} ({step.name}, exit {code}). Fix what it says above, then:\n"
                f"  {again}      (continues at {step.name})")
            sys.exit(code)
    name = cfg["V4_CLUSTER_NAME"]
    if last < len(STEPS):
        say(f"\nbootstrap of {name} passed up to {until}; next: v4 bootstrap {' '.join(flags)}")
    else:
        say(f"\ncluster {name} is bootstrapped; next, stage B0 on the real model and topology:\n"
            f"  v4 run --preset dryrun {' '.join(flags)}")
