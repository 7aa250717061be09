"""`v4 nan ...`: NaN triage. `bisect-kernel` names the TileLang pass-config setting (and the smallest shape)
that turns a kernel's outputs non-finite or wrong. Nothing heavy is imported until a command runs."""
from __future__ import annotations

import json
import time

import click


@click.group()
def nan():
    """Find where NaNs come from."""


@nan.command("bisect-kernel")
@click.option("--kernel", type=click.Choice(["sparse_attn_bwd", "sparse_attn_fwd"]), default="sparse_attn_bwd",
              show_default=True, help="built-in kernel (ignored with --source)")
@click.option("--source", type=click.Path(exists=True, dir_okay=False),
              help="Python file with PASS_CONFIGS and run(shape, pass_configs) -> {name: tensor}")
@click.option("--reference", type=click.Path(exists=True, dir_okay=False),
              help="Python file with run(shape) -> {name: tensor}, the same names (needed with --source)")
@click.option("--shape", required=True, help="B,S,H,D,topk (N = S + S//4 rows of KV), e.g. 1,256,64,512,640")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="add or override a pass-config setting, e.g. tl.enable_aggressive_shared_memory_merge=true")
@click.option("--tol", default=5e-2, show_default=True, help="relative 2-norm error above which an output is wrong")
@click.option("--timeout", default=600.0, show_default=True, help="seconds per trial before it counts as a hang")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), help="report directory [outputs/nan-bisect-<time>]")
@click.option("--json", "as_json", is_flag=True, help="print the report as JSON on stdout")
def bisect_kernel(kernel, source, reference, shape, overrides, tol, timeout, out_dir, as_json):
    """Delta-debug the kernel's pass configs to the minimal set that yields non-finite or wrong results,
    then sweep smaller shapes. Writes report.json and report.md."""
    from dsv4.kernels import bisect as kb

    if bool(source) != bool(reference):
        raise click.UsageError("--source and --reference go together")
    try:
        sh = kb.Shape.parse(shape)
        extra = dict(kb.parse_setting(s) for s in overrides)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    if source:
        settings = dict(getattr(kb._load(source, "bisect_source"), "PASS_CONFIGS", {}))
    else:
        from dsv4.kernels import tilelang_sparse_attn as sa
        settings = dict(sa.BWD_PASS_CONFIGS if kernel == "sparse_attn_bwd" else sa.FWD_PASS_CONFIGS)
    settings.update(extra)
    report = kb.bisect(kernel, sh, settings, source=source, reference=reference, tol=tol, timeout=timeout,
                       log=lambda m: click.echo(m, err=True))
    out_dir = out_dir or f"outputs/nan-bisect-{time.strftime('%Y%m%d-%H%M%S')}"
    jpath, mpath = kb.write_report(report, out_dir)
    if as_json:
        from dataclasses import asdict
        click.echo(json.dumps(asdict(report), indent=2))
    else:
        verdict = (f"culprit: {kb._fmt(report.culprit)}; smallest failing shape: {report.smallest_failing_shape}"
                   if report.culprit else report.culprit_note)
        click.echo(verdict)
    click.echo(f"report: {mpath} and {jpath}", err=True)
