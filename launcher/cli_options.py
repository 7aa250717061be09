"""Selector options shared by every command that reads the configuration."""
from __future__ import annotations

import functools

import click

from launcher.config import Selection, available, resolve
from launcher.config.resolve import ROOT


def _complete(kind: str):
    def complete(ctx, param, incomplete):
        names = available(kind, ROOT) + (["auto"] if kind == "hw" else [])
        return [n for n in names if n.startswith(incomplete)]
    return complete


def config_options(preset_required: bool = False):
    """--cluster/--hw/--preset/--env-file/--set, passed to the command as `selection`."""
    def decorate(fn):
        @click.option("--cluster", envvar="V4_CLUSTER", default="local", show_default=True,
                      shell_complete=_complete("cluster"),
                      help="cluster: a name from envs/cluster/ or a path to a .env file [env: V4_CLUSTER]")
        @click.option("--hw", envvar="V4_HW", default="auto", show_default=True, shell_complete=_complete("hw"),
                      help="hardware layer from hw/ (auto: the cluster's V4_GPU_MODEL, else this machine's GPU, else cpu)")
        @click.option("--preset", required=preset_required, shell_complete=_complete("preset"),
                      help="workload preset from presets/")
        @click.option("--env-file", "env_files", multiple=True, type=click.Path(dir_okay=False),
                      help="extra KEY=value file applied after the preset (repeatable)")
        @click.option("--set", "sets", multiple=True, metavar="KEY=VALUE",
                      help="override one key, applied last (repeatable)")
        @functools.wraps(fn)
        def wrapper(cluster, hw, preset, env_files, sets, **kw):
            sel = Selection(cluster=cluster, hw=hw, preset=preset, env_files=tuple(env_files), sets=tuple(sets))
            return fn(selection=sel, **kw)
        return wrapper
    return decorate


def load_config(selection: Selection):
    cfg = resolve(selection)
    for w in cfg.warnings:
        click.echo(f"warning: {w}", err=True)
    return cfg
