"""Runs side by side: `v4 runs compare` (a verdict per metric) and `v4 runs plot` (curves in one PNG).

Both read each run's `metrics.jsonl` (one row per step, SFT or RL). A metric of two runs is *identical* when every
common step has the same value to the bit, *within* a relative tolerance `tol` (|a - b| <= tol * max(|a|, |b|, 1e-12)),
or *diverged* from the first step where it is not; a NaN on one side only counts as a divergence there. The first
run is the reference the others are compared with.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

SFT_METRICS = ("loss", "grad_norm", "lr", "tokens_per_s", "peak_mem_gb")
RL_METRICS = ("reward_mean", "logprob_diff_max", "loss", "grad_norm", "rollout_tokens_per_s", "peak_mem_gb")
# what a comparison judges by default: the numbers that say "the same computation", not speed or memory
DEFAULT_COMPARE = ("loss", "grad_norm", "reward_mean", "logprob_diff_max")


def read_metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    rows = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue                      # a line cut by a killed job: the gates say so, here it is skipped
    # a resumed run repeats steps: the last row of a step is what the run kept
    return sorted({r["step"]: r for r in rows if "step" in r}.values(), key=lambda r: r["step"])


@dataclass
class MetricVerdict:
    metric: str
    run: str
    verdict: str                      # identical | within | diverged | missing
    steps: int = 0                    # common steps compared
    max_abs: float = 0.0
    max_rel: float = 0.0
    first_diverged: int | None = None
    values_at_divergence: tuple | None = None


@dataclass
class Comparison:
    runs: list[str]
    metrics: list[str]
    tol: float
    verdicts: list[MetricVerdict] = field(default_factory=list)
    table: list[dict] = field(default_factory=list)    # step -> {run: {metric: value}}

    @property
    def ok(self) -> bool:
        return all(v.verdict in ("identical", "within") for v in self.verdicts)


def _same(a, b, tol: float) -> tuple[bool, bool]:
    """(identical, within tol); NaN equals NaN (both runs went non-finite alike)."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True, True
    if a == b:
        return True, True
    try:
        d = abs(a - b)
    except TypeError:
        return False, False
    if math.isnan(d):
        return False, False
    return False, d <= tol * max(abs(a), abs(b), 1e-12)


def compare(runs: dict[str, list[dict]], metrics: list[str] | None, tol: float) -> Comparison:
    """`runs`: name -> metric rows, the first the reference."""
    names = list(runs)
    ref = {r["step"]: r for r in runs[names[0]]}
    present = set.intersection(*[set().union(*(r.keys() for r in rows)) if rows else set() for rows in runs.values()])
    chosen = [m for m in (metrics or DEFAULT_COMPARE) if metrics or m in present]
    out = Comparison(names, chosen, tol)
    for name in names[1:]:
        other = {r["step"]: r for r in runs[name]}
        common = sorted(set(ref) & set(other))
        for m in chosen:
            pairs = [(s, ref[s].get(m), other[s].get(m)) for s in common if m in ref[s] and m in other[s]]
            v = MetricVerdict(m, name, "missing" if not pairs else "identical", len(pairs))
            for s, a, b in pairs:
                ident, within = _same(a, b, tol)
                if not ident and isinstance(a, (int, float)) and isinstance(b, (int, float)):
                    d = abs(a - b)
                    if not math.isnan(d):
                        v.max_abs = max(v.max_abs, d)
                        v.max_rel = max(v.max_rel, d / max(abs(a), abs(b), 1e-12))
                if not within and v.first_diverged is None:
                    v.first_diverged, v.values_at_divergence = s, (a, b)
                if not ident and v.verdict == "identical":
                    v.verdict = "within"
            if v.first_diverged is not None:
                v.verdict = "diverged"
            out.verdicts.append(v)
    steps = sorted(set().union(*[{r["step"] for r in rows} for rows in runs.values()]))
    by = {n: {r["step"]: r for r in rows} for n, rows in runs.items()}
    out.table = [{"step": s, **{n: {m: by[n].get(s, {}).get(m) for m in chosen} for n in names}} for s in steps]
    return out


