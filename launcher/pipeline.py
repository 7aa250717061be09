"""Execute a Plan: stage order, preflight, cluster up, each step as a Ray job, gates, summary.

Progress goes to stderr as it happens; the run directory records everything (config.json,
manifest.json, plan.json, steps/<name>/{status.json,log}, metrics.jsonl, gates.json). A step whose
job finds its outputs already complete (sentinels) returns at once, so re-running the same
command, or `--resume RUN_ID`, continues where a failed run stopped.
"""
from __future__ import annotations

import importlib.util
import json
import logging
import shlex
import sys
import time
from dataclasses import asdict
from pathlib import Path

from launcher import gates as gating
from launcher.config import Config
from launcher.errors import (GateError, JobError, NonFiniteError, PreflightError, Timeout, NONFINITE, TIMEOUT,
                             V4Error)
from launcher.plan import Plan, Step


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def quiet_ray_sdk() -> None:
    """Ray's SDK logs every upload and websocket at INFO on stderr; our own progress says what matters."""
    import ray.job_submission  # noqa: F401  (creates the SDK's loggers)

    for name in list(logging.root.manager.loggerDict):
        if name == "ray" or name.startswith("ray."):
            logging.getLogger(name).setLevel(logging.WARNING)
    # it warns on every upload that .git/.venv are excluded by default: they are excluded on purpose
    logging.getLogger("ray._private.runtime_env.working_dir").setLevel(logging.ERROR)


def check_stage_order(cfg: Config, force: bool) -> None:
    needed = cfg["PRESET_REQUIRES_STAGE"]
    if not needed:
        return
    passed = gating.passed_stages(cfg)
    if needed in passed:
        say(f"stage order: {needed} passed in run {passed[needed]['run_id']} ({passed[needed]['passed_at']})")
        return
    if force:
        say(f"stage order: {needed} has not passed for {gating.stage_key(cfg)}; continuing because of --force")
        return
    sel = cfg.selection
    raise GateError(
        f"preset {sel.preset} (stage {cfg['PRESET_STAGE']}) needs stage {needed} to have passed first for "
        f"cluster/hw {gating.stage_key(cfg)} ({cfg.origin('PRESET_REQUIRES_STAGE').where})",
        fix=f"v4 run --preset {needed} --cluster {sel.cluster} --hw {sel.hw}   (or pass --force)")


def check_available(plan: Plan) -> None:
    """Refuse up front when a step's program does not exist yet: no pretend success."""
    missing = [f"{s.name} ({s.module})" for s in plan.steps
               if s.kind == "job" and importlib.util.find_spec(s.module) is None]
    if missing:
        raise JobError(f"not available yet in this version: {', '.join(missing)}",
                       fix="drop these steps with --set PRESET_STEPS=\"...\" or use a preset whose steps exist")


def execute(cfg: Config, plan: Plan, *, skip_checks=(), force=False, resume=False, as_json=False) -> None:
    from launcher import cluster, jobs, registry

    if cfg["V4_EXECUTOR"] == "ray":
        quiet_ray_sdk()

    check_stage_order(cfg, force)
    check_available(plan)
    _check_skip_names(skip_checks)
    run = registry.open_run(cfg, plan) if resume else registry.create_run(cfg, plan, argv=sys.argv)
    # The single record of what this run was asked to do; every job reads it.
    run.write_json("config.json", {"values": cfg.job_values()}, private=True)
    say(f"run {plan.run_id}: {run.dir}")
    t0 = time.time()
    try:
        for step in plan.steps:
            if step.kind == "preflight":
                _preflight(cfg, run, step, skip_checks)
            elif step.kind == "cluster":
                say(f"[cluster] bringing up Ray on {len(cfg.nodes)} node(s) (no-op when healthy)")
                run.set_step(step.name, "running")
                st = cluster.up(cfg, progress=say)
                run.set_step(step.name, "done", cluster=st.to_json())
            elif step.kind == "job":
                _job(cfg, run, step, jobs)
            elif step.kind == "gates":
                _gates(cfg, run, plan)
    except V4Error as e:
        run.finish("failed", error=e.message, code=e.code)
        say(f"\nrun {plan.run_id} FAILED after {time.time() - t0:.0f} s: {e.message}")
        say(f"  logs:   v4 runs logs {plan.run_id}")
        say(f"  resume: {rerun_command(cfg, f'--resume {plan.run_id}')}")
        raise
    except BaseException as e:
        # a bug or Ctrl-C: the run must not stay "running" in the registry
        run.finish("failed", error=f"{type(e).__name__}: {e}", code=1)
        raise
    run.finish("passed")
    _summary(cfg, run, plan, time.time() - t0, as_json)


