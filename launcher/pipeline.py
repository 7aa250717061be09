"""Execute a Plan: stage order, preflight, cluster up, each step as a Ray job, gates, summary.

Progress goes to stderr as it happens; the run directory records everything (config.json,
manifest.json, plan.json, steps/<name>/{status.json,log}, metrics.jsonl, gates.json). A step whose
job finds its outputs already complete (sentinels) returns at once, so re-running the same
command, or `--resume RUN_ID`, continues where a failed run stopped.
"""
from __future__ import annotations

import json
import logging
import os
import shlex
import signal
import socket
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

from launcher import gates as gating
from launcher.config import Config
from launcher.config.resolve import shell_set
from launcher.errors import (ConfigError, GateError, JobError, NonFiniteError, PreflightError, Timeout, NONFINITE,
                             TIMEOUT, V4Error)
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


def check_stage_order(cfg: Config, force: bool, skip_checks=()) -> None:
    needed = cfg["PRESET_REQUIRES_STAGE"]
    if not needed:
        return
    passed = gating.passed_stages(cfg)
    entry = passed.get(needed)
    if entry and not entry["differences"]:
        say(f"stage order: {needed} passed in run {entry['run_id']} ({entry['passed_at']})")
        return
    changed = (f"; it passed in run {entry['run_id']}, but with other cluster or hardware settings: "
               + "; ".join(entry["differences"][:6]) + (" ..." if len(entry["differences"]) > 6 else "")) if entry else ""
    if force:
        say(f"stage order: {needed} has not passed for {gating.stage_key(cfg)}{changed}; continuing because of --force")
        return
    sel = cfg.selection
    raise GateError(
        f"preset {sel.preset} (stage {cfg['PRESET_STAGE']}) needs stage {needed} to have passed first for "
        f"cluster/hw {gating.stage_key(cfg)} ({cfg.origin('PRESET_REQUIRES_STAGE').where}){changed}",
        # the same --env-file/--set: V4_WORK among them decides which stages.json the pass lands in
        fix=f"{rerun_command(cfg, preset=needed, skip_checks=skip_checks)}   (or pass --force)")


def check_available(plan: Plan) -> None:
    """Refuse up front when a step's program does not exist yet: no pretend success, and no flag (not --force,
    not a passed stage) can make it exist, so this comes before the stage order."""
    missing = plan.unavailable()
    if missing:
        raise ConfigError(f"not available yet in this version: {', '.join(missing)}",
                          fix="drop these steps with --set PRESET_STEPS=\"...\" or use a preset whose steps exist")


def execute(cfg: Config, plan: Plan, *, skip_checks=(), force=False, resume=False, as_json=False,
            restart_running=False, exclude_bad_nodes=False) -> None:
    """Run `plan` (or with `resume`, continue its run). A job an earlier attempt left alive is followed to its end;
    with `restart_running` it is stopped first and its step runs anew (resume_action). With `exclude_bad_nodes`,
    nodes that fail preflight are left out instead of stopping the run; a lost node or a hung step is restarted within
    PRESET_MAX_RESTARTS (launcher/recovery.py), and the plan's values follow the nodes the run has."""
    from launcher import cluster, jobs, recovery, registry

    if cfg["V4_EXECUTOR"] == "ray":
        quiet_ray_sdk()

    check_available(plan)
    check_stage_order(cfg, force, skip_checks)
    _check_skip_names(skip_checks)
    base = cfg                      # as resolved from the files: what every smaller cluster is derived from
    if resume:
        # the nodes this run left out stay out, its standbys in: its world is what it was when it stopped
        cfg, plan = _as_recorded(cfg, plan, skip_checks)
    run = registry.open_run(cfg, plan, force) if resume else registry.create_run(cfg, plan, argv=sys.argv)
    recov = recovery.Recovery(base, run, skip_checks, say)
    # The single record of what this run was asked to do; every job reads it.
    run.write_json("config.json", {"values": cfg.job_values()}, private=True)
    if resume:
        run.write_json("plan.json", plan.to_json())
    say(f"run {plan.run_id}: {run.dir}")
    if resume and (line := recov.budget_line()):   # the budget is the run's: what its earlier launches spent is gone
        say(line)
    resume_cmd = rerun_command(cfg, f"--resume {plan.run_id}" + (" --exclude-bad-nodes" if exclude_bad_nodes else ""),
                               skip_checks=skip_checks, force=force)
    t0 = time.time()
    try:
        with signals_as_interrupt(), _rollout_scope(cfg) as rollout_live:
            i = 0
            while i < len(plan.steps):     # by position: a smaller cluster rebuilds the plan (same steps, new values)
                step = plan.steps[i]
                i += 1
                _check_not_stopped(run, resume_cmd)
                if step.kind == "preflight":
                    new = _preflight(cfg, run, step, skip_checks, recov if exclude_bad_nodes else None)
                    if new is not cfg:
                        cfg, plan = new, _adopt(run, new)
                elif step.kind == "cluster":
                    say(f"[cluster] bringing up Ray on {len(cfg.nodes)} node(s) (no-op when healthy)")
                    run.set_step(step.name, "running")
                    st = cluster.up(cfg, progress=say)
                    run.set_step(step.name, "done", cluster=st.to_json())
                elif step.kind == "rollout":
                    _rollout(cfg, run, step, rollout_live)
                elif step.kind == "job":
                    new = _job(cfg, run, step, jobs, resume_cmd, restart_running, recov)
                    if new is not cfg:
                        cfg, plan = new, recov.plan
                elif step.kind == "gates":
                    _gates(cfg, run, plan)
            _check_not_stopped(run, resume_cmd)
    except V4Error as e:
        run.finish("failed", error=e.message, code=e.code)
        status = "stopped" if run.stopped else "failed"
        say(f"\nrun {plan.run_id} {status.upper()} after {time.time() - t0:.0f} s: {e.message}")
        say(f"  logs:   {runs_command(cfg, 'logs', plan.run_id)}")
        say(f"  resume: {resume_cmd}")
        if as_json:
            _print_failure(run, plan, status, e.code, e.message, e.fix, time.time() - t0, resume_cmd)
            e.reported = True
        raise
    except BaseException as e:
        # a bug, Ctrl-C or SIGTERM: the run must not stay "running" in the registry, nor its step
        interrupted = isinstance(e, KeyboardInterrupt)
        what = "interrupted" if interrupted else type(e).__name__
        code = 130 if interrupted else 1
        left = [s for s in run.steps() if s.get("status") == "running"]
        for s in left:
            run.set_step(s["name"], "interrupted" if interrupted else "failed")
        run.finish("failed", error=f"{what}: {e}" if str(e) else what, code=code)
        if interrupted:
            _say_interrupted(cfg, run, left, resume_cmd)
        if as_json:
            _print_failure(run, plan, "interrupted" if interrupted else "failed", code, what, "", time.time() - t0,
                           resume_cmd)
        raise
    run.finish("passed")
    _summary(cfg, run, plan, time.time() - t0, as_json)


