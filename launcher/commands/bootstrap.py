"""`v4 bootstrap --cluster NAME`: BOOTSTRAP.md's checklist as commands, resumable.

Each step is a `v4` command run as a child process (so it is exactly what a user would type, and its exit code
is the verdict). What passed is recorded in V4_WORK/.v4-bootstrap/<cluster>.json with a fingerprint of the
cluster and hardware values: a second call continues at the first step that has not passed, and an edit of the
cluster file starts the checklist again. A failed step stops the walk with its own exit code and says how to go on;
where it was a preflight (ssh, preflight, nccl) it names the nodes that failed and the checks.

With `--exclude-bad-nodes` (as for `v4 run`: launcher/recovery.py) a worker that fails one of those preflights is left
out instead: the head never (it runs the GCS, the dashboard and the rendezvous), nor below V4_MIN_NODES; a standby
(V4_STANDBY_IPS) takes its place once the step passes with it. Every later step then runs on the smaller cluster,
its command carrying the roster as `--set V4_WORKER_IPS=... --set V4_NUM_NODES=...` (printed, so each step and the
next command after the checklist can be pasted as they are); the nodes left out are recorded in the checklist's
state and in the cluster's quarantine record (`v4 cluster status`), which a later preflight that passes on them
clears. Onboarding goes on around a broken node, and says which one to fix.
"""
from __future__ import annotations

from contextlib import nullcontext

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
# The steps that judge each node (`v4 preflight ...`): with --exclude-bad-nodes a worker failing one is left out.
PREFLIGHTS = ("ssh", "preflight", "nccl")
LEFT_BY = "bootstrap"           # LeftOut.run of the nodes the checklist left out (the cluster's quarantine record)


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


# ------------------------------------------------------------------------------------------------ nodes left out
def left_out(state: dict) -> list:
    """The nodes the checklist left out so far (launcher/recovery.py LeftOut, `step` the bootstrap step)."""
    from launcher.recovery import LeftOut
    return [LeftOut.model_validate(e) for e in state.get("left_out", [])]


def standbys_in(left: list) -> list[str]:
    """Standbys that took a left-out node's place (and were not left out themselves)."""
    gone = {e.ip for e in left}
    return [e.replaced_by for e in left if e.replaced_by and e.replaced_by not in gone]


def roster(cfg, left: list):
    """The configuration without the nodes left out, standbys in (`recovery.derive`: the floor, the layout); and the
    `--set` words that give a child command the same roster. Raises recovery.Refused."""
    from launcher.config.resolve import shell_set
    from launcher.recovery import derive
    if not left:
        return cfg, []
    standby = standbys_in(left)
    where = f"{LEFT_BY}: " + "; ".join(f"{e.ip} left out ({e.step}: {', '.join(e.checks)})" for e in left)
    new = derive(cfg, [e.ip for e in left], standby, where)
    sets = [f"V4_WORKER_IPS={' '.join(new['V4_WORKER_IPS'])}", f"V4_NUM_NODES={new['V4_NUM_NODES']}"]
    if list(new["V4_STANDBY_IPS"]) != list(cfg["V4_STANDBY_IPS"]):
        sets.append(f"V4_STANDBY_IPS={' '.join(new['V4_STANDBY_IPS'])}")
    return new, [f"--set {shell_set(x)}" for x in sets]