def rerun_command(cfg, extra: str) -> str:
    """The command that repeats this run's selection (every --env-file and --set included)."""
    sel = cfg.selection
    parts = ["v4 run", f"--preset {sel.preset}", f"--cluster {shlex.quote(sel.cluster)}", f"--hw {sel.hw}"]
    parts += [f"--env-file {shlex.quote(f)}" for f in sel.env_files]
    parts += [f"--set {shlex.quote(s)}" for s in sel.sets]
    return " ".join(parts + [extra])


def _check_skip_names(skip_checks) -> None:
    from launcher.preflight import select_checks

    select_checks(skip=tuple(skip_checks))     # a usage error (with did-you-mean) on an unknown name


def _preflight(cfg, run, step: Step, skip_checks) -> None:
    from launcher import preflight

    say(f"[preflight] {len(cfg.nodes)} node(s)")
    run.set_step(step.name, "running")
    results = preflight.run_checks(cfg, run=run)
    say(preflight.render_table(results))
    run.record_preflight(results)
    strict = cfg["PRESET_STRICT_PREFLIGHT"]
    failing = [r for r in results if (r.status == "FAIL" or (strict and r.status == "WARN"))
               and r.name not in skip_checks]
    if failing:
        run.set_step(step.name, "failed")
        names = sorted({r.name for r in failing})
        raise PreflightError(
            f"preflight: {len(failing)} failing check(s): "
            + "; ".join(f"{r.name} on {r.node}: {r.detail}" for r in failing[:5]),
            fix=(failing[0].fix or "") + f"   (or skip: {' '.join('--skip-check ' + n for n in names)})")
    run.set_step(step.name, "done")


def _job(cfg, run, step: Step, jobs) -> None:
    status = run.step_status(step.name)
    if status.get("status") == "done":
        say(f"[{step.name}] done in an earlier attempt of this run; skipped")
        return
    say(f"[{step.name}] {step.doc}")
    attempts = len(status.get("submission_ids", []))
    if attempts:
        # Ray keeps finished submissions: a resumed step needs a fresh id
        step.job.submission_id = f"{step.job.submission_id}-r{attempts}"
    run.set_step(step.name, "running", submission_id=step.job.submission_id)
    log = run.dir / "steps" / step.name / "log"
    if cfg["V4_EXECUTOR"] == "local":
        outcome = run_local(cfg, step.job, log)
    else:
        outcome = jobs.submit_and_wait(cfg, step.job, log_path=log, progress=say)
    run.set_step(step.name, "done" if outcome.ok else "failed", **outcome.to_json())
    if outcome.ok:
        say(f"[{step.name}] done in {outcome.elapsed_s:.0f} s")
        return
    tail = "\n    ".join(outcome.log_tail.splitlines()[-15:])
    if outcome.exit_code == NONFINITE:
        nf = run.dir / "steps" / step.name / "nonfinite.json"
        where = json.loads(nf.read_text()) if nf.is_file() else {}
        raise NonFiniteError(f"{step.name}: non-finite loss/gradient at step {where.get('step', '?')}, rank "
                             f"{where.get('rank', '?')}, first module {where.get('module', '?')}",
                             fix=f"see {nf}; bisect with `v4 nan bisect-kernel` if a kernel is suspected")
    if outcome.exit_code == TIMEOUT or outcome.status == "TIMEOUT":
        raise Timeout(f"{step.name}: no result within {step.job.timeout_s:.0f} s (PRESET_JOB_TIMEOUT)")
    raise JobError(f"{step.name}: job {outcome.status} (exit code {outcome.exit_code})\n    {tail}",
                   fix=f"full log: {log}")