def _say_interrupted(cfg, run, left: list[dict], resume_cmd: str) -> None:
    """What the interrupted launcher leaves behind, and what `--resume` will do about it (the exit-130 message)."""
    restart_cmd = f"{resume_cmd} --restart-running"
    ray_jobs = [s["submission_id"] for s in left if s.get("submission_id") and not s.get("pgid")]
    live_groups = [s["pgid"] for s in left if s.get("pgid") and s.get("host") == socket.gethostname()
                   and group_alive(s["pgid"], run.dir)]
    if ray_jobs:
        say(f"\nrun {run.id} interrupted; its Ray job {', '.join(ray_jobs)} keeps running (as with `ray job submit`):")
        say(f"  follow it:  {resume_cmd}   (--resume follows it to its end and starts no second job)")
        say(f"  restart it: {restart_cmd}   (stops it, then runs the step anew)")
        say(f"  stop it:    {runs_command(cfg, 'stop', run.id)}")
    elif live_groups:
        # a second Ctrl-C (or SIGTERM) cut the stop short: the job is still saving or exiting
        say(f"\nrun {run.id} interrupted; its local job (process group {', '.join(map(str, live_groups))}) is still "
            "ending")
        say(f"  resume: {resume_cmd}   (stops it if it still runs, then runs the step anew; never two beside each "
            "other)")
    else:
        say(f"\nrun {run.id} interrupted" + ("; its local processes were stopped" if any(s.get("pgid") for s in left)
                                           else ""))
        say(f"  resume: {resume_cmd}")


def config_flags(cfg) -> list[str]:
    """--cluster, --hw, every --env-file and --set (a secret's value taken from the shell's variable of that name,
    not printed), quoted for a shell: what any command we print needs to see the same configuration (V4_WORK among
    it decides where runs and stages live)."""
    sel, q = cfg.selection, shlex.quote
    flags = [f"--cluster {q(sel.cluster)}", f"--hw {q(sel.hw)}"]
    flags += [f"--env-file {q(f)}" for f in sel.env_files]
    # keys the shell exported count like --set: the command must repeat the run without that shell (secrets
    # excepted: they are never printed, and are read again from wherever they came from)
    flags += [f"--set {shell_set(f'{k}={v}')}" for k, v in cfg.from_shell().items() if not cfg.is_secret(k)]
    return flags + [f"--set {shell_set(s)}" for s in sel.sets]


def selection_flags(cfg, *, preset: str | None = None, skip_checks=(), force: bool = False) -> list[str]:
    """The flags that select what a run is: --preset, config_flags, every --skip-check, and --force.
    Every `v4 run` command we print is built from these."""
    flags = [f"--preset {shlex.quote(preset or cfg.selection.preset)}", *config_flags(cfg)]
    flags += [f"--skip-check {shlex.quote(n)}" for n in skip_checks]
    return flags + (["--force"] if force else [])


def rerun_command(cfg, extra: str = "", *, preset: str | None = None, skip_checks=(), force: bool = False) -> str:
    """The command that repeats this run's selection (or runs `preset` with it), plus `extra`."""
    flags = selection_flags(cfg, preset=preset, skip_checks=skip_checks, force=force)
    return " ".join(["v4 run", *flags, extra]).rstrip()


def runs_command(cfg, verb: str, run_id: str) -> str:
    """`v4 runs VERB RUN` that finds this run (under the same V4_OUT)."""
    return " ".join(["v4 runs", verb, run_id, *config_flags(cfg)])


def _check_not_stopped(run, resume_cmd: str) -> None:
    """`v4 runs stop` (another process) marks the run stopped: no further step may start after it."""
    if run.stopped:
        raise JobError(f"run {run.id} was stopped (`v4 runs stop`); no further step runs",
                       fix=f"to continue it: {resume_cmd}")


