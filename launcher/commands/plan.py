"""`v4 plan layouts | show | scaling | calibration`: the cost model (launcher/costmodel.py) at the command line.

`layouts` ranks every TP/PP/CP/EP/ETP/micro-batch layout of a cluster by predicted tokens/s a GPU and says why the
others cannot run; `show` explains one layout part by part; `scaling` draws tokens/s a GPU against GPU count for
Flash and Pro; `calibration` compares the model with every measurement it can be held to (docs/plan.md).
"""
from __future__ import annotations

import json

import click

from launcher.cli_options import config_options
from launcher.errors import ConfigError


def _json(obj) -> str:
    return json.dumps(obj, indent=2, allow_nan=False)


def _ints(text: str | None, what: str) -> tuple[int, ...] | None:
    if not text:
        return None
    try:
        out = tuple(int(x) for x in text.replace(",", " ").split())
    except ValueError:
        raise click.BadParameter(f"{text!r}: a comma-separated list of integers", param_hint=what) from None
    if not out or min(out) < 1:
        raise click.BadParameter(f"{text!r}: integers >= 1", param_hint=what)
    return out


def workload_options(fn):
    """What a planner may change about the preset's workload (each defaults to the configuration's value)."""
    for opt in reversed([
        click.option("--model", type=click.Choice(["flash", "pro", "4layer", "tiny"]), default=None,
                     help="plan this model instead of the preset's PRESET_MODEL (its overrides are dropped)"),
        click.option("--model-overrides", default=None, metavar="'K=V ...'",
                     help="model field overrides (default: the preset's PRESET_MODEL_OVERRIDES)"),
        click.option("--gpus", type=int, default=None, help="GPUs to plan for (default: the cluster's nodes x GPUs)"),
        click.option("--seq-len", type=int, default=None, help="tokens a sequence (default: PRESET_SEQ_LEN)"),
        click.option("--global-batch", type=int, default=None, help="sequences a step (default: PRESET_GLOBAL_BATCH_SIZE)"),
        click.option("--optimizer", type=click.Choice(["adam", "dist", "offload"]), default="adam", show_default=True,
                     help="adam: this trainer's (state on every DP rank); dist: megatron's distributed optimizer "
                          "(state sharded over DP); offload: Adam on the host (miles' --optimizer-cpu-offload)"),
        click.option("--recompute", type=click.Choice(["none", "full"]), default=None,
                     help="activation recompute (default: HW_RECOMPUTE_GRANULARITY)"),
        click.option("--attn-impl", type=click.Choice(["tilelang", "torch", "dense"]), default=None,
                     help="attention (default: the preset's); dense models other stacks' masked dense fallback"),
        click.option("--overlap", is_flag=True, help="model megatron's overlap of the gradient reduction (this "
                                                       "trainer runs it off)"),
    ]):
        fn = opt(fn)
    return fn


def _setup(selection, model, model_overrides, gpus, seq_len, global_batch, optimizer, recompute, attn_impl, overlap):
    """(config, model shape, workload, hardware, GPUs) for the planner. The configuration is loaded without its
    cross-checks: the preset's own layout need not fit the GPU count being planned for."""
    from dataclasses import replace

    from launcher import costmodel
    from launcher.config import load

    cfg = load(selection)
    for w in cfg.warnings:
        click.echo(f"warning: {w}", err=True)
    v = cfg.values
    if v["HW_DEVICE"] != "cuda":
        raise ConfigError(f"hw layer {cfg.selection.hw!r} is not a GPU (HW_DEVICE={v['HW_DEVICE']}): the planner plans "
                          "GPU clusters", fix="pass --hw h200 or --hw h20, or a --cluster whose V4_GPU_MODEL names one")
    name = model or v["PRESET_MODEL"]
    if model_overrides is not None:
        overrides = tuple(model_overrides.split()) if model_overrides.strip() else ()
    else:
        overrides = () if model else tuple(v["PRESET_MODEL_OVERRIDES"])
    seq = seq_len or v["PRESET_SEQ_LEN"]
    try:
        shape = costmodel.model_shape(name, overrides, seq)
    except (KeyError, ValueError, TypeError) as e:
        raise ConfigError(f"model {name!r} {' '.join(overrides)}: {e.args[0] if e.args else e}",
                          fix="--model is flash, pro, 4layer or tiny; overrides are field=value") from None
    wl = costmodel.workload_from_config(cfg)
    wl = replace(wl, seq_len=seq, global_batch=global_batch or wl.global_batch, optimizer=optimizer,
                 recompute=recompute or wl.recompute, attn_impl=attn_impl or wl.attn_impl,
                 overlap_grad_reduce=overlap)
    hw = costmodel.hardware_from_config(cfg)
    n = gpus or v["V4_NUM_NODES"] * v["V4_NUM_GPUS_PER_NODE"]
    if n < 1:
        raise click.BadParameter(f"{n}: at least one GPU", param_hint="--gpus")
    return cfg, shape, wl, hw, n