def _gates(cfg, run, plan: Plan) -> None:
    results = gating.evaluate(cfg["PRESET_GATES"], run.dir, cfg)
    run.write_json("gates.json", [asdict(r) for r in results])
    for r in results:
        say(f"[gate] {'PASS' if r.passed else 'FAIL'} {r.name}: {r.detail}")
    failed = [r for r in results if not r.passed]
    if failed:
        raise GateError("gate(s) failed: " + ", ".join(f"{r.name} ({r.detail})" for r in failed))
    if cfg["PRESET_STAGE"] and results:
        # a stage with no gates evaluated proves nothing and unlocks nothing
        gating.record_pass(cfg, cfg["PRESET_STAGE"], plan.run_id, results)


NEXT_STAGE = {"smoke": "dryrun", "dryrun": "full"}


def _summary(cfg, run, plan: Plan, elapsed: float, as_json: bool) -> None:
    rows = gating.read_metrics(run.dir)
    last = rows[-1] if rows else {}
    steady = rows[1:] or rows
    summary = {
        "run_id": plan.run_id, "run_dir": str(run.dir), "status": "passed", "elapsed_s": round(elapsed, 1),
        "steps": len(rows),
        "loss_first": rows[0]["loss"] if rows else None, "loss_last": last.get("loss"),
        "step_time_s": (sum(r["step_time_s"] for r in steady) / len(steady)) if steady else None,
        "tokens_per_s": (sum(r.get("tokens_per_s", 0) for r in steady) / len(steady)) if steady else None,
        "peak_mem_gb": max((r.get("peak_mem_gb") or 0) for r in rows) if rows else None,
    }
    run.write_json("summary.json", summary)
    if as_json:
        print(json.dumps(summary, indent=2))
    sel = cfg.selection
    nxt = NEXT_STAGE.get(cfg["PRESET_STAGE"])
    fmt = lambda v, f: "-" if v is None else format(v, f)
    say(f"\nrun {plan.run_id} PASSED in {elapsed:.0f} s: {summary['steps']} steps, "
        f"loss {fmt(summary['loss_first'], '.4f')} -> {fmt(summary['loss_last'], '.4f')}, "
        f"{fmt(summary['step_time_s'], '.2f')} s/step, {fmt(summary['tokens_per_s'], '.0f')} tokens/s, "
        f"peak {fmt(summary['peak_mem_gb'], '.2f')} GB")
    say("next:")
    say(f"  v4 runs show {plan.run_id}")
    if nxt:
        say(f"  v4 run --preset {nxt} --cluster {sel.cluster} --hw {sel.hw} --dry-run")


def run_local(cfg, job, log_path: Path, progress=say):
    """The V4_EXECUTOR=local path: the step's entrypoint as a subprocess here, same env, same log."""
    import os
    import re
    import subprocess

    from launcher.jobs import Outcome

    env = dict(os.environ)
    for k, v in job.runtime_env["env_vars"].items():
        env[k] = re.sub(r"\$\{(\w+)\}", lambda m: os.environ.get(m.group(1), ""), v)
    env["PYTHONPATH"] = job.runtime_env["working_dir"] + (":" + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    progress(f"running {job.entrypoint}")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(job.entrypoint, shell=True, cwd=job.runtime_env["working_dir"], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        status = None
        try:
            for line in proc.stdout:
                log.write(line)
                log.flush()
                progress("  | " + line.rstrip())
                if time.time() - t0 > job.timeout_s:
                    status = "TIMEOUT"
                    break
        finally:
            if proc.poll() is None:      # timed out, or we are being interrupted: stop its whole group
                os.killpg(proc.pid, 15)
            rc = proc.wait()
    status = status or ("SUCCEEDED" if rc == 0 else "FAILED")
    tail = "\n".join(log_path.read_text().splitlines()[-40:])
    return Outcome(job.submission_id, status, rc, time.time() - t0, "", str(log_path), tail)