@contextmanager
def signals_as_interrupt():
    """SIGTERM (a scheduler, `kill`) and SIGHUP (a closed terminal) end the launcher the way Ctrl-C does: as an
    exception, so a local job's process group is stopped and the run is not left "running". Signals already
    ignored (nohup) stay ignored; only the main thread can set handlers."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt(signal.Signals(signum).name)

    old = {}
    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) is not signal.SIG_IGN:
            old[sig] = signal.signal(sig, interrupt)
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


@contextmanager
def _rollout_scope(cfg):
    """Yields {"up": bool}: whether SGLang rollout servers of this run may be running. When the run ends any other way
    than through its rollout-down step (a failed train step, a failed bring-up, Ctrl-C, SIGTERM), they are stopped
    here: servers holding most of every GPU's memory must not outlive the run that started them."""
    live = {"up": False}
    try:
        yield live
    except BaseException as e:
        if live["up"] and isinstance(e, KeyboardInterrupt) and cfg["V4_EXECUTOR"] == "ray":
            # an interrupted launcher leaves its Ray job running (to be followed by --resume): so are its servers
            say("[rollout-down] not stopping the SGLang servers: the Ray job that uses them keeps running; "
                "`v4 cluster down` stops them")
        elif live["up"]:
            from launcher import rollout
            say("[rollout-down] the run did not finish: stopping the SGLang servers v4 started")
            try:
                reports = rollout.rollout_down(cfg, progress=say)
                if not all(r["ok"] for r in reports):
                    say("warning: some SGLang servers could not be stopped (above); `v4 cluster down` tries again")
            except Exception as e:   # noqa: BLE001 - the run's own error is the one to report
                say(f"warning: stopping the SGLang servers failed: {type(e).__name__}: {e}; `v4 cluster down` "
                    "tries again")
        raise


def _rollout(cfg, run, step: Step, live: dict) -> None:
    """rollout-up: start the SGLang servers and wait until they serve; rollout-down: stop the ones v4 recorded."""
    from launcher import rollout
    from launcher.errors import ClusterError

    if step.name == "rollout-up":
        if run.step_status("train").get("status") == "done":
            say(f"[{step.name}] the train step is done (an earlier attempt of this run): no rollout servers needed")
            return
        say(f"[{step.name}] {step.doc}")
        run.set_step(step.name, "running")
        live["up"] = True           # from here on, a failure leaves servers to stop (those that did start)
        try:
            reports = rollout.rollout_up(cfg, progress=say)
        except ClusterError:
            run.set_step(step.name, "failed")
            raise
        run.set_step(step.name, "done", servers=reports)
        return
    say(f"[{step.name}] {step.doc}")
    run.set_step(step.name, "running")
    # record-scoped: also right after a resume whose earlier attempt left servers behind
    reports = rollout.rollout_down(cfg, progress=say)
    live["up"] = False
    failed = [r["node"] for r in reports if not r["ok"]]
    run.set_step(step.name, "failed" if failed else "done", servers=reports)
    if failed:
        # the training result stands; what is left running is said, with how to stop it
        say(f"warning: SGLang servers on {', '.join(failed)} could not be stopped (above); `v4 cluster down` tries "
            "again (their processes carry V4_ROLLOUT_SESSION)")


def _check_skip_names(skip_checks) -> None:
    from launcher.preflight import select_checks

    select_checks(skip=tuple(skip_checks))     # a usage error (with did-you-mean) on an unknown name


def _as_recorded(cfg, plan: Plan, skip_checks) -> tuple:
    """A resumed run's configuration and plan for the nodes its record says it has (launcher/recovery.py)."""
    from launcher import plan as planning
    from launcher import recovery, registry

    run = registry.find_run(cfg, plan.run_id)
    rec = recovery.run_record(run)
    if not rec.left_out and not rec.standby_in:
        return cfg, plan
    new = recovery.Recovery(cfg, run, skip_checks, say).current()
    say(f"resume: run {run.id} goes on without " + ", ".join(f"{e.ip} ({e.by})" for e in rec.left_out)
        + (f", with standby {', '.join(rec.standby_in)}" if rec.standby_in else "")
        + f": {len(new.nodes)} node(s), world {new['WORLD_SIZE']}")
    return new, planning.build(new, run_id=plan.run_id)


def _adopt(run, cfg) -> Plan:
    """The plan for `cfg` (a smaller cluster), written with its config.json: what every later job reads."""
    from launcher import plan as planning

    plan = planning.build(cfg, run_id=run.id)
    run.write_json("config.json", {"values": cfg.job_values()}, private=True)
    run.write_json("plan.json", plan.to_json())
    return plan


def _preflight(cfg, run, step: Step, skip_checks, recov=None):
    """Preflight on every node; the configuration to go on with: `cfg`, or with `recov` (--exclude-bad-nodes) the one
    without the nodes that failed (PreflightError when that cannot be)."""
    from launcher import preflight, recovery

    say(f"[preflight] {len(cfg.nodes)} node(s)")
    run.set_step(step.name, "running")
    results = preflight.run_checks(cfg, run=run)
    strict = cfg["PRESET_STRICT_PREFLIGHT"]
    say(preflight.render_table(results, strict))
    run.record_preflight(results)
    failing = [r for r in preflight.failed(results, strict) if r.name not in skip_checks]
    skipped = sorted({r.name for r in preflight.failed(results, strict)} - {r.name for r in failing})
    if skipped:
        say(f"[preflight] going on despite {', '.join(skipped)} (--skip-check)")
    if failing and recov is not None:
        try:
            new = recov.leave_out(cfg, results, failing)
        except PreflightError:
            run.set_step(step.name, "failed")
            raise
        recovery.readmit(cfg, [n for n in new.nodes if n in cfg.nodes], say)
        run.set_step(step.name, "done", left_out=sorted({r.node for r in failing}))
        return new
    if failing:
        run.set_step(step.name, "failed")
        names = sorted({r.name for r in failing})
        raise PreflightError(
            f"preflight: {len(failing)} failing check(s): "
            + "; ".join(f"{r.name} on {r.node}: {r.detail}" for r in failing[:5]),
            fix=(failing[0].fix or "") + f"   (or skip: {' '.join('--skip-check ' + n for n in names)}; or leave "
                                         "the failing nodes out: --exclude-bad-nodes)")
    recovery.readmit(cfg, cfg.nodes, say)
    run.set_step(step.name, "done")
    return cfg