def run_preflight(step: Step, words: list[str]):
    """The step's `v4 preflight` with --json: (exit code, its results or None, strict). The table it would print is
    printed from the results; a child that printed no results (a config error) has its output passed on as it was."""
    from launcher.preflight import CheckResult, render_table
    p = subprocess.run([sys.executable, "-m", "launcher", *step.args, *shlex.split(" ".join(words)), "--json"],
                       cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        data = json.loads(p.stdout)
        results = [CheckResult(**r) for r in data["results"]]
    except (ValueError, KeyError, TypeError):
        sys.stdout.write(p.stdout)
        return p.returncode, None, False
    click.echo(render_table(results, data.get("strict", False)))
    return p.returncode, results, bool(data.get("strict"))


def failing_nodes(results, strict: bool) -> dict[str, list]:
    """node -> its failing results, in the nodes' order."""
    from launcher.preflight import failed
    out: dict[str, list] = {}
    for r in failed(results, strict):
        out.setdefault(r.node, []).append(r)
    return out


def named(bad: dict[str, list]) -> str:
    return "; ".join(f"{ip} ({', '.join(sorted({r.name for r in rs}))})" for ip, rs in bad.items())


def leave_out(cfg, state: dict, step: Step, bad: dict[str, list], say) -> tuple[str, list[str]]:
    """Leave the failing workers out (recorded in `state`, standbys in their places): ("", standbys taken), or
    (why not, []) -- the head failed, or what is left is under the floor or does not fit."""
    from launcher.recovery import LeftOut, Refused
    head = cfg.nodes[0]
    if head in bad:
        return (f"{step.name} failed on the head {head}, which --exclude-bad-nodes never leaves out (it runs the Ray "
                f"GCS, the dashboard and the rendezvous): " + "; ".join(f"{r.name}: {r.detail}" for r in bad[head][:5])
                + "\n  fix the head (the rows above say how), or make another node the head (V4_MASTER_IP)"), []
    left = left_out(state)
    standby = standbys_in(left)
    now = time.time()
    leaving = [LeftOut(ip=ip, by="preflight", at=now, run=LEFT_BY, step=step.name,
                       checks=sorted({r.name for r in rs}), why="; ".join(f"{r.name}: {r.detail}" for r in rs)[:500])
               for ip, rs in bad.items()]
    gone = {e.ip for e in left} | set(bad)
    free = [s for s in cfg["V4_STANDBY_IPS"] if s not in standby and s not in gone]
    for e, s in zip(leaving, free):
        e.replaced_by = s
    try:
        new, _ = roster(cfg, left + leaving)
    except Refused as e:
        return f"{step.name} failed on {named(bad)}; leaving them out: {e.message}\n  fix: {e.fix}", []
    from launcher.recovery import quarantine
    quarantine(cfg, leaving)
    state["left_out"] = [e.model_dump() for e in left + leaving]
    for e in leaving:
        say(f"  leaving out {e.ip}: {e.why[:300]}" + (f"; standby {e.replaced_by} takes its place"
                                                      if e.replaced_by else ""))
    say(f"  going on with {len(new.nodes)} node(s): {' '.join(new.nodes)}")
    return "", [e.replaced_by for e in leaving if e.replaced_by]


def walk_preflight(cfg, state: dict, step: Step, flags: list[str], exclude: bool, say) -> tuple[int, str, bool]:
    """A preflight step: (exit code, what to say when it stops, whether --exclude-bad-nodes would go on). With
    `exclude` its failing workers are left out and, where standbys took their places, the step runs again with them
    (until it passes, or one that fails cannot be left out)."""
    from launcher.recovery import Refused
    while True:
        try:
            _, sets = roster(cfg, left_out(state))
        except Refused as e:
            return 3, f"{e.message}\n  fix: {e.fix}", False
        code, results, strict = run_preflight(step, flags + sets)
        bad = failing_nodes(results, strict) if code != 0 and results is not None else {}
        if not bad:
            return code, "", False
        if not exclude:
            return code, f"{step.name} failed on {named(bad)}", cfg.nodes[0] not in bad
        why, taken = leave_out(cfg, state, step, bad, say)
        if why or not taken:
            return (code, why, False) if why else (0, "", False)
        say(f"  {step.name} again, with standby {', '.join(taken)} in place:\n"
            f"  $ {command(step, flags + roster(cfg, left_out(state))[1])}")


@click.command("bootstrap")
@config_options()
@click.option("--until", type=click.Choice(NAMES), help="stop after this step")
@click.option("--from", "start", type=click.Choice(NAMES), help="run again from this step (it and later ones)")
@click.option("--dry-run", is_flag=True, help="list the steps, their commands and what has passed; run nothing")
@click.option("--json", "as_json", is_flag=True, help="the steps and their status as JSON on stdout")
@click.option("--exclude-bad-nodes", "exclude", is_flag=True,
              help="leave out the workers (never the head) that fail the ssh, preflight or nccl step instead of "
                   "stopping, standbys (V4_STANDBY_IPS) in their places (refused below V4_MIN_NODES); the later steps "
                   "run on the nodes left")
def bootstrap(selection, until, start, dry_run, as_json, exclude):
    """Walk a new cluster through BOOTSTRAP.md: validate, SSH, preflight, Ray up, probe, NCCL, the smoke stage,
    the dry-run plan. Resumable: a second call continues at the first step that has not passed."""
    from launcher import recovery
    from launcher.pipeline import config_flags
    if selection.preset:
        raise click.UsageError("bootstrap runs its own presets (smoke, dryrun); drop --preset")
    from launcher.config import ports
    with ports.read_only() if dry_run else nullcontext():      # a dry run records no ports either
        cfg = load_config(selection)
    flags = config_flags(cfg)
    again = " ".join(["v4 bootstrap", *flags] + (["--exclude-bad-nodes"] if exclude else []))
    state = load_state(cfg)
    if state.get("reset"):
        click.echo(f"{state['reset']} since the last bootstrap: starting again", err=True)
    if start:
        for name in NAMES[NAMES.index(start):]:
            state["steps"].pop(name, None)
    last = NAMES.index(until) + 1 if until else len(STEPS)
    todo = STEPS[:last]
    say = lambda m: click.echo(m, err=True)

    def sets(before: Step | None = None) -> list[str]:
        """The roster words for the step `before` (what the steps ahead of it left out), or after the last."""
        upto = NAMES.index(before.name) if before else len(NAMES)
        try:
            return roster(cfg, [e for e in left_out(state) if NAMES.index(e.step) < upto])[1]
        except recovery.Refused as e:                 # a record the cluster file no longer fits: said, then walked
            say(f"warning: the nodes an earlier bootstrap left out no longer fit: {e.message}")
            return []
    if dry_run or as_json:
        rows = [{"step": s.name, "command": command(s, flags + sets(s)), "what": s.what,
                 "status": state["steps"].get(s.name, {}).get("status", "pending")} for s in todo]
        gone = [{"ip": e.ip, "step": e.step, "checks": e.checks, "why": e.why, "replaced_by": e.replaced_by}
                for e in left_out(state)]
        if as_json:
            click.echo(json.dumps({"cluster": cfg["V4_CLUSTER_NAME"], "state": str(state_path(cfg)), "steps": rows,
                                   "left_out": gone}, indent=2))
        else:
            for i, r in enumerate(rows, 1):
                click.echo(f"{i}. {r['step']:<12} {r['status']:<8} {r['command']}\n   {r['what']}")
            for e in gone:
                click.echo(f"left out: {e['ip']} ({e['step']}: {e['why'][:200]})")
        if dry_run:
            return
    for i, step in enumerate(todo, 1):
        done = state["steps"].get(step.name, {})
        if done.get("status") == "passed":
            say(f"[{i}/{len(todo)}] {step.name}: passed {time.strftime('%Y-%m-%d %H:%M', time.localtime(done['at']))}"
                + (f" (left out {', '.join(done['left_out'])})" if done.get("left_out") else ""))
            continue
        # a step that runs (again) judges its nodes again: what it, or a later step, left out comes back first
        kept = [e for e in left_out(state) if NAMES.index(e.step) < NAMES.index(step.name)]
        state["left_out"] = [e.model_dump() for e in kept]
        cmd = command(step, flags + sets(step))
        say(f"[{i}/{len(todo)}] {step.name}: {step.what}\n  $ {cmd}")
        t0 = time.time()
        why, would_go_on = "", False
        if step.name in PREFLIGHTS:
            code, why, would_go_on = walk_preflight(cfg, state, step, flags, exclude, say)
        else:
            # config_flags are shell words ("--set 'K=a b'"): the child gets them as the shell would pass them
            code = subprocess.call([sys.executable, "-m", "launcher", *step.args,
                                    *shlex.split(" ".join(flags + sets(step)))], cwd=ROOT)
        gone = [e.ip for e in left_out(state) if e.step == step.name]
        state["steps"][step.name] = {"status": "passed" if code == 0 else "failed", "exit_code": code,
                                     "at": time.time(), "seconds": round(time.time() - t0, 1), "command": cmd,
                                     **({"left_out": gone} if gone else {})}
        if code == 0 and step.name == "preflight":          # every check passed on these: none is left out now
            recovery.readmit(cfg, roster(cfg, left_out(state))[0].nodes, say)
        try:
            save_state(cfg, state)
        except OSError as e:
            say(f"warning: cannot record the step under {state_path(cfg).parent} ({e.strerror}); a later call "
                "starts again")
        if code != 0:
            say(f"\nbootstrap stopped at step {i}/{len(todo)} ({step.name}, exit {code})"
                + (f": {why}" if why else "") + ". Fix what it says above, then:\n"
                f"  {again}      (continues at {step.name})")
            if would_go_on:
                say(f"  {again} --exclude-bad-nodes      (goes on without the workers that fail, never the head; "
                    "docs/resilience.md)")
            sys.exit(code)
    name = cfg["V4_CLUSTER_NAME"]
    left = left_out(state)
    if last < len(STEPS):
        say(f"\nbootstrap of {name} passed up to {until}" + (f" without {', '.join(e.ip for e in left)}" if left
                                                             else "") + f"; next: {again}")
    else:
        say(f"\ncluster {name} is bootstrapped" + (f" without {', '.join(e.ip for e in left)}" if left else "")
            + "; next, stage B0 on the real model and topology:\n"
            f"  v4 run --preset dryrun {' '.join(flags + sets())}")
    for e in left:
        say(f"left out: {e.ip} ({e.step}: {e.why[:200]})" + (f"; standby {e.replaced_by} in its place"
                                                             if e.replaced_by else ""))
    if left:
        first = min((e.step for e in left), key=NAMES.index)
        say(f"once {'it is' if len(left) == 1 else 'they are'} fixed, check and take "
            f"{'it' if len(left) == 1 else 'them'} back: {' '.join(['v4 bootstrap', *flags])} --from {first}")
