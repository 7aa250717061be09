"""`v4 ckpt`: random checkpoints in the released layout, FP8/MXFP4 -> BF16 conversion, the names and aliases.

torch and dsv4.checkpoint are imported inside the commands, so loading this module stays cheap.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import click


def _model_config(model: str, overrides: tuple[str, ...]):
    from dsv4.config import ModelConfig

    try:
        return ModelConfig.preset(model).with_overrides(*overrides)
    except KeyError as e:
        raise click.UsageError(f"--model {model} / --set {' '.join(overrides) or '(none)'}: {e.args[0]}") from None
    except ValueError as e:
        raise click.UsageError(f"--model {model} with --set {' '.join(overrides)}: {e}") from None


class _Bar:
    """A one-line progress bar on stderr (only when stderr is a terminal, else a line every 10%)."""

    def __init__(self, label: str):
        self.label, self.t0, self.last = label, time.monotonic(), -1
        self.tty = sys.stderr.isatty()

    def __call__(self, done: int, total: int, name: str) -> None:
        frac = done / total if total else 1.0
        rate = done / max(time.monotonic() - self.t0, 1e-9) / 1e6
        if self.tty:
            bar = "#" * int(frac * 30)
            sys.stderr.write(f"\r{self.label} [{bar:<30}] {frac:6.1%} {rate:8.1f} MB/s  {name[-48:]:<48}")
            sys.stderr.flush()
        elif int(frac * 10) != self.last:
            self.last = int(frac * 10)
            click.echo(f"{self.label}: {frac:.0%} ({done / 1e6:.1f}/{total / 1e6:.1f} MB, {rate:.1f} MB/s)", err=True)

    def close(self) -> None:
        if self.tty:
            sys.stderr.write("\n")


@click.group("ckpt")
def ckpt():
    """DeepSeek-V4 checkpoints: generate random ones, dequantize released ones, show the names and aliases."""


@ckpt.command("generate")
@click.option("--model", default="tiny", show_default=True, help="Model preset: tiny, 4layer, flash, pro.")
@click.option("--out", "out", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="Output directory (must be empty or absent unless --force).")
@click.option("--seed", type=int, default=0, show_default=True, help="Initialisation seed (same as Transformer(cfg)).")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="ModelConfig override(s), e.g. --set 'n_layers=2 n_routed_experts=16'. Repeatable.")
@click.option("--shard-gb", type=float, default=4.0, show_default=True, help="Shard size limit in GiB.")
@click.option("--force", is_flag=True, help="Replace an existing output directory.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
def generate(model, out, seed, overrides, shard_gb, force, as_json):
    """Write a random checkpoint in the released layout (FP8 e4m3 + e8m0 128x128 scales, MXFP4 routed
    experts, config.json, tokenizer files, the chat encoder) so smoke runs need no download."""
    from dsv4.checkpoint import generate_checkpoint

    cfg = _model_config(model, overrides)
    bar = _Bar("generate")
    t0 = time.monotonic()
    try:
        s = generate_checkpoint(cfg, out, seed=seed, force=force, shard_bytes=int(shard_gb * (1 << 30)), progress=bar)
    except FileExistsError as e:
        raise click.UsageError(str(e)) from None
    finally:
        bar.close()
    secs = time.monotonic() - t0
    if as_json:
        click.echo(json.dumps({"out": s.out_dir, "model": model, "seed": seed, "tensors": s.n_tensors,
                               "shards": s.n_shards, "bytes": s.total_bytes, "seconds": round(secs, 2)}))
    else:
        click.echo(f"wrote {s.out_dir}: {model} ({cfg.n_layers} layers, {cfg.n_routed_experts} experts), "
                   f"{s.n_tensors} tensors in {s.n_shards} shard(s), {s.total_bytes / 1e6:.1f} MB, {secs:.1f} s")


@ckpt.command("dequantize")
@click.argument("src", type=click.Path(file_okay=False, path_type=Path))
@click.argument("dst", type=click.Path(file_okay=False, path_type=Path))
@click.option("--names", type=click.Choice(["hf", "official"]), default="hf", show_default=True,
              help="Tensor names in the output. hf: the names HF transformers' DeepseekV4ForCausalLM and SGLang's "
              "DeepSeek-V4 loader read, which are the official names of the Hub release (`layers.N.attn.wq_a."
              "weight`); official: the same output, kept as a synonym.")
@click.option("--shard-gb", type=float, default=4.0, show_default=True, help="Output shard size limit in GiB.")
@click.option("--force", is_flag=True, help="Replace a non-empty destination (otherwise only an interrupted "
              "conversion of the same source is resumed).")
@click.option("--workers", type=int, default=0, show_default="half the cores, at most 4",
              help="Output shards converted at once, each in its own process.")
@click.option("--part", default=None, metavar="I/N",
              help="Only output shards I, I+N, I+2N, ... (I from 0), and no index: N machines sharing DST each run "
              "one part, then one run without --part finishes the conversion.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
def dequantize(src, dst, names, shard_gb, force, workers, part, as_json):
    """Convert a released FP8/MXFP4 checkpoint in SRC to BF16 shards + index in DST under the official names,
    which transformers' and SGLang's DeepSeek-V4 loaders read (fp32 tensors such as attn_sink, hc_* and ape stay
    fp32). Streams tensor by tensor; rerun the same command to resume.

    Over several machines that share DST: `v4 ckpt dequantize SRC DST --part I/N` on machine I of N, and when all
    have finished, `v4 ckpt dequantize SRC DST` once (it finds their shards complete and writes the index)."""
    from dsv4.checkpoint import CheckpointError, default_workers, dequantize_checkpoint

    if not src.is_dir():
        raise click.UsageError(f"SRC {src} is not a directory; pass the checkpoint directory holding config.json "
                               "and the *.safetensors shards")
    if part is not None:
        i, _, n = part.partition("/")
        if not (i.isdigit() and n.isdigit()):
            raise click.BadParameter(f"{part!r}: I/N with 0 <= I < N, e.g. 0/4 on the first of four machines",
                                     param_hint="--part")
        part = (int(i), int(n))          # the range, and --force with a part, are the dequantizer's to refuse
    bar = _Bar("dequantize")
    t0 = time.monotonic()
    try:
        s = dequantize_checkpoint(src, dst, force=force, names=names, shard_bytes=int(shard_gb * (1 << 30)),
                                  progress=bar, workers=workers or default_workers(), part=part)
    except (FileExistsError, CheckpointError, ValueError) as e:
        raise click.UsageError(str(e)) from None
    finally:
        bar.close()
    secs = time.monotonic() - t0
    summary = {"src": s.src, "dst": s.dst, "tensors": s.n_tensors, "shards": s.n_shards,
               "shards_written": s.shards_written, "shards_skipped": s.shards_skipped, "bytes_in": s.bytes_in,
               "bytes_out": s.bytes_out, "names": s.names, "seconds": round(secs, 2),
               "mb_per_s_out": round(s.bytes_out / 1e6 / max(secs, 1e-9), 1), "complete": s.complete}
    if as_json:
        click.echo(json.dumps(summary))
    elif not s.complete:
        click.echo(f"part {part[0]}/{part[1]} of {s.dst}: {s.shards_written} shard(s) written, {s.shards_skipped} "
                   f"already complete, {secs:.1f} s; when every part is done, finish with:\n"
                   f"  v4 ckpt dequantize {src} {dst}")
    else:
        resumed = f" ({s.shards_skipped} already complete)" if s.shards_skipped else ""
        click.echo(f"wrote {s.dst}: {s.n_tensors} tensors in {s.n_shards} shard(s){resumed}, "
                   f"{s.bytes_in / 1e6:.1f} MB in -> {s.bytes_out / 1e6:.1f} MB out, {secs:.1f} s "
                   f"({summary['mb_per_s_out']} MB/s written)")


@ckpt.command("names")
@click.option("--model", default="flash", show_default=True, help="Model preset: tiny, 4layer, flash, pro.")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="ModelConfig override(s).")
@click.option("--json", "as_json", is_flag=True, help="Print {official name: HF-style alias} as JSON.")
def names(model, overrides, as_json):
    """Print the tensor names of the released layout (weights and scales), which `dequantize` writes and
    transformers and SGLang load, beside their HF-style aliases (read by this project's loaders, not written)."""
    from dsv4.checkpoint import name_map

    m = name_map(_model_config(model, overrides))
    if as_json:
        click.echo(json.dumps(m, indent=1))
    else:
        from launcher.table import table
        click.echo(table([("OFFICIAL", "HF-STYLE ALIAS (read only)"), *m.items()]))
