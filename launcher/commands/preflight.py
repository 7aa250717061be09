"""`v4 preflight`: every check on every node, in parallel; exit 3 on a FAIL."""
from __future__ import annotations

import sys

import click

from launcher.cli_options import config_options, load_config
from launcher.errors import PREFLIGHT_FAILED


@click.command("preflight")
@config_options()
@click.option("--json", "as_json", is_flag=True, help="results as JSON (schema 1) on stdout")
@click.option("--only", multiple=True, metavar="NAME", help="run only this check (repeatable)")
@click.option("--skip", multiple=True, metavar="NAME", help="do not run this check (repeatable)")
@click.option("--strict", is_flag=True, help="a WARN fails too (default: PRESET_STRICT_PREFLIGHT)")
@click.option("--list", "list_checks", is_flag=True, help="list the checks and what each verifies")
def preflight(selection, as_json, only, skip, strict, list_checks):
    """Check that every node can run the job: SSH, versions, GPUs, network, disks, ports, ...

    Exit 0 when nothing FAILs (with --strict: nothing WARNs either), 3 otherwise. Each WARN/FAIL row carries a fix.
    """
    from launcher import preflight as pf
    if list_checks:
        for c in pf.CHECKS.values():
            click.echo(f"{c.name:<14} {c.doc}")
        return
    cfg = load_config(selection)
    click.echo(f"preflight: {len(cfg.nodes)} node(s) of cluster {cfg['V4_CLUSTER_NAME']}", err=True)
    strict = strict or bool(cfg.get("PRESET_STRICT_PREFLIGHT", False))
    results = pf.run_checks(cfg, only=only, skip=skip)
    # the verdict printed (table or JSON `ok`) is the one the exit code gives
    click.echo(pf.dumps(results, strict) if as_json else pf.render_table(results, strict))
    if pf.failed(results, strict=strict):
        sys.exit(PREFLIGHT_FAILED)
