"""Step `weights`: make sure the official-layout checkpoint exists.

PRESET_WEIGHTS=generate writes a random checkpoint in the released layout (FP8 weights with e8m0
128x128 scales, MXFP4 routed experts, config.json, tokenizer, encoder) for the run's model, so a
smoke run needs no download; PRESET_WEIGHTS=hf checks that the release at V4_HF_DIR is there.
"""
from __future__ import annotations

import sys

from jobs.common import RunContext, byte_progress, done, log, mark_done


def model_config(cfg: dict):
    from dsv4.config import ModelConfig

    return ModelConfig.preset(cfg["PRESET_MODEL"]).with_overrides(*cfg["PRESET_MODEL_OVERRIDES"])


def main(argv=None) -> int:
    ctx = RunContext.from_argv(argv, __doc__)
    out = ctx.paths.hf_dir
    if ctx.cfg["PRESET_WEIGHTS"] == "hf":
        if not (out / "config.json").is_file() or not any(out.glob("*.safetensors")):
            log(f"error: no checkpoint at {out} (config.json + *.safetensors expected); download the release "
                f"there, point V4_HF_DIR at it, or use PRESET_WEIGHTS=generate")
            return 1
        log(f"release checkpoint present at {out}")
        return 0
    inputs = {"model": ctx.cfg["PRESET_MODEL"], "overrides": ctx.cfg["PRESET_MODEL_OVERRIDES"],
              "seed": ctx.cfg["PRESET_SEED"]}
    if done(out, inputs):
        log(f"generated checkpoint already complete at {out}; skipped")
        return 0
    from dsv4.checkpoint import generate_checkpoint

    mcfg = model_config(ctx.cfg)
    log(f"generating a random {ctx.cfg['PRESET_MODEL']} checkpoint ({mcfg.n_params() / 1e6:.1f} M params) at {out}")
    # force: whatever is there is an interrupted generation of ours (no sentinel) and is redone
    summary = generate_checkpoint(mcfg, out, seed=ctx.cfg["PRESET_SEED"], force=True,
                                  progress=byte_progress("generate"))
    mark_done(out, inputs, tensors=summary.n_tensors, shards=summary.n_shards, bytes=summary.total_bytes)
    log(f"wrote {summary.n_tensors} tensors in {summary.n_shards} shard(s), {summary.total_bytes / 1e6:.1f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