# What to do with the job an earlier attempt of this run left behind (the launcher was interrupted or killed).
FOLLOW, COLLECT, STOP, REFUSE, NEW = "follow", "collect", "stop", "refuse", "new"
ALIVE = ("PENDING", "RUNNING")


def stop_requested(step_status: dict) -> bool:
    """Whether someone asked the step's job to stop: an interrupted launcher stopping its local job, `v4 runs stop`, or
    the step's deadline. Such a job, still alive, is on its way out (saving, exiting): not a result to wait for."""
    return bool(step_status.get("stop_requested") or step_status.get("status") == "stopped"
                or step_status.get("job_status") == "TIMEOUT")


def resume_action(step_status: dict, job_state: str | None, can_follow: bool = True, restart: bool = False) -> str:
    """Decide, for a step not yet done, from its record and what its executor now says of the recorded job (Ray's job
    status; for a local job RUNNING while its process group lives, else how it ended; None: unknown or gone):
      follow  - still PENDING/RUNNING: wait for that job to end and take its outcome, never start a second one
      collect - it SUCCEEDED while nobody watched: take its result, the step is done
      stop    - alive, but on its way out (stop_requested) or `restart` (--restart-running) asked: stop it, wait for
                its end, then a new job
      refuse  - maybe alive, but this launcher can neither follow nor stop it (a local job on another host);
                with `restart` a new job all the same
      new     - nothing alive to reuse: a new job, under a new id (Ray never reuses one).
    The step's recorded status (running, interrupted, failed, stopped) does not decide by itself: a launcher that died
    of a bug leaves "failed" on a job that still runs, and a second job beside it is the one thing never to start."""
    if not step_status.get("submission_id"):
        return NEW
    if job_state in ALIVE:
        if not can_follow:
            return NEW if restart else REFUSE          # --restart-running: the person says it is gone (a lost host)
        return STOP if restart or stop_requested(step_status) else FOLLOW
    if job_state == "SUCCEEDED" and can_follow:
        return COLLECT
    return NEW


def exit_record_path(log_path: Path) -> Path:
    """Where a local job's supervisor records how it ended (local_supervisor.py), next to the step's log."""
    return Path(log_path).parent / "exit.json"


def _exit_record(log_path: Path, submission_id: str) -> dict | None:
    try:
        rec = json.loads(exit_record_path(log_path).read_text())
    except (OSError, ValueError):
        return None
    return rec if isinstance(rec, dict) and rec.get("submission_id") == submission_id else None


def _local_state(status: dict, run, log_path: Path) -> str | None:
    """A local job's state as resume_action reads it: RUNNING while its group lives, then from its exit record. A job
    that exited 0 after it was asked to stop (a trainer saving on SIGTERM) did not finish its work: STOPPED."""
    if status.get("host") == socket.gethostname() and group_alive(status["pgid"], run.dir):
        return "RUNNING"
    rec = _exit_record(log_path, status["submission_id"])
    if rec is None:
        return None
    if stop_requested(status):
        return "STOPPED"
    return "SUCCEEDED" if rec.get("exit_code") == 0 else "FAILED"


def _earlier_job_state(cfg, run, status: dict, jobs) -> tuple[str | None, bool]:
    """(state of the job an earlier attempt of this step recorded, whether this launcher can follow or stop it)."""
    if not status.get("submission_id"):
        return None, True
    if status.get("pgid"):
        state = _local_state(status, run, run.step_log(status["name"]))
        if status.get("host") == socket.gethostname() or state is not None:
            return state, True               # seen here, or ended with a record in the shared run directory
        # a local job on another host, not known to have ended: only that host can see it
        if status.get("status") in ("running", "interrupted"):
            return "RUNNING", False
        return None, True
    if cfg["V4_EXECUTOR"] == "ray":
        return jobs.job_status(cfg, status["submission_id"]), True
    return None, True


# How long a job asked to stop (--restart-running, or one an earlier attempt was stopping) may take to end.
STOP_WAIT_S = 120.0


def _stop_earlier(cfg, run, step: Step, status: dict, jobs) -> None:
    """Stop the job an earlier attempt of `step` left alive and wait for its end: the next job may need its ports,
    GPUs and outputs."""
    sid = status["submission_id"]
    run.set_step(step.name, status.get("status") or "interrupted", stop_requested=True)
    if status.get("pgid"):
        stop_group(status["pgid"])
        ended = _wait_until(lambda: not group_alive(status["pgid"], run.dir), STOP_WAIT_S)
    else:
        jobs.stop(cfg, sid)
        ended = _wait_until(lambda: jobs.job_status(cfg, sid) not in ALIVE, STOP_WAIT_S)
    if not ended:
        what = f"process group {status['pgid']}" if status.get("pgid") else f"Ray job {sid}"
        raise JobError(f"{step.name}: the {what} of an earlier attempt did not end within {STOP_WAIT_S:.0f} s of being "
                       "stopped; a new job beside it would share its ports and outputs",
                       fix=f"{runs_command(cfg, 'stop', run.id)}, then resume again")


