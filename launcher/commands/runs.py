"""`v4 runs ls | show | logs | stop`: the run registry under V4_OUT."""
from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import click

from launcher.cli_options import config_options, load_config
from launcher.table import table as render_table


def _when(t) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "-"


@click.group("runs")
def runs():
    """List runs, show one, print or follow its logs, stop it."""


@runs.command("ls")
@config_options()
@click.option("--json", "as_json", is_flag=True, help="machine-readable output (schema 1)")
def ls(selection, as_json):
    """Every run under V4_OUT, oldest first."""
    from launcher import registry
    cfg = load_config(selection)
    rows = registry.list_runs(cfg)
    if as_json:
        click.echo(json.dumps({"schema": 1, "runs": rows}, indent=2))
        return
    if not rows:
        click.echo(f"no runs under {registry.out_dir(cfg)}", err=True)
        return
    table = [("RUN", "STATUS", "STAGE", "PRESET", "CLUSTER", "CREATED", "STEPS")]
    table += [(r["id"], r["status"], r["stage"] or "-", r["preset"] or "-", r["cluster"] or "-",
               _when(r["created_at"]), f"{r['steps_done']}/{r['steps']}") for r in rows]
    click.echo(render_table(table))


@runs.command("show")
@config_options()
@click.argument("run_ref", metavar="RUN")
@click.option("--json", "as_json", is_flag=True, help="run.json, steps, gates, summary and the recovery record (its "
              "restarts, the rollout engine's, the budget left) as one JSON object")
def show(selection, run_ref, as_json):
    """One run: status, restarts (a step's, and the RL rollout engine's) of its PRESET_MAX_RESTARTS and nodes left
    out, steps (with job ids), gates, summary. RUN: id, unique prefix, or `latest`."""
    from launcher import recovery, registry
    cfg = load_config(selection)
    run = registry.find_run(cfg, run_ref)
    info, steps = run.info(), run.steps()
    gates, summary = run.read_json("gates.json"), run.read_json("summary.json")
    rec, eng = recovery.run_record(run), recovery.engine_restarts(run)
    budget = ((run.read_json("config.json") or {}).get("values") or {}).get("PRESET_MAX_RESTARTS")
    if as_json:
        spent = len(rec.restarts) + len(eng)
        click.echo(json.dumps({"schema": 1, "run": {**info, "effective_status": registry.effective_status(info)},
                               "dir": str(run.dir), "steps": steps, "gates": gates, "summary": summary,
                               "recovery": {**rec.model_dump(), "engine_restarts": [e.model_dump() for e in eng],
                                            "max_restarts": budget, "restarts_spent": spent,
                                            "restarts_left": None if budget is None else max(0, budget - spent)}},
                              indent=2))
        return
    click.echo(f"run {run.id}: {registry.effective_status(info)}   ({run.dir})")
    click.echo(f"  created {_when(info.get('created_at'))}, finished {_when(info.get('finished_at'))}"
               + (f", exit code {info['exit_code']}" if info.get("exit_code") is not None else ""))
    if info.get("error"):
        click.echo(f"  error: {info['error']}")
    for line in _recovery_lines(rec, eng, budget):
        click.echo(line)
    for s in steps:
        took = (s.get("finished_at") or time.time()) - s["started_at"] if s.get("started_at") else None
        job = s.get("submission_id") or ""
        click.echo(f"  step {s['name']:<16} {s['status']:<8} {f'{took:.0f} s' if took is not None else '':>7}  {job}")
    for g in gates or []:
        click.echo(f"  gate {g['name']:<16} {'PASS' if g.get('passed') else 'FAIL'}  {g.get('detail', '')}")
    for png in sorted((run.dir / "plots").glob("*.png")):
        click.echo(f"  plot {png}")
    if (run.dir / "tb").is_dir():
        click.echo(f"  tensorboard --logdir {run.dir / 'tb'}")


