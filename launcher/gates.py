"""Gates: assertions over a run's metrics, and the stage order they unlock.

A gate reads what the train step left in the run directory (metrics.jsonl, one row per step, and
steps/train/reload_check.json) and passes, fails, or cannot be evaluated (which fails too: a gate
that cannot see its evidence must not pass).
"""
from __future__ import annotations

import fcntl
import json
import math
import statistics
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from dsv4.fileio import atomic_write

RELOAD_CHECK = "steps/train/reload_check.json"


@dataclass
class GateResult:
    name: str
    passed: bool
    detail: str
    # peak_memory and step_time: the cost model's figure for this run's layout beside the measured one, and the
    # relative error (recorded in gates.json, so B0 runs calibrate the model where it has never been measured)
    measured: float | None = None
    predicted: float | None = None
    error: float | None = None


def read_metrics(run_dir: Path) -> list[dict]:
    return read_metrics_checked(run_dir)[0]


def read_metrics_checked(run_dir: Path) -> tuple[list[dict], list[int]]:
    """The per-step rows of metrics.jsonl, and the numbers of the lines that are not rows of its schema
    (launcher/metrics.py: a job killed mid-write leaves a truncated last line): those are skipped, not fatal."""
    from launcher import metrics
    m = metrics.read(run_dir)
    return m.rows, [b.line for b in m.bad]


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def evaluate(names: list[str], run_dir: Path, cfg) -> list[GateResult]:
    rows, bad = read_metrics_checked(run_dir)
    # said in every gate's detail: a verdict over the remaining rows must not read as a verdict over all of them
    skipped = (f"; skipped {len(bad)} malformed line(s) of metrics.jsonl (line {', '.join(map(str, bad[:5]))}"
               f"{', ...' if len(bad) > 5 else ''})") if bad else ""
    out = []
    for name in names:
        if not rows:
            r = GateResult(name, False, f"no metrics in {run_dir}/metrics.jsonl")
        else:
            r = GATES[name](rows, Path(run_dir), cfg)
        out.append(replace(r, detail=r.detail + skipped))
    return out


def finite_loss(rows, run_dir, cfg) -> GateResult:
    bad = [r["step"] for r in rows if not (_finite(r.get("loss")) and _finite(r.get("grad_norm")))]
    if bad:
        return GateResult("finite_loss", False, f"non-finite loss or grad norm at step(s) {bad[:10]}")
    return GateResult("finite_loss", True, f"{len(rows)} steps, all finite")


def loss_decreasing(rows, run_dir, cfg) -> GateResult:
    if len(rows) < 2:
        return GateResult("loss_decreasing", False, f"needs >= 2 steps, got {len(rows)}")
    first, last = rows[0].get("loss"), rows[-1].get("loss")
    ok = _finite(first) and _finite(last) and last < first
    fmt = lambda v: f"{v:.4f}" if isinstance(v, (int, float)) else repr(v)   # noqa: E731 - a missing loss is None
    return GateResult("loss_decreasing", ok, f"loss {fmt(first)} (step {rows[0]['step']}) -> {fmt(last)} "
                                             f"(step {rows[-1]['step']})")


def reload_equal(rows, run_dir, cfg) -> GateResult:
    path = run_dir / RELOAD_CHECK
    if not path.is_file():
        return GateResult("reload_equal", False, f"{path} missing: the train step did not run its reload check")
    r = json.loads(path.read_text())
    a, b = r.get("loss_continued"), r.get("loss_reloaded")
    ok = _finite(a) and _finite(b) and a == b
    return GateResult("reload_equal", ok, f"next-step loss continued {a!r} vs reloaded {b!r}"
                                          + ("" if ok else f" (diff {abs(a - b) if _finite(a) and _finite(b) else 'n/a'})"))


def _nonfinite_steps(rows, key: str) -> list:
    # max() and median() skip a NaN that is not first (every comparison with it is False): test each value
    return [r["step"] for r in rows if not _finite(r.get(key))]


def _predicted(cfg, key: str) -> tuple[float | None, str]:
    """(the cost model's peak GiB or step seconds for this run's layout, why there is none)."""
    try:
        from launcher import costmodel
        p = costmodel.predict_config(cfg)
    except (KeyError, ValueError, TypeError, ArithmeticError, OSError, ImportError) as e:
        return None, f"no prediction ({type(e).__name__}: {e})"
    value = p.peak_gib if key == "peak" else p.step_s
    return value, "" if value is not None else f"no prediction ({'; '.join(p.notes) or 'no rates'})"


def _against(measured: float, predicted: float | None, why: str, unit: str) -> tuple[str, float | None]:
    if predicted is None:
        return f"; {why}", None
    err = predicted / measured - 1 if measured else None
    return (f"; predicted {predicted:.{1 if unit == 'GB' else 2}f} {unit} (launcher/costmodel.py"
            + (f", error {err:+.1%}" if err is not None else "") + ")"), err


