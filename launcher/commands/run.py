"""`v4 run`: plan a staged experiment, then (without --dry-run) execute it."""
from __future__ import annotations

import json

import click

from launcher.cli_options import config_options, load_config


@click.command("run")
@config_options(preset_required=True)
@click.option("--dry-run", "--dryrun", "dry_run", is_flag=True,
              help="print the whole plan and touch nothing (no SSH, no Ray, no files)")
@click.option("--json", "as_json", is_flag=True, help="print the plan (or the run summary) as JSON on stdout")
@click.option("--skip-check", "skip_checks", multiple=True, metavar="NAME",
              help="run even if this preflight check fails (repeatable)")
@click.option("--force", is_flag=True, help="start even if the previous stage has not passed for this config")
@click.option("--resume", metavar="RUN_ID", help="continue a run that stopped: finished steps are skipped")
def run(selection, dry_run, as_json, skip_checks, force, resume):
    """Run a staged experiment: preflight, cluster up, pipeline steps as Ray jobs, gates."""
    from launcher import plan as planning

    cfg = load_config(selection)
    plan = planning.build(cfg, run_id=resume)
    if dry_run:
        click.echo(json.dumps(plan.to_json(), indent=2) if as_json else plan.render())
        return
    from launcher.pipeline import execute

    execute(cfg, plan, skip_checks=skip_checks, force=force, resume=bool(resume), as_json=as_json)