def _wait_until(pred, timeout_s: float, poll_s: float = 0.5) -> bool:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(poll_s)
    return True


def _job(cfg, run, step: Step, jobs, resume_cmd: str = "", restart_running: bool = False, recov=None):
    """Run (or follow, or take the result of) the step's job; with `recov`, a job ended by a lost node or a hang runs
    again within PRESET_MAX_RESTARTS (launcher/recovery.py). The configuration to go on with: `cfg`, or the one for
    the smaller cluster a restart left."""
    from launcher import recovery
    status = run.step_status(step.name)
    if status.get("status") == "done":
        say(f"[{step.name}] done in an earlier attempt of this run; skipped")
        return cfg
    say(f"[{step.name}] {step.doc}")
    log = run.step_log(step.name)
    local = cfg["V4_EXECUTOR"] == "local"
    state, can_follow = _earlier_job_state(cfg, run, status, jobs)
    action = resume_action(status, state, can_follow, restart_running)
    sid = status.get("submission_id")
    if action == REFUSE:
        raise JobError(f"{step.name}: the local job of an earlier attempt (process group {status['pgid']}) may still "
                       f"run on {status.get('host')} (it left no exit record); a second one here would work on the "
                       "same outputs",
                       fix=f"on {status.get('host')}: {runs_command(cfg, 'stop', run.id)}, then resume again (or "
                           f"resume there); if {status.get('host')} is gone: --restart-running")
    if state == "RUNNING" and not can_follow:
        say(f"warning: {step.name}: the local job of an earlier attempt may still run on {status.get('host')}; "
            "starting a new one here all the same (--restart-running)")
    if action == STOP:
        why = "--restart-running" if restart_running else "an earlier attempt was stopping it"
        say(f"[{step.name}] job {sid} of an earlier attempt is {state}: stopping it first ({why}), then a new job")
        _stop_earlier(cfg, run, step, status, jobs)
        status = run.step_status(step.name)
        action = NEW
    try:
        if action in (FOLLOW, COLLECT):
            say(f"[{step.name}] job {sid} of an earlier attempt is {state}: "
                + ("following it, not starting another" if action == FOLLOW else "taking its result"))
            # the step is this attempt's again (`v4 runs stop` and `runs logs -f` look for running steps); its
            # PRESET_JOB_TIMEOUT counts from when that job started, not from this resume
            started = status.get("started_at") or time.time()
            run.set_step(step.name, "running", started_at=started, finished_at=None)
            left = max(step.job.timeout_s - (time.time() - started), 1.0)
            if local:
                outcome = follow_local(status, run.dir, log, left, on_stop=lambda: run.set_step(
                    step.name, "running", stop_requested=True))
            else:
                outcome = jobs.wait(cfg, sid, left, log_path=log, progress=say, run_dir=run.dir,
                                    watch=recovery.node_watch(cfg))
        else:
            outcome = _new_job(cfg, run, step, log, jobs)
        # a job ended by a lost node or a hang: the step again, from its last checkpoint, within the budget
        while not outcome.ok and recov is not None and not run.stopped:
            run.set_step(step.name, "failed", **outcome.to_json())
            again = recov.restart(cfg, step, outcome)
            if again is None:
                break
            cfg, step = again.cfg, again.step
            outcome = _new_job(cfg, run, step, log, jobs)
            recov.started(outcome.submission_id)
    except recovery.HeadLost:
        run.set_step(step.name, "failed", job_status="HEAD_LOST", ok=False)
        raise
    if not outcome.ok and run.stopped:   # `v4 runs stop` ended the job: its failure is the stop, not the step's
        run.set_step(step.name, "stopped", **outcome.to_json())
        _check_not_stopped(run, resume_cmd)
    run.set_step(step.name, "done" if outcome.ok else "failed", **outcome.to_json())
    if step.name == "train":
        _plot_metrics(run)
    if outcome.ok:
        say(f"[{step.name}] done in {outcome.elapsed_s:.0f} s")
        return cfg
    # why a lost node or a hang was not restarted (the budget spent, the layout that no longer fits, the head)
    unrestarted = f"; {recov.note}" if recov is not None and recov.note else ""
    tail = "\n    ".join(outcome.log_tail.splitlines()[-15:])
    if outcome.exit_code == NONFINITE:
        nf = run.dir / "steps" / step.name / "nonfinite.json"
        where = json.loads(nf.read_text()) if nf.is_file() else {}
        first = (f"first module {where['module']}" if where.get("module") else
                 f"no module named ({where['note']})" if where.get("note") else "first module ?")
        raise NonFiniteError(f"{step.name}: non-finite loss/gradient at step {where.get('step', '?')}, rank "
                             f"{where.get('rank', '?')}, {first}",
                             fix=f"see {nf}; find the cause (replays the step, switch by switch): "
                                 f"{' '.join(['v4 nan bisect', run.id, *config_flags(cfg)])}")
    if outcome.hang:                   # the hang watchdog stopped it (launcher/watchdog.py)
        from launcher import watchdog
        e = watchdog.hang_error(step.name, outcome.hang)
        e.message += unrestarted
        raise e
    if outcome.exit_code == TIMEOUT or outcome.status == "TIMEOUT":
        raise Timeout(f"{step.name}: no result within {step.job.timeout_s:.0f} s (PRESET_JOB_TIMEOUT)")
    why = f"exit code {outcome.exit_code}" if outcome.exit_code is not None else outcome.message or "no exit code"
    raise JobError(f"{step.name}: job {outcome.status} ({why}){unrestarted}\n    {tail}", fix=f"full log: {log}")


