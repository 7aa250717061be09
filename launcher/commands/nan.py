"""`v4 nan ...`: NaN triage. `bisect` replays a run's non-finite step and walks a ladder of switches to the one
that cures it (launcher/nanbisect.py); `bisect-kernel` names the TileLang pass-config setting (and the smallest
shape) that turns a kernel's outputs non-finite or wrong. Nothing heavy is imported until a command runs."""
from __future__ import annotations

import json
import sys
import time

import click

from launcher.cli_options import config_options, load_config


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
    import torch

    from dsv4.kernels import bisect as kb

    if not torch.cuda.is_available():
        click.echo("error: v4 nan bisect-kernel compiles and runs TileLang kernels on a CUDA GPU, and this machine has "
                   "none (torch.cuda.is_available() is False); run it on a GPU node of the cluster", err=True)
        sys.exit(2)
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


@nan.command("bisect")
@config_options()
@click.argument("run_ref", metavar="RUN")
@click.option("--parallel", default=0, show_default="as many as fit",
              help="rungs at a time (each needs the run's GPUs, or CPUs on a CPU run)")
@click.option("--timeout", default=1800.0, show_default=True, help="seconds per rung before it counts as failed")
@click.option("--no-kernel", is_flag=True, help="stop at the switch; do not hand a kernel culprit to bisect-kernel")
@click.option("--device-memory-gb", type=float, default=None,
              help="what one device holds, for the one-process rung: where the model outgrows it, the rung keeps "
                   "the layers up to the fault [the run's HW_GPU_MEMORY_GB; 0: no limit]")
@click.option("--allow-changed-data", is_flag=True,
              help="go on where the step's rows are not the captured ones (the data changed since the run); the "
                   "report says so")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), help="report directory [RUN/nan-bisect]")
@click.option("--json", "as_json", is_flag=True, help="print the report as JSON on stdout")
def bisect_run(selection, run_ref, parallel, timeout, no_kernel, device_memory_gb, allow_changed_data, out_dir,
               as_json):
    """Replay RUN's non-finite step from its capture and walk the ladder of switches (TileLang -> torch, FP8
    off, fp32, recompute off, one process, the sample removed) to the smallest set that cures it.
    RUN: id, unique prefix, or `latest`. Exit codes: 0 culprit named, 1 not reproduced, nothing cures it, or the
    step could not be replayed (an earlier report is then kept), 2 no usable capture in RUN, or the step's data
    changed since the run (without --allow-changed-data)."""
    from dataclasses import asdict
    from pathlib import Path

    from jobs.nan_capture import CaptureError
    from launcher import nanbisect, registry
    cfg = load_config(selection)
    run = registry.find_run(cfg, run_ref)
    out = Path(out_dir) if out_dir else run.dir / "nan-bisect"
    try:
        report = nanbisect.bisect(run.dir, out, parallel=parallel, timeout=timeout, kernel=not no_kernel,
                                  log=lambda m: click.echo(m, err=True), cluster_cfg=cfg,
                                  memory_gb=device_memory_gb, allow_changed_data=allow_changed_data)
    except (FileNotFoundError, CaptureError, nanbisect.BadRun) as e:     # nothing (usable) to replay
        click.echo(f"error: {e}", err=True)
        sys.exit(nanbisect.USAGE)
    if as_json:
        click.echo(json.dumps(asdict(report), indent=2, default=str))
    if report.exit_code == nanbisect.USAGE:                # refused: nothing was bisected, no report
        click.echo(f"error: {report.verdict.removeprefix('refused: ')}\n  fix: {report.fix}", err=True)
        sys.exit(report.exit_code)
    previous = out / "report.md"
    if not report.replayed and previous.is_file():
        # the step did not replay: that says nothing about the fault, and an earlier verdict still stands
        click.echo(f"error: {report.verdict}\n  fix: {report.fix}", err=True)
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(previous.stat().st_mtime))
        click.echo(f"the earlier report is kept: {previous} ({when})", err=True)
        sys.exit(report.exit_code)
    jpath, mpath = nanbisect.write_report(report, out)
    if not as_json:
        click.echo(report.verdict)
        if report.kernel:
            k = report.kernel
            click.echo(f"kernel: {k.get('verdict') if k['ran'] else k['note']}")
    click.echo(f"report: {mpath} and {jpath}", err=True)
    sys.exit(report.exit_code)
