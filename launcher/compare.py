"""Runs side by side: `v4 runs compare` (a verdict per metric) and `v4 runs plot` (curves in one PNG).

Both read each run's `metrics.jsonl` (one row per step, SFT or RL) against its schema (launcher/metrics.py). A
metric of two runs is *identical* when every compared step has the same value to the bit, *within* a relative
tolerance `tol` (|a - b| <= tol * max(|a|, |b|, 1e-12)), or *diverged* from the first step where it is not; a NaN on
one side only counts as a divergence there. The first run is the reference the others are compared with.

A verdict over the steps two runs share would call a 1-step run "the same" as a 6-step one. So the steps compared
are every step any of the runs has (or those `steps` names), and the comparison fails, whatever the values, where a
run lacks one of them, where a run's file has lines that are not rows (what they said is unknown; they are excused
only when `steps` names the steps, each of which every run has), or where the runs are not of one mode (SFT
against RL). Each such problem is named in the result.
"""
from __future__ import annotations

import difflib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from launcher import metrics as metrics_file

SFT_METRICS = ("loss", "grad_norm", "lr", "tokens_per_s", "peak_mem_gb")
RL_METRICS = ("reward_mean", "logprob_diff_max", "loss", "grad_norm", "rollout_tokens_per_s", "peak_mem_gb")
# what a comparison judges by default: the numbers that say "the same computation", not speed or memory
DEFAULT_COMPARE = ("loss", "grad_norm", "reward_mean", "logprob_diff_max")


def read_metrics(run_dir: Path) -> list[dict]:
    """The run's rows, one per step in step order (malformed lines skipped: `metrics.read` names them)."""
    return metrics_file.read(run_dir).rows


def run_mode(run_dir: Path, rows: list[dict]) -> str:
    """"sft" or "rl": the run's PRESET_MODE, else what its rows hold (an RL row has a reward)."""
    mode = run_config(run_dir).get("PRESET_MODE")
    if mode in ("sft", "rl"):
        return mode
    return "rl" if any("reward_mean" in r for r in rows) else "sft"


def parse_steps(spec: str) -> list[tuple[int, int | None]] | str:
    """`--steps`: "common" (the steps every run has), or ranges "3", "1-4", "2,5-8", "5-" (5 to the last)."""
    spec = spec.strip()
    if spec == "common":
        return spec
    out = []
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*(?:(-)\s*(\d+)?)?\s*", part)
        if not m:
            raise ValueError(f"--steps {spec!r}: {part.strip()!r} is not a step or a range "
                             "(e.g. 3, 1-4, 2,5-8, 5-, or common)")
        lo = int(m.group(1))
        hi = lo if not m.group(2) else (int(m.group(3)) if m.group(3) else None)
        if hi is not None and hi < lo:
            raise ValueError(f"--steps {spec!r}: the range {part.strip()} ends before it starts")
        out.append((lo, hi))
    return out


def ranges(steps) -> str:
    """[1, 2, 3, 5, 7, 8] -> "1-3, 5, 7-8"."""
    steps, out = sorted(steps), []
    i = 0
    while i < len(steps):
        j = i
        while j + 1 < len(steps) and steps[j + 1] == steps[j] + 1:
            j += 1
        out.append(str(steps[i]) if i == j else f"{steps[i]}-{steps[j]}")
        i = j + 1
    return ", ".join(out) or "none"


def check_metric_names(names: list[str], runs: dict[str, list[dict]]) -> None:
    """A metric no run has is a misspelling (ValueError naming the close ones), not a "missing" verdict."""
    have = sorted({k for rows in runs.values() for r in rows for k in r} - {"step"})
    for n in names:
        if n not in have:
            near = difflib.get_close_matches(n, have, n=3)
            raise ValueError(f"no run has a metric {n!r}" + (f"; did you mean {' or '.join(near)}?" if near else "")
                             + f" (metrics in these runs: {', '.join(have) or 'none'})")


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
class Problem:
    """What makes a comparison fail whatever its values: missing_steps | malformed_lines | mode | nothing."""
    kind: str
    run: str
    detail: str


@dataclass
class Comparison:
    runs: list[str]
    metrics: list[str]
    tol: float
    verdicts: list[MetricVerdict] = field(default_factory=list)
    table: list[dict] = field(default_factory=list)    # step -> {run: {metric: value}}
    steps: str = ""                                     # the steps compared, as ranges
    n_steps: int = 0
    problems: list[Problem] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)     # said, not failing (malformed lines --steps excuses)

    @property
    def ok(self) -> bool:
        return (not self.problems and bool(self.verdicts)
                and all(v.verdict in ("identical", "within") for v in self.verdicts))


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