def _new_job(cfg, run, step: Step, log: Path, jobs):
    """A new job for `step` (under a fresh id when the step had jobs before: Ray never reuses one), followed to its
    end: the local executor's process group, or a Ray job with its nodes watched (launcher/recovery.py)."""
    from launcher import recovery
    status = run.step_status(step.name)
    attempts = len(status.get("submission_ids", []))
    if attempts:
        # Ray keeps finished submissions: a resumed step needs a fresh id
        step.job.submission_id = f"{step.job.submission_id}-r{attempts}"
    recovery.mark_restart(step.job, len(recovery.run_record(run).restarts), attempts, recovery.spent(run))
    # pgid/host and the outcome fields: an earlier attempt's are not this attempt's
    run.set_step(step.name, "running", submission_id=step.job.submission_id, pgid=None, host=None,
                 job_status=None, exit_code=None, ok=None, stop_requested=None, finished_at=None, hang=None,
                 lost=None)
    if cfg["V4_EXECUTOR"] == "local":
        # recorded so that `v4 runs stop` (another process) can stop the job's whole process group
        def started(pgid: int) -> None:
            run.set_step(step.name, "running", pgid=pgid, host=socket.gethostname())

        def stopping() -> None:   # before its group gets SIGTERM: a resume must not wait for what it saves then
            run.set_step(step.name, "running", stop_requested=True)
        return run_local(cfg, step.job, log, on_start=started, on_stop=stopping)
    return jobs.submit_and_wait(cfg, step.job, log_path=log, progress=say, watch=recovery.node_watch(cfg))


def _gates(cfg, run, plan: Plan) -> None:
    results = gating.evaluate(cfg["PRESET_GATES"], run.dir, cfg)
    run.write_json("gates.json", [asdict(r) for r in results])
    for r in results:
        say(f"[gate] {'PASS' if r.passed else 'FAIL'} {r.name}: {r.detail}")
    failed = [r for r in results if not r.passed]
    if failed:
        raise GateError("gate(s) failed: " + ", ".join(f"{r.name} ({r.detail})" for r in failed))
    if cfg["PRESET_STAGE"] and results:
        # a stage with no gates evaluated proves nothing and unlocks nothing; nor does a cut-down run of it
        dropped = gating.left_out(cfg)
        if dropped:
            say(f"[gate] not recorded as a pass of stage {cfg['PRESET_STAGE']}: this run left out the preset's "
                + ", ".join(dropped))
        else:
            gating.record_pass(cfg, cfg["PRESET_STAGE"], plan.run_id, results)


NEXT_STAGE = {"smoke": "dryrun", "dryrun": "full", "rl_smoke": "rl_dryrun", "rl_dryrun": "rl_full"}


def _plot_metrics(run) -> None:
    """RUN/plots/metrics.png after every train step, finished or not: the curves are the first thing to look at."""
    from launcher import compare
    rows = compare.read_metrics(run.dir)
    if not rows:
        return
    try:
        path = compare.plot({run.id: rows}, run.dir / "plots" / "metrics.png", title=run.id)
        say(f"[train] plots: {path}")
    except Exception as e:             # a plot must never fail the run
        say(f"[train] note: no plot ({type(e).__name__}: {e})")


def _print_failure(run, plan: Plan, status: str, code: int, error: str, fix: str, elapsed: float, resume: str) -> None:
    """`run --json` answers on stdout whatever happened: a script must not have to parse stderr to learn why."""
    print(json.dumps({"run_id": plan.run_id, "run_dir": str(run.dir), "status": status, "exit_code": code,
                      "error": error, "fix": fix or None, "elapsed_s": round(elapsed, 1),
                      "steps": {s["name"]: s.get("status") for s in run.steps()}, "resume": resume}, indent=2),
          flush=True)


