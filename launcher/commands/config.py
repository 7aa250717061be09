"""`v4 config show | validate | keys`."""
from __future__ import annotations

import json

import click

from launcher.cli_options import config_options, load_config
from launcher.config import KEYS, load
from launcher.errors import ConfigError
from launcher.table import table


def _json(obj) -> str:
    # allow_nan=False: NaN/Infinity are not JSON; a value that holds one is a bug to surface, not to print
    return json.dumps(obj, indent=2, allow_nan=False)


@click.group("config")
def config():
    """Show, explain and validate the layered configuration."""


@config.command("show")
@config_options()
@click.option("--explain", is_flag=True, help="add FROM (file:line / env / cli) and OVERRODE columns")
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@click.option("--no-check", is_flag=True, help="show values even when cross-checks fail")
def show(selection, explain, as_json, no_check):
    """Print the resolved configuration (secrets redacted)."""
    cfg = load(selection) if no_check else load_config(selection)
    if as_json:
        click.echo(_json(cfg.to_json()))
        return
    rows = cfg.explain()
    click.echo(f"# cluster={cfg.selection.cluster} hw={cfg.selection.hw} preset={cfg.selection.preset or '-'}", err=True)
    if not explain:
        click.echo(table([(r["key"], _fmt(r["value"])) for r in rows]))
        return
    out = [("KEY", "VALUE", "FROM", "OVERRODE")]
    for r in rows:
        o = r["overrode"]
        out.append((r["key"], _fmt(r["value"]), r["from"] + (f" = {r['written']}" if r["written"] else ""),
                    "" if o is None else f"{o['value']!r} ({o['from']})"))
    click.echo(table(out))


@config.command("validate")
@config_options()
@click.option("--json", "as_json", is_flag=True)
def validate(selection, as_json):
    """Resolve and cross-check the configuration; exit 2 naming every disagreement."""
    try:
        cfg = load_config(selection)
    except ConfigError as e:
        if as_json:
            # a script reading stdout gets a verdict either way; stderr and exit code 2 stay as without --json
            click.echo(_json({"ok": False, "errors": getattr(e, "errors", None) or [e.message], "fix": e.fix}))
        raise
    derived = {k: d.value for k, d in cfg.derived.items()}
    if as_json:
        click.echo(_json({"ok": True, "derived": derived, "warnings": cfg.warnings}))
    else:
        click.echo(f"ok: cluster={cfg.selection.cluster} hw={cfg.selection.hw} preset={cfg.selection.preset or '-'}")
        for k, v in derived.items():
            click.echo(f"  {k} = {_fmt(v)}")


@config.command("keys")
@click.option("--json", "as_json", is_flag=True)
def keys(as_json):
    """List every key the schema declares: type, default, usual layer, doc."""
    if as_json:
        click.echo(_json([k.__dict__ | {"secret": k.secret, "required": k.required} for k in KEYS]))
        return
    for k in KEYS:
        kind = k.type + (f"[{'|'.join(c or '\"\"' for c in k.choices)}]" if k.choices else "")
        click.echo(f"{k.name:<28} {kind:<22} {k.layer:<8} default={k.default!r:<14} {k.doc}")


def _fmt(v) -> str:
    return " ".join(map(str, v)) if isinstance(v, list) else str(v)