def _fmt_gib(x: float) -> str:
    return f"{x:,.1f}"


@click.group("plan")
def plan():
    """Predict memory and step time of training layouts (launcher/costmodel.py, docs/plan.md)."""


@plan.command("layouts")
@config_options()
@workload_options
@click.option("--micro-batches", default="1,2,4,8", show_default=True, help="micro-batch sizes to try")
@click.option("--schedule", type=click.Choice(["1f1b", "interleaved", "all"]), default="1f1b", show_default=True,
              help="pipeline schedules to try (interleaved: megatron's virtual stages, 2 a rank; this trainer runs 1F1B)")
@click.option("--top", type=int, default=15, show_default=True, help="feasible layouts to print (0: all)")
@click.option("--rejected", "show_rejected", type=int, default=3, show_default=True,
              help="rejected layouts to print for each reason (0: counts only)")
@click.option("--json", "as_json", is_flag=True, help="every feasible and rejected layout as JSON on stdout")
def layouts(selection, model, model_overrides, gpus, seq_len, global_batch, optimizer, recompute, attn_impl, overlap,
            micro_batches, schedule, top, show_rejected, as_json):
    """Every feasible layout of the cluster, ranked by predicted tokens/s a GPU; the rejected ones with their reason."""
    from launcher import costmodel

    cfg, shape, wl, hw, n = _setup(selection, model, model_overrides, gpus, seq_len, global_batch, optimizer,
                                   recompute, attn_impl, overlap)
    schedules = ("1f1b", "interleaved") if schedule == "all" else (schedule,)
    ok, rejected = costmodel.enumerate_layouts(shape, wl, hw, n, _ints(micro_batches, "--micro-batches"), schedules)
    head = {"model": shape.name, "gpus": n, "hw": hw.name, "gpus_per_node": hw.gpus_per_node,
            "usable_gib": round(hw.usable_gib, 1), "seq_len": wl.seq_len, "global_batch": wl.global_batch,
            "optimizer": wl.optimizer, "recompute": wl.recompute, "attn_impl": wl.attn_impl,
            "rates": hw.rates.source if hw.rates else None, "assumptions": list(hw.assumptions)}
    if as_json:
        click.echo(_json({**head, "feasible": [p.to_json() for p in ok], "rejected": [r.to_json() for r in rejected]}))
        return
    click.echo(f"# {shape.name} on {n} x {hw.gpu} ({hw.gpus_per_node} a node, {hw.usable_gib:.1f} GiB usable a GPU), "
               f"{wl.global_batch} x {wl.seq_len} tokens a step, optimizer {wl.optimizer}, recompute {wl.recompute}, "
               f"attention {wl.attn_impl}", err=True)
    for a in hw.assumptions:
        click.echo(f"# assumption: {a}", err=True)
    if not ok:
        click.echo("no feasible layout" + ("" if wl.optimizer != "adam" else
                   "; with this trainer's Adam state on every rank: try --optimizer dist (megatron's distributed "
                   "optimizer) or offload, or --recompute full"), err=True)
    else:
        rows = [("#", "layout", "tokens/s/GPU", "MFU", "step s", "peak GiB", "bottleneck")]
        for i, p in enumerate(ok[:top or None], 1):
            rows.append((str(i), p.layout.name(),
                         f"{p.tokens_per_s_gpu:,.0f}" if p.tokens_per_s_gpu else "-",
                         f"{p.mfu:.1%}" if p.mfu is not None else "-",
                         f"{p.step_s:.2f}" if p.step_s else "-",
                         f"{p.peak_gib:.1f} (stage {p.memory.stage})", p.bottleneck or "-"))
        from launcher.table import table
        click.echo(table(rows))
        if top and len(ok) > top:
            click.echo(f"... {len(ok) - top} more feasible (--top 0 lists all)")
    by_reason: dict[str, list] = {}
    for r in rejected:
        by_reason.setdefault(r.category, []).append(r)
    click.echo(f"\nrejected: {len(rejected)}")
    for key, rs in sorted(by_reason.items(), key=lambda kv: -len(kv[1])):
        click.echo(f"  {len(rs):>6}  {key}")
        # the nearest misses first: the layouts a small change would make fit
        for r in sorted(rs, key=lambda r: r.peak_gib or 0)[:show_rejected]:
            click.echo(f"          {r.name()}: {'; '.join(r.reasons)}")