RL_STEP_PARTS = ("time_rollout_s", "time_logprob_s", "time_train_s", "time_sync_s", "time_wait_s")


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
    for key in ("model_tflops", "mfu"):           # SFT steps: model FLOPs (dsv4/flops.py) and MFU, steady steps
        vals = [r[key] for r in steady if isinstance(r.get(key), (int, float))]
        summary[key] = sum(vals) / len(vals) if vals else None
    from launcher import recovery
    summary.update(recovery.summary(run))          # nodes left out and why, restarts, steps trained twice
    rl = cfg["PRESET_MODE"] == "rl" and any("reward_mean" in r for r in rows)
    if rl:   # the reward curve's start and end: the mean of the gate's first and last windows
        w = max(1, min(cfg["PRESET_RL_GATE_WINDOW"], len(rows)))
        summary["reward_first"] = sum(r["reward_mean"] for r in rows[:w]) / w
        summary["reward_last"] = sum(r["reward_mean"] for r in rows[-w:]) / w
        # the steady steps' time by part (dsv4/rl/loop.py StepClock), each a mean, together the mean step time
        parts = {k: [r[k] for r in steady if isinstance(r.get(k), (int, float))] for k in RL_STEP_PARTS}
        summary["step_parts_s"] = {k[5:-2]: sum(v) / len(v) for k, v in parts.items() if v} or None
    ray = None
    if cfg["V4_EXECUTOR"] == "ray":
        # Ray is left up, and said so: it is this checkout's cluster, not this run's (another run may be using it),
        # and the next run starts at once; `v4 cluster down` stops it.
        from launcher.cluster import left_running
        ray = summary["ray_left_running"] = {**left_running(cfg),
                                             "down": " ".join(["v4 cluster down", *config_flags(cfg)])}
    run.write_json("summary.json", summary)
    if as_json:
        print(json.dumps(summary, indent=2))
    nxt = NEXT_STAGE.get(cfg["PRESET_STAGE"])
    fmt = lambda v, f: "-" if v is None else format(v, f)
    progress = (f"reward {summary['reward_first']:.3f} -> {summary['reward_last']:.3f} (first/last {w} steps)"
                if rl else f"loss {fmt(summary['loss_first'], '.4f')} -> {fmt(summary['loss_last'], '.4f')}")
    speed = "" if summary["model_tflops"] is None else f", {summary['model_tflops']:.3g} TFLOP/s" + (
        f" (MFU {summary['mfu']:.1%} of {cfg['HW_PEAK_TFLOPS']:g} a GPU)" if summary["mfu"] is not None else "")
    say(f"\nrun {plan.run_id} PASSED in {elapsed:.0f} s: {summary['steps']} steps, {progress}, "
        f"{fmt(summary['step_time_s'], '.2f')} s/step, {fmt(summary['tokens_per_s'], '.0f')} tokens/s{speed}, "
        f"peak {fmt(summary['peak_mem_gb'], '.2f')} GB")
    if rl and summary["step_parts_s"]:
        say("a step: " + ", ".join(f"{k} {v:.2f} s" for k, v in summary["step_parts_s"].items()))
    for e in summary["left_out"]:
        say(f"left out: {e['ip']} ({e['by']}: {e['why'][:200]})"
            + (f"; standby {e['replaced_by']} took its place" if e["replaced_by"] else ""))
    if summary["restarts"] or summary["engine_restarts"]:
        eng = (f", {summary['engine_restarts']} rollout engine(s) restarted ({summary['samples_regenerated']} "
               "sample(s) rolled out again)") if summary["engine_restarts"] else ""
        say(f"restarts: {summary['restarts'] + summary['engine_restarts']} ({'; '.join(summary['restart_causes'])}), "
            f"{summary['steps_lost']} step(s) trained twice{eng}; `v4 runs show {run.id}` has each")
    if ray:
        size = "" if ray["processes"] is None else f"; {ray['processes']} processes, {ray['memory_mb']} MB here"
        say(f"Ray stays up for later runs: cluster {ray['cluster']} ({ray['nodes']} node(s)), GCS {ray['gcs']}, "
            f"dashboard {ray['dashboard']}, client server {ray['client_server']}{size}")
        say(f"  stop it: {ray['down']}")
    say("next:")
    say(f"  {runs_command(cfg, 'show', plan.run_id)}")
    if nxt:
        say(f"  {rerun_command(cfg, '--dry-run', preset=nxt)}")


# How long a stopped local job gets to exit on SIGTERM (save, flush, release GPUs) before SIGKILL.
STOP_GRACE_S = 10.0
SUPERVISOR = Path(__file__).with_name("local_supervisor.py")


def run_local(cfg, job, log_path: Path, progress=say, on_start=None, on_stop=None):
    """The V4_EXECUTOR=local path: the step's entrypoint as a subprocess here, same env, same log.

    The job gets its own session (process group) so that a timeout, Ctrl-C/SIGTERM of the launcher or `v4 runs
    stop` ends all of its processes. Its leader is local_supervisor.py, which records the job's exit status next to
    the log, and its output goes to the log file itself (read back here for progress): a launcher that dies leaves a
    job that neither loses its output nor dies of a broken pipe, and that a resume can follow (follow_local). The
    deadline is enforced by waiting on the process, not by reading its output: a job that prints nothing is timed
    out all the same. on_start(pgid) is called once it runs, on_stop() before its group is stopped."""
    import re
    import subprocess

    env = dict(os.environ)
    for k, v in job.runtime_env["env_vars"].items():
        env[k] = re.sub(r"\$\{(\w+)\}", lambda m: os.environ.get(m.group(1), ""), v)
    env["PYTHONPATH"] = job.runtime_env["working_dir"] + (":" + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    exit_record_path(log_path).unlink(missing_ok=True)
    t0 = time.time()
    from launcher import watchdog          # the hang watchdog: before the job starts, as it clears old heartbeats
    dog = watchdog.for_job(cfg, job.runtime_env["env_vars"].get("V4_RUN_DIR"), progress, fresh=True)
    progress(f"running {job.entrypoint}")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-I", str(SUPERVISOR), str(exit_record_path(log_path)),
                                 job.submission_id, job.entrypoint],
                                cwd=job.runtime_env["working_dir"], env=env, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    tail = _LogTail(log_path, progress)
    status = None
    try:
        if on_start is not None:
            on_start(proc.pid)
        try:
            watchdog.wait_process(proc, job.timeout_s, dog)
        except subprocess.TimeoutExpired:
            status = "TIMEOUT"
            progress(f"still running after {job.timeout_s:g} s (PRESET_JOB_TIMEOUT); stopping it")
        except watchdog.Hung:
            status = "HUNG"
            progress("hung (the watchdog above); stopping it")
    finally:
        if proc.poll() is None:      # timed out, or we are being interrupted: stop its whole group
            if on_stop is not None:
                on_stop()
            stop_group(proc.pid, reap=proc)
        rc = proc.wait()
        tail.close()
    rec = _exit_record(log_path, job.submission_id)
    if rec is not None:
        rc = rec["exit_code"]              # the job's own code (-N: killed by signal N), not its supervisor's
    outcome = _local_outcome(job.submission_id, status or ("SUCCEEDED" if rc == 0 else "FAILED"), rc,
                             time.time() - t0, log_path)
    if status == "HUNG":
        outcome.exit_code, outcome.message, outcome.hang = TIMEOUT, dog.hang.message, dog.hang.model_dump()
    return outcome