def _recovery_lines(rec, eng, budget) -> list[str]:
    """The run's restarts at a glance -- how many of its PRESET_MAX_RESTARTS (the run's, over all its launches), the
    steps trained twice, the samples its RL jobs rolled out again; then each in time order: a step's restart (cause,
    when, from which checkpoint, the jobs) or a rollout engine the RL job restarted (the training step, the phase, the
    cause, how long until it was back) -- and the nodes it went on without."""
    from launcher.recovery import EngineRestart
    out = []
    if rec.restarts or eng:
        n = len(rec.restarts) + len(eng)
        of = f" of PRESET_MAX_RESTARTS={budget} for the run ({max(0, budget - n)} left)" if budget is not None else ""
        again = (f", {len(eng)} of the rollout engine ({sum(e.samples for e in eng)} sample(s) rolled out again)"
                 if eng else "")
        out.append(f"  restarts: {n}{of}, {sum(r.steps_lost for r in rec.restarts)} step(s) trained twice{again}")
        for r in sorted([*rec.restarts, *eng], key=lambda r: r.at):
            out += _engine_restart_lines(r) if isinstance(r, EngineRestart) else _restart_lines(r)
    for e in rec.left_out:
        out.append(f"  left out: {e.ip} ({e.by}" + (f" in {e.step}" if e.step else "") + f", {_when(e.at)}): "
                   f"{e.why[:200]}" + (f"; standby {e.replaced_by} in its place" if e.replaced_by else ""))
    return out


def _restart_lines(r) -> list[str]:
    """A step's restart (launcher/recovery.py Restart): two lines."""
    if r.cause == "node_lost":
        what = f"node lost: {', '.join(r.nodes)}"
        after = (f", noticed {r.noticed_after_s:.0f} s after the GCS declared it dead"
                 if r.noticed_after_s is not None else "")
    else:
        what = f"hung: {r.detail.split(';')[0][:160]}"
        after = f", after {r.noticed_after_s:.0f} s without a heartbeat" if r.noticed_after_s is not None else ""
    where = (f"; world {r.world_before} -> {r.world_after}" + (f", standby {', '.join(r.standby)}" if r.standby
                                                               else "")) if r.cause == "node_lost" else ""
    return [f"    #{r.n} {_when(r.at)}  {r.step}  {what}{after}",
            f"       resumed from " + (f"step {r.from_step}" if r.from_step else "the start")
            + f" ({r.steps_lost} step(s) lost){where}; job {r.job}" + (f" -> {r.next_job}" if r.next_job else "")
            + (f"; stacks {r.stacks}" if r.stacks else "")]


def _engine_restart_lines(e) -> list[str]:
    """A rollout engine the RL job restarted (launcher/recovery.py EngineRestart): two lines."""
    again = (f"{e.samples} sample(s) rolled out again" if e.phase == "rollout" else
             "the step's weights synced again (no sample lost)")
    return [f"    engine {_when(e.at)}  {e.in_step} step {e.step}  rollout engine lost during {e.phase}: "
            f"{e.cause[:160]}",
            f"       back in {e.seconds:.1f} s with the current weights; {again}"
            + (f"; job {e.job}" if e.job else "")]


# Steps whose job may be alive: running, or interrupted (Ctrl-C leaves a Ray job running; --resume follows it).
LIVE = ("running", "interrupted")


@runs.command("logs")
@config_options()
@click.argument("run_ref", metavar="RUN")
@click.argument("step", required=False)
@click.option("-f", "--follow", is_flag=True,
              help="keep printing a running step's log (a Ray job, or a local job) until it ends")
def logs(selection, run_ref, step, follow):
    """Print a run's step logs (all steps in order, or STEP)."""
    from launcher import registry
    cfg = load_config(selection)
    run = registry.find_run(cfg, run_ref)
    steps = [s for s in run.steps() if step is None or s["name"] == step]
    if step and not steps:
        raise click.UsageError(f"run {run.id} has no step {step!r} (steps: {', '.join(s['name'] for s in run.steps())})")
    for s in steps:
        if follow and s["status"] in LIVE and s.get("pgid"):
            click.echo(f"==> {s['name']} (following its local job, process group {s['pgid']}) <==", err=True)
            _follow_local(run, s)
            continue
        if follow and s["status"] in LIVE and s.get("submission_id"):
            click.echo(f"==> {s['name']} (following job {s['submission_id']}) <==", err=True)
            _follow(cfg, s["submission_id"])
            continue
        log = run.step_log(s["name"])
        if log.is_file():
            click.echo(f"==> {s['name']} <==", err=True)
            sys.stdout.write(log.read_text())
            sys.stdout.flush()