@plan.command("show")
@config_options()
@workload_options
@click.option("--tp", type=int, default=None)
@click.option("--pp", type=int, default=None)
@click.option("--cp", type=int, default=None)
@click.option("--ep", type=int, default=None)
@click.option("--etp", type=int, default=None)
@click.option("--micro-batch", type=int, default=None)
@click.option("--vpp", type=int, default=1, show_default=True, help="virtual stages a pipeline rank (interleaved)")
@click.option("--stages", default=None, metavar="4,6,...,3",
              help="layers of each stage (default: the preset's split when its PP is kept, else the planner's)")
@click.option("--json", "as_json", is_flag=True)
def show(selection, model, model_overrides, gpus, seq_len, global_batch, optimizer, recompute, attn_impl, overlap,
         tp, pp, cp, ep, etp, micro_batch, vpp, stages, as_json):
    """Explain one layout part by part: memory of every stage, and where a step's time goes (the preset's layout,
    with any of --tp/--pp/--cp/--ep/--etp/--micro-batch changed)."""
    from launcher import costmodel
    from launcher.config.checks import pipeline_split

    cfg, shape, wl, hw, n = _setup(selection, model, model_overrides, gpus, seq_len, global_batch, optimizer,
                                   recompute, attn_impl, overlap)
    v = cfg.values
    tp, pp, cp = tp or v["PRESET_TP"], pp or v["PRESET_PP"], cp or v["PRESET_CP"]
    ep, etp, mb = ep or v["PRESET_EP"], etp or v["PRESET_ETP"], micro_batch or v["PRESET_MICRO_BATCH_SIZE"]
    if n % (tp * pp * cp):
        raise click.BadParameter(f"TP*PP*CP = {tp * pp * cp} does not divide {n} GPUs", param_hint="--gpus/--tp/--pp/--cp")
    split = _ints(stages, "--stages")
    if split is None:
        layers = shape.cfg.n_layers
        if pp == v["PRESET_PP"] and not model:
            try:
                split = tuple(pipeline_split(layers, pp, v["PRESET_PP_FIRST_LAYERS"], v["PRESET_PP_LAST_LAYERS"],
                                             v["PRESET_PP_LAYOUT"]))
            except ValueError:
                split = None
        if split is None or len(split) != pp * vpp:
            split = costmodel.split_layers(layers, pp, shape.cfg.n_hash_layers, vpp=vpp)
    lay = costmodel.Layout(tp, pp, cp, ep, etp, n // (tp * pp * cp), tuple(split), mb, vpp)
    problems = costmodel.layout_problems(shape, lay, wl, hw.gpus_per_node)
    p = costmodel.predict(shape, lay, wl, hw)
    if as_json:
        click.echo(_json({**p.to_json(), "problems": problems, "assumptions": list(hw.assumptions)}))
        return
    click.echo(f"{shape.name} on {n} x {hw.gpu}: {lay.name()}  ({wl.global_batch} x {wl.seq_len} tokens a step, "
               f"{costmodel.micro_batches(lay, wl)} micro-batches a pipeline, optimizer {wl.optimizer}, "
               f"recompute {wl.recompute}, attention {wl.attn_impl})")
    for w in problems:
        click.echo(f"  cannot run: {w}")
    click.echo(f"\nmemory, GiB a GPU on the fullest stage ({p.memory.stage}; {p.memory.in_flight} micro-batch(es) of "
               f"activations in flight), usable {p.usable_gib:.1f} of {hw.memory_gib:g}:")
    for k, val in sorted(p.memory.parts.items(), key=lambda kv: -kv[1]):
        click.echo(f"  {k:<44} {val:>9.2f}")
    click.echo(f"  {'total':<44} {p.peak_gib:>9.2f}   {'fits' if p.fits else 'DOES NOT FIT'}")
    for line in costmodel.memory_lines(p, hw)[1:]:      # the phases: forward-backward, then the gradient check
        click.echo(line)
    if p.memory.host_gib:
        click.echo(f"  (optimizer state on the host: {p.memory.host_gib:.1f} GiB a GPU)")
    click.echo("  stages: " + "  ".join(f"{i}:{x:.1f}" for i, x in enumerate(p.stage_memory_gib)))
    if p.overflow:
        click.echo(f"  {p.overflow}")
    if p.step_s:
        click.echo(f"\ntime, s a step ({p.step_s:.3f} s: {p.tokens_per_s_gpu:,.0f} tokens/s a GPU"
                   + (f", MFU {p.mfu:.1%}" if p.mfu is not None else "") + f"; rates: {hw.rates.source}):")
        for k, val in sorted(p.time.items(), key=lambda kv: -kv[1]):
            click.echo(f"  {k:<44} {val:>9.3f}  {val / p.step_s:>6.1%}")
    for note in p.notes:
        click.echo(f"note: {note}")
    for a in hw.assumptions:
        click.echo(f"assumption: {a}")


SCALING_GPUS = (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


@plan.command("scaling")
@config_options()
@click.option("--gpus", "gpu_list", default=",".join(map(str, SCALING_GPUS)), show_default=True)
@click.option("--models", default="flash,pro", show_default=True)
@click.option("--sequences-per-gpu", type=float, default=2.0, show_default=True,
              help="global batch = this x GPUs (weak scaling: every GPU keeps the same share of the batch)")
@click.option("--output", "-o", type=click.Path(dir_okay=False), default=None, help="write the PNG here")
@click.option("--json", "as_json", is_flag=True)
def scaling(selection, gpu_list, models, sequences_per_gpu, output, as_json):
    """The best predicted tokens/s a GPU at each GPU count, for each model, with this trainer's optimizer and with
    megatron's distributed optimizer (PNG with -o)."""
    from dataclasses import replace

    from launcher import costmodel

    counts = _ints(gpu_list, "--gpus")
    series = []
    for model in [m.strip() for m in models.split(",") if m.strip()]:
        for optimizer in ("adam", "dist"):
            cfg, shape, wl, hw, _ = _setup(selection, model, None, 8, None, None, optimizer, None, None, False)
            points = []
            for n in counts:
                w = replace(wl, global_batch=max(1, int(round(sequences_per_gpu * n))))
                ok, _ = costmodel.enumerate_layouts(shape, w, hw, n)
                best = ok[0] if ok else None
                points.append({"gpus": n, "tokens_per_s_gpu": best.tokens_per_s_gpu if best else None,
                               "mfu": best.mfu if best else None, "layout": best.layout.name() if best else None,
                               "peak_gib": round(best.peak_gib, 1) if best else None,
                               "bottleneck": best.bottleneck if best else None})
                click.echo(f"{model} {optimizer} {n:>5} GPUs: "
                           + (f"{best.tokens_per_s_gpu:,.0f} tokens/s/GPU  {best.layout.name()}  ({best.bottleneck})"
                              if best else "no feasible layout"), err=True)
            series.append({"model": model, "optimizer": optimizer, "hw": hw.name, "seq_len": wl.seq_len,
                           "points": points})
    if as_json:
        click.echo(_json({"series": series, "sequences_per_gpu": sequences_per_gpu}))
    if output:
        _plot(series, output, sequences_per_gpu)
        click.echo(f"wrote {output}", err=True)


def _plot(series: list, path: str, per_gpu: float) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
    colors = {"flash": "tab:blue", "pro": "tab:red"}
    for s in series:
        pts = [(p["gpus"], p["tokens_per_s_gpu"]) for p in s["points"] if p["tokens_per_s_gpu"]]
        if not pts:
            continue
        xs, ys = zip(*pts)
        label = f"V4-{s['model'].capitalize()}, " + ("Adam on every DP rank (this trainer)" if s["optimizer"] == "adam"
                                                    else "distributed optimizer")
        ax.plot(xs, ys, marker="o", linestyle="-" if s["optimizer"] == "adam" else "--",
                color=colors.get(s["model"], None), label=label)
    ax.set_xscale("log", base=2)
    counts = sorted({p["gpus"] for s in series for p in s["points"]})
    ax.set_xticks(counts, [str(n) for n in counts])
    ax.set_xlabel("GPUs")
    ax.set_ylabel("predicted tokens/s a GPU (best layout)")
    hw = series[0]["hw"] if series else ""
    ax.set_title(f"v4 plan scaling: {hw}, {series[0]['seq_len'] if series else ''} tokens a sequence, "
                 f"{per_gpu:g} sequences a GPU a step")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


@plan.command("calibration")
@click.option("--records", "records", type=click.Path(dir_okay=False), default=None,
              help="the bench records whose rows carry their plan (default: benchmarks/records/train_step.jsonl)")
@click.option("--json", "as_json", is_flag=True)
def calibration(records, as_json):
    """Predicted against measured for every recorded measurement the model can be held to, with the tolerance verdict
    (benchmarks/records/plan_validation.jsonl, and every `v4 bench step --record` row that recorded the cost
    model's inputs: its measured peak and step against today's prediction); rows still to be measured on a GPU say
    how."""
    from launcher import costmodel

    rows = costmodel.validation_table(records=records or str(costmodel.TRAIN_STEP_RECORDS))
    if as_json:
        click.echo(_json(rows))
        return
    from launcher.table import table
    out = [("case", "quantity", "measured", "predicted", "error", "verdict", "source")]
    for r in rows:
        fmt = (lambda x: "-" if x is None else f"{x:,.4g}")
        out.append((r["name"], r["quantity"], fmt(r["measured"]), fmt(r["predicted"]),
                    "-" if r["error"] is None else f"{r['error']:+.1%}", r["verdict"], r["source"]))
    click.echo(table(out))