def differing_keys(configs: dict[str, dict]) -> dict[str, list[str]]:
    """Per run, `KEY=value` for each configuration value that is not the same in every run (run ids and paths
    that name the run itself left out): what a legend should say about each curve."""
    skip = ("RUN_ID", "RUN_DIR", "PLAN", "CKPT_", "V4_RUN")
    keys = sorted(set().union(*configs.values()))
    out = {n: [] for n in configs}
    for k in keys:
        if k.startswith(skip) or any(s in k for s in ("_DIR", "PATH")):
            continue
        vals = [json.dumps(c.get(k), sort_keys=True, default=str) for c in configs.values()]
        if len(set(vals)) > 1:
            for n, c in configs.items():
                v = c.get(k)
                out[n].append(f"{k}={' '.join(map(str, v)) if isinstance(v, list) else v}")
    return out


def run_config(run_dir: Path) -> dict:
    try:
        return json.loads((Path(run_dir) / "config.json").read_text())["values"]
    except (OSError, ValueError, KeyError):
        return {}


def plot(runs: dict[str, list[dict]], out: Path, labels: dict[str, str] | None = None,
         metrics: list[str] | None = None, title: str = "") -> Path:
    """One PNG: a panel per metric against step, every run overlaid (matplotlib, no display needed)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rl = any("reward_mean" in r for rows in runs.values() for r in rows)
    wanted = metrics or list(RL_METRICS if rl else SFT_METRICS)
    have = [m for m in wanted if any(m in r and _finite(r[m]) for rows in runs.values() for r in rows)]
    if not have:
        raise ValueError("none of the metrics " + ", ".join(wanted) + " has a finite value in these runs")
    cols = min(3, len(have))
    nrows = -(-len(have) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(5.2 * cols, 3.4 * nrows), squeeze=False)
    for ax, m in zip(axes.flat, have):
        for name, rows in runs.items():
            pts = [(r["step"], r[m]) for r in rows if m in r and _finite(r[m])]
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, marker="o", markersize=3, linewidth=1.4, label=(labels or {}).get(name, name))
        ax.set_title(m)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(have):]:
        ax.axis("off")
    handles, names = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, names, loc="lower center", ncol=1 if len(names) > 2 else len(names), fontsize=8,
               frameon=False)
    if title:
        fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.04 * (1 + len(names) // 2), 1, 0.95 if title else 1))
    return _save(fig, out)


def _save(fig, out: Path) -> Path:
    """Write the figure under a temporary name, then rename: a reader never sees half a PNG."""
    import matplotlib.pyplot as plt
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(out)
    return out


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def read_records(path: Path) -> list[dict]:
    """Benchmark records (benchmarks/records/*.jsonl): one JSON object a line, with date, commit, benchmark and
    metrics; file order is measurement order."""
    out = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if line.strip():
            try:
                out.append(json.loads(line))
            except ValueError as e:
                raise ValueError(f"{path}:{n}: not a JSON record ({e})") from None
    return out


def plot_records(records: list[dict], benchmarks: list[str], metric: str, out: Path) -> Path:
    """`metric` of each named benchmark across its records (x: the record's date and commit), one line each."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = {b: [r for r in records if r.get("benchmark") == b and _finite(r.get("metrics", {}).get(metric))]
              for b in benchmarks}
    empty = [b for b, rs in series.items() if not rs]
    if empty:
        known = sorted({r.get("benchmark") for r in records if metric in r.get("metrics", {})})
        raise ValueError(f"no {metric} for {', '.join(empty)}; benchmarks with {metric}: {', '.join(known)}")
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * max(len(rs) for rs in series.values())), 4.0))
    for b, rs in series.items():
        ax.plot(range(len(rs)), [r["metrics"][metric] for r in rs], marker="o", label=b)
        for i, r in enumerate(rs):
            ax.annotate((r.get("commit") or "")[:7], (i, r["metrics"][metric]), fontsize=7,
                        textcoords="offset points", xytext=(0, 5), ha="center")
    longest = max(series.values(), key=len)
    ax.set_xticks(range(len(longest)), [r.get("date", "") for r in longest], rotation=30, fontsize=7)
    ax.set_ylabel(metric)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return _save(fig, out)
