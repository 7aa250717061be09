"""One rung of the staged NaN bisect: replay a run's captured non-finite step with some switches flipped.

    python -m jobs.nan_replay --run-dir RUN --rung-dir DIR

RUN is a training run that stopped with exit 16 and kept its capture (steps/train/nan_capture.json: the
checkpoint the failing step started from, the step, each data-parallel rank's rows by hash). DIR/rung.json
says what to flip: {"switches": [...], "sample": {"op": "drop"|"only", "global_row": I}, "cut_layers": N} (I: the
row in the captured step's global batch, data-parallel ranks in order; N, with layout_1: keep the first N layers);
the switches are launcher.nanbisect.SWITCHES. The rung loads the capture's weights (no download, dequantize or convert),
rebuilds step N's batch from the run's data order, checks its rows against the capture, runs forward and
backward once with forensics hooks (no optimizer update), and writes DIR/result.json:
  {"finite", "loss", "grad_norm", "first" (the monitor's first module), "forensics" (the first non-finite
   tensor forward and backward: module, kind, micro-batch, rows, NaN/Inf counts, largest inputs),
   "data_matches_capture", "data_changed_rows" (the global rows whose hash is not the capture's), "seconds",
   "layout", "model"}.
Exit codes: 0 the rung ran (finite or not: result.json says), 1 it could not run, 2 bad rung or run.
"""
from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from dsv4.fileio import atomic_write
from jobs.common import RunContext, log, ranks_local
from jobs.nan_capture import CaptureError, load_capture
from jobs.train_sft import DATA_SEED_OFFSET, SFTData, tokenizer_dirs, train_config, world_size


def apply_switches(tc, switches: list[str], cut_layers: int | None = None):
    """The run's TrainConfig with the rung's switches flipped (names as launcher.nanbisect.SWITCHES). With
    `cut_layers` the one-process rung keeps only the first cut_layers layers (so that one GPU holds them) and
    trains no MTP block: a forward fault in the last kept layer sees the same inputs as in the whole model."""
    from dsv4.megatron.parallel import Layout
    m, layout, recompute, objective = tc.model, tc.layout, tc.recompute, tc.objective
    for s in switches:
        if s == "attn_torch":
            m = m.with_overrides(attn_impl="torch")
        elif s == "fp8_off":
            m = m.with_overrides(qat_kv_fp8=False, qat_indexer_fp4=False, fp8_gemm_inputs=False,
                                 mxfp4_experts=False, qat_rollout_fp8=False)
        elif s == "fp32":
            m = m.with_overrides(dtype="fp32")
        elif s == "recompute_off":
            recompute = "none"
        elif s == "layout_1":
            layout = Layout()
            if cut_layers:
                if not 0 < cut_layers <= m.n_layers:
                    raise ValueError(f"cut_layers={cut_layers}: the model has {m.n_layers} layers")
                m = m.with_overrides(n_layers=cut_layers)
                objective = replace(objective, mtp_coeff=0.0)
        elif s != "sample":
            raise ValueError(f"unknown switch {s!r}")
    return replace(tc, model=m, layout=layout, recompute=recompute, objective=objective)


def edit_rows(batch: dict, op: str, row: dict, index: int | None) -> dict:
    """The sample alone (every row a copy of `row`) or removed (its place, `index` on this rank, taken by a copy
    of a neighbour; the other ranks' rows stay)."""
    if op == "only":
        return {k: v[None].expand_as(batch[k]).clone() for k, v in row.items()}
    if index is None:
        return batch
    if batch["tokens"].shape[0] < 2:
        raise ValueError("the step has one row on this rank: it cannot be removed without emptying the batch")
    out = {k: v.clone() for k, v in batch.items()}
    for k in out:
        out[k][index] = batch[k][1 if index == 0 else index - 1]
    return out


@dataclass
class Rung:
    run_dir: str
    rung_dir: str
    tc: object
    data: SFTData
    capture: dict
    sample: dict | None
    backend: str
    world: int