def follow_local(status: dict, run_dir: Path, log_path: Path, timeout_s: float, progress=say, on_stop=None):
    """Follow the local job an earlier attempt of this step started (`status` records its submission_id and pgid):
    its log as it grows, until its process group is gone or `timeout_s` passes (then it is stopped: TIMEOUT), and
    its outcome from the record its supervisor leaves: this launcher is not its parent and cannot wait on it.
    Interrupted, it stops the job as run_local would (on_stop() first)."""
    pgid, sid, log_path = status["pgid"], status["submission_id"], Path(log_path)
    t0 = time.time()
    tail = _LogTail(log_path, progress)
    timed_out = False
    try:
        deadline = time.monotonic() + timeout_s
        while group_alive(pgid, run_dir):
            if time.monotonic() > deadline:
                timed_out = True
                progress(f"still running after {timeout_s:.0f} s more (PRESET_JOB_TIMEOUT); stopping it")
                break
            time.sleep(0.2)
    finally:
        if group_alive(pgid, run_dir):
            if on_stop is not None:
                on_stop()
            stop_group(pgid)
        tail.close()
    if timed_out:
        return _local_outcome(sid, "TIMEOUT", TIMEOUT, time.time() - t0, log_path)
    rec = _exit_record(log_path, sid)
    if rec is None:
        return _local_outcome(sid, "FAILED", None, time.time() - t0, log_path,
                              "the job ended without recording its exit status (killed with SIGKILL?)")
    return _local_outcome(sid, "SUCCEEDED" if rec["exit_code"] == 0 else "FAILED", rec["exit_code"], time.time() - t0,
                          log_path)


def _local_outcome(sid: str, status: str, rc, elapsed: float, log_path: Path, message: str = ""):
    from launcher.jobs import Outcome

    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except OSError:
        lines = []
    return Outcome(sid, status, TIMEOUT if status == "TIMEOUT" else rc, elapsed, message, str(log_path),
                   "\n".join(lines[-40:]))


class _LogTail:
    """Progress lines (`  | ...`) from a log file another process writes, from its start, until close() (which
    reads what is left first)."""

    def __init__(self, path: Path, progress, poll_s: float = 0.2):
        import codecs
        self.path, self.progress, self.poll_s = path, progress, poll_s
        self.done = threading.Event()
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        pending = ""
        try:
            with open(self.path, "rb") as f:
                while True:
                    chunk = f.read(1 << 16)
                    if chunk:
                        *lines, pending = (pending + self.decoder.decode(chunk)).split("\n")
                        for line in lines:
                            self.progress("  | " + line.rstrip("\r"))
                    elif self.done.is_set():
                        break
                    else:
                        time.sleep(self.poll_s)
        except OSError:
            return
        pending += self.decoder.decode(b"", final=True)
        if pending:
            self.progress("  | " + pending)

    def close(self) -> None:
        self.done.set()
        self.thread.join(timeout=10)


def _group_members(pgid: int) -> list[int] | None:
    """The live (not zombie) processes of group `pgid`, from /proc; None where there is no /proc."""
    if not os.path.exists("/proc/self/stat"):
        return None
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue                       # ended meanwhile
        state, _ppid, pgrp = stat[stat.rindex(b")") + 2:].split()[:3]
        if int(pgrp) == pgid and state not in (b"Z", b"X"):
            out.append(int(name))
    return out


def group_alive(pgid: int, run_dir: Path | str | None = None) -> bool:
    """Whether process group `pgid` still has a live process, and (given `run_dir`) is a job of that run.

    Zombies do not count: a job whose launcher died is reparented to pid 1, and where pid 1 reaps nothing (a
    container without an init) its ended processes stay zombies, which signal 0 still reaches.
    A recorded pgid may be reused once its group is gone: if its leader's pid now belongs to a process
    without V4_RUN_DIR=run_dir in its environment, it is someone else's. (While any process of a group lives,
    Linux does not hand out its id again, so a group without its leader is still ours.)"""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return False             # another user's: not a job we started
    members = _group_members(pgid)
    if members is not None and not members:
        return False             # only zombies left
    if run_dir is None:
        return True
    if members is not None and pgid not in members:
        return True              # the leader is gone, the rest of its group is not
    try:
        environ = Path(f"/proc/{pgid}/environ").read_bytes().split(b"\0")
    except FileNotFoundError:
        return True              # the leader is gone, the rest of its group is not
    except OSError:
        return True              # no /proc (not Linux): trust the record
    marks = [e[len(b"V4_RUN_DIR="):].decode(errors="replace") for e in environ if e.startswith(b"V4_RUN_DIR=")]
    return any(Path(m) == Path(run_dir) for m in marks)          # Path: `out//id` and `out/id` are one run


def stop_group(pgid: int, grace_s: float | None = None, reap=None) -> bool:
    """SIGTERM to process group `pgid`, SIGKILL to whatever is left after `grace_s` (STOP_GRACE_S). False if it
    was gone.

    reap: the leader's Popen when this process is its parent, polled so that a dead leader (a zombie until
    reaped) does not keep the group looking alive for the whole grace period."""
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return False
    deadline = time.monotonic() + (STOP_GRACE_S if grace_s is None else grace_s)
    while time.monotonic() < deadline:
        if reap is not None:
            reap.poll()
        if not group_alive(pgid):
            return True
        time.sleep(0.1)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return True
