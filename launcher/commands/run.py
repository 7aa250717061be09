"""`v4 run`: plan a staged experiment, then (without --dry-run) execute it."""
from __future__ import annotations

import json
from contextlib import nullcontext

import click

from launcher.cli_options import config_options, load_config


@click.command("run")
@config_options(preset_required=True)
@click.option("--dry-run", "--dryrun", "dry_run", is_flag=True,
              help="print the whole plan and touch nothing (no SSH, no Ray, no files)")
@click.option("--json", "as_json", is_flag=True, help="print the plan (or the run summary) as JSON on stdout")
@click.option("--skip-check", "skip_checks", multiple=True, metavar="NAME",
              help="run even if this preflight check fails (repeatable)")
@click.option("--force", is_flag=True, help="start even if the previous stage has not passed for this config; with "
              "--resume, continue a run with settings that change what it computes")
@click.option("--resume", metavar="RUN", help="continue a run that stopped (its id, a unique prefix, or `latest`): "
              "finished steps are skipped, a job it left running (after Ctrl-C, say) is followed to its end and its "
              "outcome taken, never started a second time; one that succeeded meanwhile counts as done")
@click.option("--restart-running", is_flag=True, help="with --resume: stop a job the run left running and wait for "
              "its end, then run its step anew (instead of following it)")
@click.option("--exclude-bad-nodes", is_flag=True, help="leave out the nodes (never the head) that fail preflight "
              "instead of stopping: the run goes on without them, standbys (V4_STANDBY_IPS) in their places, its layout "
              "derived for the smaller world (refused below V4_MIN_NODES, or where it no longer divides)")
def run(selection, dry_run, as_json, skip_checks, force, resume, restart_running, exclude_bad_nodes):
    """Run a staged experiment: preflight, cluster up, pipeline steps as Ray jobs, gates."""
    from launcher.errors import V4Error
    if restart_running and resume is None:
        raise click.UsageError("--restart-running goes with --resume RUN: it restarts the jobs a run left running",
                               ctx=click.get_current_context())
    try:
        _run(selection, dry_run, as_json, skip_checks, force, resume, restart_running, exclude_bad_nodes)
    except V4Error as e:
        # --json answers on stdout whatever happened; a failure inside the run printed its own record already
        if as_json and not dry_run and not getattr(e, "reported", False):
            click.echo(json.dumps({"run_id": None, "status": "refused", "exit_code": e.code, "error": e.message,
                                   "fix": e.fix}, indent=2))
        raise


def _run(selection, dry_run, as_json, skip_checks, force, resume, restart_running=False, exclude_bad_nodes=False):
    from launcher import plan as planning
    from launcher import registry

    from launcher.config import ports
    with ports.read_only() if dry_run else nullcontext():      # a dry run records no ports either
        cfg = load_config(selection)
    # `latest` or a prefix names a run; the plan (run dir, job ids) needs its id, dry run or not
    run_id = registry.resolve_resume(cfg, resume) if resume is not None else None
    plan = planning.build(cfg, run_id=run_id)
    if dry_run:
        # the plan embeds values in scripts and environments: a secret (or a value that took one in) is masked there too
        click.echo(cfg.redact_text(json.dumps(plan.to_json(), indent=2) if as_json else plan.render()))
        # the plan is shown either way; what the run would refuse is said here too, with the same exit code
        from launcher.pipeline import check_available
        check_available(plan)
        return
    from launcher.pipeline import execute

    execute(cfg, plan, skip_checks=skip_checks, force=force, resume=run_id is not None, as_json=as_json,
            restart_running=restart_running, exclude_bad_nodes=exclude_bad_nodes)