def _follow_local(run, s: dict, poll_s: float = 0.5) -> None:
    """Print a local job's step log as it grows, until its process group is gone (the launcher writes the log)."""
    import socket

    from launcher.pipeline import group_alive
    log, pos = run.step_log(s["name"]), 0
    here = s.get("host") == socket.gethostname()
    if not here:
        click.echo(f"(the job runs on {s.get('host')}: its log so far, from the shared run directory)", err=True)
    while True:
        alive = here and group_alive(s["pgid"], run.dir)     # read before the log: nothing written before it ends is lost
        if log.is_file():
            with open(log) as f:
                f.seek(pos)
                sys.stdout.write(f.read())
                pos = f.tell()
            sys.stdout.flush()
        if not alive:
            return
        time.sleep(poll_s)


def _follow(cfg, sid: str) -> None:
    from launcher import jobs

    def out(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()
    jobs.follow_logs(jobs.client(cfg), sid, out)


@runs.command("stop")
@config_options()
@click.argument("run_ref", metavar="RUN")
def stop(selection, run_ref):
    """Stop a run's running jobs (Ray jobs, or a local job's process group) and mark the run stopped."""
    from launcher import registry
    cfg = load_config(selection)
    run = registry.find_run(cfg, run_ref)
    running = [s for s in run.steps() if s["status"] in LIVE]
    _refuse_foreign_local(run, running)
    # marked first: the launcher, seeing its job end, must read "stopped" and start nothing more
    if registry.effective_status(run.info()) in ("running", "interrupted"):
        run.finish("stopped", error="stopped by `v4 runs stop`", code=1)
    stopped = []
    for s in running:
        stopped += _stop_local(run, s) if s.get("pgid") else _stop_ray(cfg, s)
        run.set_step(s["name"], "stopped")
    click.echo(f"run {run.id}: stopped" + (f" (jobs: {', '.join(stopped)})" if stopped else " (no running job)"),
               err=True)


def _refuse_foreign_local(run, running: list[dict]) -> None:
    """A local job can be stopped only from the host it runs on: say so before marking anything."""
    import socket

    from launcher.errors import JobError
    for s in running:
        if s.get("pgid") and s.get("host") != socket.gethostname():
            raise JobError(f"step {s['name']} of run {run.id} runs as process group {s['pgid']} on {s.get('host')}, "
                           f"not on this host", fix=f"run `v4 runs stop {run.id}` on {s.get('host')}")


def _stop_local(run, s: dict) -> list[str]:
    """A V4_EXECUTOR=local job: its process group (no Ray involved)."""
    from launcher.pipeline import STOP_GRACE_S, group_alive, stop_group
    pgid = s["pgid"]
    if not group_alive(pgid, run.dir):       # gone, or the id now belongs to someone else's process
        return []
    click.echo(f"step {s['name']}: SIGTERM to process group {pgid} (SIGKILL after {STOP_GRACE_S:g} s)", err=True)
    return [f"{s.get('submission_id') or s['name']} (pgid {pgid})"] if stop_group(pgid) else []


def _stop_ray(cfg, s: dict) -> list[str]:
    from launcher import jobs
    return [sid for sid in s.get("submission_ids") or [s.get("submission_id")] if sid and jobs.stop(cfg, sid)]


def _fmt_num(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)


def _tol(ctx, param, value: float) -> float:
    if not (math.isfinite(value) and value >= 0):
        raise click.BadParameter(f"{value!r}: a relative tolerance is a finite number >= 0 (0: bit-identical)")
    return value


def _metric_names(spec: str | None) -> list[str] | None:
    if spec is None:
        return None
    names = [m.strip() for m in spec.split(",") if m.strip()]
    if not names:
        raise click.UsageError(f"--metrics {spec!r} names no metric")
    return names


def _load(cfg, refs):
    """The runs named, their metrics files read against the schema -> (runs, {id: MetricsFile})."""
    from launcher import metrics, registry
    found = [registry.find_run(cfg, r) for r in refs]
    twice = sorted({r.id for r in found if [f.id for f in found].count(r.id) > 1})
    if twice:
        raise click.UsageError(f"{', '.join(twice)} named twice (as {', '.join(refs)}): name each run once")
    files = {r.id: metrics.read(r.dir) for r in found}
    return found, files


def _plot_path(out: str) -> Path:
    """-o as given, its directory already there: a typo in a path must not grow directories somewhere."""
    p = Path(out)
    parent = p.parent
    if parent.is_dir():
        if p.exists() and not _is_png(p):
            raise click.UsageError(f"-o {out}: the file exists and is not a PNG; name a new file (or an earlier "
                                   "plot) to write")
        return p
    there = parent
    while not there.exists() and there != there.parent:
        there = there.parent
    if not there.is_dir():
        raise click.UsageError(f"-o {out}: {there} is a file, not a directory")
    raise click.UsageError(f"-o {out}: the directory {parent} does not exist (nothing under {there} was created); "
                           "make it first, or write the PNG elsewhere")


def _is_png(p: Path) -> bool:
    try:
        with open(p, "rb") as f:
            return f.read(8) == b"\x89PNG\r\n\x1a\n"
    except OSError:
        return False


def _write_plot(draw, out: str) -> Path:
    from launcher.errors import ConfigError
    path = _plot_path(out)
    try:
        return draw(path)
    except OSError as e:
        raise ConfigError(f"cannot write {path}: {e.strerror or e}",
                          fix="-o a path in a directory you can write") from None


@runs.command("compare")
@config_options()
@click.argument("run_refs", metavar="RUN RUN [RUN ...]", nargs=-1, required=True)
@click.option("--metrics", help="comma-separated metrics [loss, grad_norm, and for RL reward_mean, logprob_diff_max]")
@click.option("--tol", default=0.0, show_default=True, type=float, callback=_tol,
              help="relative tolerance: |a - b| <= tol * max(|a|, |b|) counts as the same")
@click.option("--steps", "steps_spec", metavar="STEPS",
              help="compare only these steps: 3, 1-4, 2,5-8, 5- (to the last), or `common` (those every run has) "
                   "[every step any run has; a run lacking one fails the comparison]")
@click.option("--table", "show_table", is_flag=True, help="print the step-by-step table too")
@click.option("--json", "as_json", is_flag=True, help="verdicts, problems and the step table as JSON on stdout")
def compare_cmd(selection, run_refs, metrics, tol, steps_spec, show_table, as_json):
    """Compare runs step by step against the first: per metric identical, within --tol, or diverged from step k.
    The comparison fails whatever the values where a run lacks a compared step (runs of different lengths), has
    malformed lines in its metrics.jsonl (excused by --steps), or is of another mode (SFT against RL).
    Exit codes: 0 every metric identical or within tolerance and no problem, 1 a metric diverged or is missing, or
    a problem above, 2 usage."""
    from dataclasses import asdict

    from launcher import compare
    if len(run_refs) < 2:
        raise click.UsageError("compare needs two runs or more: the first is the reference")
    try:
        steps = compare.parse_steps(steps_spec) if steps_spec is not None else None
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    names = _metric_names(metrics)
    cfg = load_config(selection)
    found, files = _load(cfg, run_refs)
    empty = [f"{n} ({f.path}: " + ("missing" if not f.exists else f.bad_summary() or "empty") + ")"
             for n, f in files.items() if not f.rows]
    if empty:
        raise click.UsageError(f"no metrics rows in {', '.join(empty)}: a run that never finished a step")
    runs = {n: f.rows for n, f in files.items()}
    if names:
        try:
            compare.check_metric_names(names, runs)
        except ValueError as e:
            raise click.UsageError(str(e)) from None
    res = compare.compare(runs, names, tol, steps, bad={n: f.bad for n, f in files.items()},
                          modes={r.id: compare.run_mode(r.dir, runs[r.id]) for r in found})
    if as_json:
        click.echo(json.dumps({"schema": 1, "ok": res.ok, **asdict(res)}, indent=2, default=str))
    else:
        labels = compare.differing_keys({r.id: compare.run_config(r.dir) for r in found})
        click.echo(f"reference {res.runs[0]}" + (f"  ({', '.join(labels[res.runs[0]][:4])})" if labels[res.runs[0]] else ""))
        rows = [("RUN", "METRIC", "VERDICT", "STEPS", "MAX |DIFF|", "MAX REL", "FIRST DIVERGED")]
        for v in res.verdicts:
            first = "-" if v.first_diverged is None else \
                f"step {v.first_diverged}: {v.values_at_divergence[0]!r} vs {v.values_at_divergence[1]!r}"
            rows.append((v.run, v.metric, v.verdict, v.steps, f"{v.max_abs:.3g}", f"{v.max_rel:.3g}", first))
        click.echo(render_table(rows, right=(3, 4, 5)))
        if show_table:
            head = ["STEP"] + [f"{n[-8:]}:{m}" for n in res.runs for m in res.metrics]
            body = [tuple([t["step"]] + [_fmt_num(t[n][m]) for n in res.runs for m in res.metrics]) for t in res.table]
            click.echo(render_table([tuple(head), *body], right=tuple(range(len(head)))))
        for p in res.problems:
            click.echo(f"problem: {p.detail}", err=True)
        for note in res.notes:
            click.echo(f"note: {note}", err=True)
        why = "" if res.ok or not res.problems else \
            f" ({len(res.problems)} problem{'s' if len(res.problems) > 1 else ''} above)"
        click.echo(f"verdict: {'same' if res.ok else 'DIFFERENT'} over steps {res.steps}"
                   + (f" (tolerance {tol:g})" if tol else "") + why, err=True)
    sys.exit(0 if res.ok else 1)


@runs.command("plot")
@config_options()
@click.argument("run_refs", metavar="RUN [RUN ...]", nargs=-1)
@click.option("-o", "--out", "out", required=True, type=click.Path(dir_okay=False),
              help="the PNG to write (in a directory that exists)")
@click.option("--metrics", help="comma-separated metrics [loss, grad_norm, lr, tokens_per_s, peak_mem_gb; RL: reward "
              "and logprob mismatch]; with --records, the one metric to plot [tflops]")
@click.option("--records", type=click.Path(exists=True, dir_okay=False),
              help="plot benchmark records instead (e.g. benchmarks/records/kernels.jsonl): --benchmark across dates")
@click.option("--benchmark", "benchmarks", multiple=True, help="a benchmark id in --records (repeatable)")
def plot_cmd(selection, run_refs, out, metrics, records, benchmarks):
    """Plot metrics against step, the runs overlaid; the legend names each run's differing settings. With
    --records: a benchmark's figure across its dated records (commit on each point)."""
    from launcher import compare
    if records:
        if run_refs or not benchmarks:
            raise click.UsageError("--records plots --benchmark ID (repeatable), not runs")
        try:
            recs = compare.read_records(records)
            path = _write_plot(lambda p: compare.plot_records(recs, list(benchmarks), metrics or "tflops", p,
                                                              make_parents=False), out)
        except ValueError as e:
            raise click.UsageError(str(e)) from None
        click.echo(f"wrote {path}")
        return
    if not run_refs:
        raise click.UsageError("name the runs to plot (or --records FILE --benchmark ID)")
    names = _metric_names(metrics)
    cfg = load_config(selection)
    found, files = _load(cfg, run_refs)
    runs = {n: f.rows for n, f in files.items()}
    for n, f in files.items():
        if f.bad:
            click.echo(f"warning: {n}: {f.bad_summary()}", err=True)
    labels = compare.differing_keys({r.id: compare.run_config(r.dir) for r in found})
    legend = {n: n + (f" ({', '.join(labels[n][:3])})" if labels[n] else "") for n in runs}
    try:
        if names:
            compare.check_metric_names(names, runs)
        path = _write_plot(lambda p: compare.plot(runs, p, legend, names, make_parents=False), out)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    click.echo(f"wrote {path}")