def _wanted(have: dict[str, dict], steps) -> list[int]:
    every = set().union(*map(set, have.values()))
    if steps is None:
        return sorted(every)
    if steps == "common":
        return sorted(set.intersection(*map(set, have.values())))
    last = max(every, default=0)
    out = set()
    for lo, hi in steps:
        out.update(range(lo, (last if hi is None else hi) + 1))
    return sorted(out)


def compare(runs: dict[str, list[dict]], metrics: list[str] | None, tol: float, steps=None,
            bad: dict[str, list] | None = None, modes: dict[str, str] | None = None) -> Comparison:
    """`runs`: name -> metric rows, the first the reference. `steps`: `parse_steps`'s answer, None for every step
    any run has; `bad`: name -> its malformed lines (metrics.BadLine); `modes`: name -> "sft" | "rl"."""
    names = list(runs)
    have = {n: {r["step"]: r for r in rows} for n, rows in runs.items()}
    wanted = _wanted(have, steps)
    present = set.intersection(*[set().union(*(r.keys() for r in rows)) if rows else set() for rows in runs.values()])
    chosen = [m for m in (metrics or DEFAULT_COMPARE) if metrics or m in present]
    out = Comparison(names, chosen, tol, steps=ranges(wanted), n_steps=len(wanted))
    ref = names[0]
    if modes and len(set(modes.values())) > 1:
        for n in names[1:]:
            if modes[n] != modes[ref]:
                out.problems.append(Problem("mode", n, f"{n} is an {modes[n].upper()} run, the reference {ref} an "
                                                       f"{modes[ref].upper()} run: their steps are not the same work"))
    for n in names:
        miss = [s for s in wanted if s not in have[n]]
        if miss:
            out.problems.append(Problem(
                "missing_steps", n, f"{n} has no row for step{'s' if len(miss) > 1 else ''} {ranges(miss)} (it has "
                                    f"{len(have[n])} step{'s' if len(have[n]) != 1 else ''}: {ranges(have[n])}; "
                                    f"compared: {ranges(wanted)})"))
    for n, lines in (bad or {}).items():
        if lines:
            what = f"{len(lines)} malformed line{'s' if len(lines) > 1 else ''} in {n}'s metrics.jsonl, " \
                   f"skipped: " + "; ".join(map(str, lines[:3])) + ("; ..." if len(lines) > 3 else "")
            if steps is None:
                out.problems.append(Problem("malformed_lines", n, what + " (what they held is unknown; --steps "
                                                                        "names the steps to compare without them)"))
            else:
                out.notes.append(what)
    if not wanted:
        out.problems.append(Problem("nothing", ref, "no step to compare" + (" in common" if steps == "common" else "")))
    elif not chosen:
        out.problems.append(Problem("nothing", ref, "no metric to compare: none of " + ", ".join(DEFAULT_COMPARE)
                                                    + " is in every run (name them with --metrics)"))
    for name in names[1:]:
        common = [s for s in wanted if s in have[ref] and s in have[name]]
        for m in chosen:
            pairs = [(s, have[ref][s].get(m), have[name][s].get(m)) for s in common
                     if m in have[ref][s] and m in have[name][s]]
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
    out.table = [{"step": s, **{n: {m: have[n].get(s, {}).get(m) for m in chosen} for n in names}} for s in wanted]
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
         metrics: list[str] | None = None, title: str = "", make_parents: bool = True) -> Path:
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
    return _save(fig, out, make_parents)


def _save(fig, out: Path, make_parents: bool) -> Path:
    """Write the figure under a temporary name, then rename: a reader never sees half a PNG. `make_parents`: for
    the launcher's own plots under a run directory; a path someone typed gets no directory made for it."""
    import matplotlib.pyplot as plt
    out = Path(out)
    if make_parents:
        out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp.png")
    try:
        fig.savefig(tmp, dpi=110)
        tmp.replace(out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        plt.close(fig)
    return out


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def read_records(path: Path) -> list[dict]:
    """Benchmark records (benchmarks/records/*.jsonl): one JSON object a line, with date, commit, benchmark and
    metrics; file order is measurement order."""
    out = []
    for n, raw in enumerate(Path(path).read_bytes().split(b"\n"), 1):
        if raw.strip():
            try:
                rec = json.loads(raw.decode("utf-8"))
            except ValueError as e:          # UnicodeDecodeError is one
                raise ValueError(f"{path}:{n}: not a JSON record ({e})") from None
            if not isinstance(rec, dict) or not isinstance(rec.get("metrics", {}), dict):
                raise ValueError(f"{path}:{n}: not a record (an object whose metrics are an object)")
            out.append(rec)
    return out


def plot_records(records: list[dict], benchmarks: list[str], metric: str, out: Path,
                 make_parents: bool = True) -> Path:
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
    return _save(fig, out, make_parents)