def peak_memory(rows, run_dir, cfg) -> GateResult:
    budget = cfg["HW_PEAK_MEM_BUDGET_GB"]
    if bad := _nonfinite_steps(rows, "peak_mem_gb"):
        return GateResult("peak_memory", False, f"no finite peak memory at step(s) {bad[:10]}")
    peak = max(r["peak_mem_gb"] for r in rows)
    predicted, why = _predicted(cfg, "peak")
    said, err = _against(peak, predicted, why, "GB")
    if not budget:
        return GateResult("peak_memory", True, f"peak {peak:.1f} GB (no budget set on this hardware){said}",
                          peak, predicted, err)
    return GateResult("peak_memory", peak <= budget, f"peak {peak:.1f} GB vs budget {budget:.1f} GB{said}",
                      peak, predicted, err)


def step_time(rows, run_dir, cfg) -> GateResult:
    budget = cfg["HW_STEP_TIME_BUDGET_S"]
    if bad := _nonfinite_steps(rows, "step_time_s"):
        return GateResult("step_time", False, f"no finite step time at step(s) {bad[:10]}")
    steady = [r["step_time_s"] for r in rows[1:]] or [rows[0]["step_time_s"]]  # the first step pays for JIT
    median = statistics.median(steady)
    predicted, why = _predicted(cfg, "step")
    said, err = _against(median, predicted, why, "s")
    if not budget:
        return GateResult("step_time", True, f"median step {median:.2f} s (no budget set on this hardware){said}",
                          median, predicted, err)
    return GateResult("step_time", median <= budget,
                      f"median steady step {median:.2f} s vs budget {budget:.1f} s{said}", median, predicted, err)


def reward_rising(rows, run_dir, cfg) -> GateResult:
    """RL: the mean reward of the last window beats the first window's by PRESET_RL_REWARD_RISE."""
    w, margin = max(1, cfg["PRESET_RL_GATE_WINDOW"]), cfg["PRESET_RL_REWARD_RISE"]
    if len(rows) < 2 * w:
        return GateResult("reward_rising", False, f"needs >= {2 * w} steps (two windows of PRESET_RL_GATE_WINDOW={w}), "
                                                  f"got {len(rows)}")
    if bad := _nonfinite_steps(rows, "reward_mean"):
        return GateResult("reward_rising", False, f"no finite reward_mean at step(s) {bad[:10]}")
    first = statistics.mean(r["reward_mean"] for r in rows[:w])
    last = statistics.mean(r["reward_mean"] for r in rows[-w:])
    return GateResult("reward_rising", last >= first + margin,
                      f"mean reward {first:.3f} (steps {rows[0]['step']}-{rows[w - 1]['step']}) -> {last:.3f} "
                      f"(steps {rows[-w]['step']}-{rows[-1]['step']}); needs a rise of {margin:g}")


def logprob_match(rows, run_dir, cfg) -> GateResult:
    """RL: the trainer's logprob of every response token matches the rollout engine's within PRESET_RL_LOGPROB_TOL."""
    tol = cfg["PRESET_RL_LOGPROB_TOL"]
    if bad := _nonfinite_steps(rows, "logprob_diff_max"):
        return GateResult("logprob_match", False, f"no finite logprob_diff_max at step(s) {bad[:10]}")
    worst = max(rows, key=lambda r: r["logprob_diff_max"])
    return GateResult("logprob_match", worst["logprob_diff_max"] <= tol,
                      f"max |trainer - rollout| logprob {worst['logprob_diff_max']:.2e} (step {worst['step']}) "
                      f"vs tolerance {tol:g}")


def weights_synced(rows, run_dir, cfg) -> GateResult:
    """RL: after every sync the engine's weights read back equal to the trainer's (within the FP8 bound)."""
    unread = [r["step"] for r in rows if r.get("weights_synced") is None]
    if unread:
        return GateResult("weights_synced", False, f"no read-back of the engine's weights at step(s) {unread[:10]}")
    bad = [r["step"] for r in rows if not r["weights_synced"]]
    worst = max(r.get("sync_max_err", 0.0) for r in rows)
    fmt = cfg["PRESET_RL_SYNC_FORMAT"]
    bound = "exact" if fmt == "full" else "within the FP8 bound"
    return GateResult("weights_synced", not bad, f"{len(rows) - len(bad)}/{len(rows)} syncs {bound} ({fmt}); "
                                                 f"max |engine - trainer| {worst:.2e}"
                                                 + (f"; off at step(s) {bad[:10]}" if bad else ""))