def worker(rank: int, world: int, master_addr: str, master_port: int, job: Rung) -> int:
    import torch
    from dsv4.megatron.nanwatch import Forensics
    from dsv4.megatron.parallel import init_parallel
    from dsv4.megatron.train import Trainer, init_distributed, quiet_libraries, row_hash, split_micro_batches
    quiet_libraries()
    RunContext.load(job.run_dir)                     # the socket interface for gloo/NCCL
    tc, cap = job.tc, job.capture
    init_distributed(rank, world, job.backend, tc.device, master_addr, master_port)
    init_parallel(tc.layout, tc.seed)
    t0 = time.perf_counter()
    trainer = Trainer(tc, init=None)
    trainer.load(Path(cap["checkpoint"]), with_optimizer=False)
    trainer.iteration = cap["step"] - 1              # the plant and the monitor count optimizer steps
    r = trainer.ranks
    rows_per_rank = tc.global_batch_size // r.dp
    batch = next(job.data.step_batches(rows_per_rank)(r.dp_rank, r.dp, cap["step"] - 1))
    hashes = [row_hash(t) for t in batch["tokens"]]
    # the capture's rows of all DP ranks, in DP order: the same global batch whatever this rung's DP is
    want = [h for k in sorted(cap["rows_by_dp_rank"], key=int) for h in cap["rows_by_dp_rank"][k]]
    mine = want[r.dp_rank * rows_per_rank:(r.dp_rank + 1) * rows_per_rank]
    changed = [r.dp_rank * rows_per_rank + i for i, (h, w) in enumerate(zip(hashes, mine)) if h != w]
    if job.sample:
        # the sample is named by its row in the captured global batch; any rank can rebuild its holder's rows
        holder, index = divmod(int(job.sample["global_row"]), rows_per_rank)
        theirs = batch if holder == r.dp_rank else next(job.data.step_batches(rows_per_rank)(holder, r.dp, cap["step"] - 1))
        batch = edit_rows(batch, job.sample["op"], {k: v[index] for k, v in theirs.items()},
                          index if holder == r.dp_rank else None)
    forensics = Forensics(batch_rows=tc.micro_batch_size).attach(trainer.stage)
    res = trainer.step(split_micro_batches(batch, tc.micro_batch_size), update=False)
    forensics.detach()
    found = [None] * world
    torch.distributed.all_gather_object(found, {"rank": r.rank, "dp_rank": r.dp_rank, "pp_rank": r.pp_rank,
                                                "found": forensics.found, "data_ok": hashes == mine,
                                                "changed": changed})
    if r.rank == 0:
        result = {"finite": res.finite, "loss": res.loss, "grad_norm": res.grad_norm,
                  "first": res.nonfinite and {k: res.nonfinite[k] for k in ("module", "phase", "kind", "rank")},
                  "forensics": _first_found(found), "data_matches_capture": all(f["data_ok"] for f in found),
                  "data_changed_rows": sorted({g for f in found for g in f["changed"]}),
                  "seconds": round(time.perf_counter() - t0, 2), "world": world,
                  "layout": {"tp": tc.layout.tp, "pp": tc.layout.pp, "ep": tc.layout.ep, "dp": r.dp},
                  "model": {"attn_impl": tc.model.attn_impl, "dtype": tc.model.dtype, "recompute": tc.recompute,
                            "n_layers": tc.model.n_layers}}
        atomic_write(Path(job.rung_dir) / "result.json", json.dumps(result, indent=2, default=str))
    trainer.close()
    return 0


def _first_found(found: list[dict]) -> dict:
    """Forward: the earliest pipeline stage's event; backward: the latest stage's (backward runs last to first)."""
    out = {}
    fwd = [f for f in found if "forward" in f["found"]]
    if fwd:
        f = min(fwd, key=lambda f: (f["pp_rank"], f["rank"]))
        out["forward"] = {**f["found"]["forward"], "rank": f["rank"], "dp_rank": f["dp_rank"]}
    bwd = [f for f in found if "backward" in f["found"]]
    if bwd:
        f = min(bwd, key=lambda f: (-f["pp_rank"], f["rank"]))
        out["backward"] = {**f["found"]["backward"], "rank": f["rank"], "dp_rank": f["dp_rank"]}
    return out


def main(argv=None) -> int:
    import argparse
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run-dir", required=True, type=Path)
    ap.add_argument("--rung-dir", required=True, type=Path)
    args = ap.parse_args(argv)
    ctx = RunContext.load(args.run_dir)
    cfg = ctx.cfg
    try:
        rung = json.loads((args.rung_dir / "rung.json").read_text())
        cap = load_capture(args.run_dir)
        if cfg.get("PRESET_MODE") == "rl":
            raise ValueError("replaying an RL step is not supported: its batch comes from the rollout engine")
        tc = apply_switches(train_config(cfg), rung.get("switches", []), rung.get("cut_layers"))
        # the replay's one run is watched (with the forensics): running a bad step again would double the rung
        tc = replace(tc, nonfinite_locate="every_step")
        world = 1 if "layout_1" in rung.get("switches", []) else world_size(cfg)
        tc.layout.validate(tc.model, world, tc.seq_len)
    except (ValueError, KeyError, FileNotFoundError, CaptureError) as e:
        log(f"error: {e}")
        return 2
    if cfg.get("PRESET_PLANT_NAN"):               # the run's planted fault, as its jobs had it (launcher/plan.py)
        os.environ.setdefault("V4_PLANT_NAN", cfg["PRESET_PLANT_NAN"])
    data = SFTData(str(ctx.paths.sft_data), tokenizer_dirs(cfg), tc.seq_len, cfg["PRESET_SEED"] + DATA_SEED_OFFSET)
    job = Rung(str(args.run_dir), str(args.rung_dir), tc, data, cap, rung.get("sample"), cfg["HW_DIST_BACKEND"], world)
    log(f"nan replay: step {cap['step']} from {cap['checkpoint']}, switches {rung.get('switches') or 'none'}"
        + (f", sample {rung['sample']}" if rung.get("sample") else "") + f", world {world}")
    from dsv4.megatron.launch import launch
    # as the run's own train step: ranks as local processes, or Ray actors when the rung is a Ray job
    return launch(worker, world, job, tc.device, 0, log, local=ranks_local(cfg) or "RAY_ADDRESS" not in os.environ)


if __name__ == "__main__":
    sys.exit(main())