def baseline(rows, run_dir, cfg) -> GateResult:
    """The run follows PRESET_BASELINE_RUN step by step (loss and gradient norm, RL: reward and mismatch) within
    PRESET_BASELINE_TOL (relative): "this kernel change must not move the loss"."""
    from launcher import compare
    from launcher import metrics as metrics_file
    ref_id, tol = cfg["PRESET_BASELINE_RUN"], cfg["PRESET_BASELINE_TOL"]
    if not ref_id:
        return GateResult("baseline", False, "PRESET_BASELINE_RUN is empty: name the run to compare with")
    ref = compare.read_metrics(Path(cfg["V4_OUT"]) / ref_id)
    if not ref:
        return GateResult("baseline", False, f"baseline run {ref_id} has no metrics under {cfg['V4_OUT']}")
    ref_dir = Path(cfg["V4_OUT"]) / ref_id
    # the comparison `v4 runs compare` makes: a step either run lacks, a malformed line (what it held is unknown) or
    # runs of other modes fail it whatever the values
    res = compare.compare({ref_id: ref, "this run": rows}, None, tol,
                          bad={ref_id: metrics_file.read(ref_dir).bad, "this run": metrics_file.read(run_dir).bad},
                          modes={ref_id: compare.run_mode(ref_dir, ref), "this run": compare.run_mode(run_dir, rows)})
    if not res.verdicts:                          # all() of nothing would pass: nothing compared is a failure
        return GateResult("baseline", False, f"no metric in common with baseline {ref_id} "
                                             f"(compared: {', '.join(compare.DEFAULT_COMPARE)})")
    if res.problems:
        return GateResult("baseline", False, f"not comparable with baseline {ref_id}: {res.problems[0].detail}"
                                             + (f" (and {len(res.problems) - 1} more)" if len(res.problems) > 1 else ""))
    bad = [v for v in res.verdicts if v.verdict not in ("identical", "within")]
    if bad:
        v = bad[0]
        where = f"from step {v.first_diverged} ({v.values_at_divergence[0]!r} vs {v.values_at_divergence[1]!r})" \
            if v.first_diverged is not None else "(no common steps)"
        return GateResult("baseline", False, f"{v.metric} diverged from baseline {ref_id} {where}; "
                                             f"tolerance {tol:g}")
    worst = max((v.max_rel for v in res.verdicts), default=0.0)
    return GateResult("baseline", True, f"{', '.join(res.metrics)} follow {ref_id} over {res.verdicts[0].steps} "
                                        f"steps (largest relative difference {worst:.2g}, tolerance {tol:g})")


GATES = {f.__name__: f for f in (finite_loss, loss_decreasing, reload_equal, peak_memory, step_time,
                                   reward_rising, logprob_match, weights_synced, baseline)}


# --- stage order -----------------------------------------------------------------------------------

def stage_key(cfg) -> str:
    """Runs of the 'same config' for stage ordering: same cluster and hardware."""
    return f"{cfg['V4_CLUSTER_NAME']}/{cfg.selection.hw}"


def _stages_file(cfg) -> Path:
    return Path(cfg["V4_OUT"]) / "stages.json"


# What a later stage relies on from a passed one: the nodes, their software and the hardware facts. Not the workload
# (it differs from stage to stage by design), nor how the launcher reaches the nodes (executor, ports, timeouts).
STAGE_KEYS = ("V4_MASTER_IP", "V4_WORKER_IPS", "V4_NUM_NODES", "V4_NUM_GPUS_PER_NODE", "V4_GPU_MODEL", "V4_TRANSPORT",
              "V4_PYTHON", "V4_IMAGE", "V4_CONTAINER", "V4_WORK")


def stage_config(cfg) -> dict:
    return {k: cfg.shown(k) for k in sorted(cfg.values)
            if (k in STAGE_KEYS or k.startswith("HW_")) and not cfg.is_secret(k)}


def stage_differences(cfg, entry: dict) -> list[str]:
    """`KEY: was -> now` for each value that differs from the one a stage passed with (none for old records)."""
    then = entry.get("config")
    if then is None:
        return []
    now = stage_config(cfg)
    return [f"{k}: {then.get(k)!r} -> {now.get(k)!r}" for k in sorted(set(then) | set(now)) if then.get(k) != now.get(k)]


def passed_stages(cfg) -> dict:
    """The stages passed for this cluster/hw, each with `differences` from the configuration it passed with."""
    p = _stages_file(cfg)
    found = json.loads(p.read_text()).get(stage_key(cfg), {}) if p.is_file() else {}
    return {stage: {**entry, "differences": stage_differences(cfg, entry)} for stage, entry in found.items()}


@contextmanager
def _locked(path: Path):
    """An exclusive lock on `path`.lock: runs finishing at the same time (other stages, other clusters) share
    stages.json, and a read-modify-write without it keeps only the last writer's entry."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def left_out(cfg) -> list[str]:
    """The steps and gates the preset file names that this run's configuration drops (a cut-down run, e.g.
    `--set PRESET_GATES=finite_loss`): such a run proves less than the stage asks, so it is not a pass of it."""
    out = []
    for key in ("PRESET_STEPS", "PRESET_GATES"):
        own = cfg.set_by(key, "preset")
        if own is not None:
            wanted = cfg.resolved.get((key, own), "").split()
            out += [f"{key[7:-1].lower()} {x}" for x in wanted if x not in cfg[key]]
    return out


def record_pass(cfg, stage: str, run_id: str, results: list[GateResult]) -> None:
    p = _stages_file(cfg)
    with _locked(p):
        data = json.loads(p.read_text()) if p.is_file() else {}
        data.setdefault(stage_key(cfg), {})[stage] = {
            "run_id": run_id, "passed_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "gates": [asdict(r) for r in results], "config": stage_config(cfg)}
        atomic_write(p, json.dumps(data, indent=2))       # readers (passed_stages) take no lock: see old or new
