"""A run's `metrics.jsonl`, read against its schema: one JSON object a line, one line per optimizer step.

The train jobs append a row per step (jobs/common.py `RunContext.write_metrics`; the SFT row from
dsv4/megatron/train.py, the RL row from dsv4/rl/loop.py). `MetricsRow` declares what a row is: an integer `step`
and the metrics, each of its declared type; NaN and infinities are numbers here (Python's json writes them so, and a
NaN is a finding, not a malformed line). Keys it does not declare are kept as they are: a job may log more.

A line that is not UTF-8, not JSON, not an object, or not a valid row is not fatal (a job killed mid-write leaves a
truncated last line); it is kept as a `BadLine` with its file:line and why, so that every reader can say how much of
the file its verdict stands on. A resumed or restarted job repeats the steps after its checkpoint; its first row moves
the earlier job's rows of those steps to metrics.superseded.jsonl (jobs/common.py), so each step has one row here (and
were a file written otherwise to hold two, the last row of a step is the one the run kept).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

Number = int | float            # strict: a bool or a string is not a number


class MetricsRow(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    step: int = Field(ge=0)
    # SFT (and the trainer's side of an RL step)
    loss: float | None = None
    grad_norm: float | None = None
    lr: float | None = None
    tokens: Number | None = None
    loss_tokens: Number | None = None
    step_time_s: float | None = None
    tokens_per_s: float | None = None
    peak_mem_gb: float | None = None
    world: int | None = None
    model_tflops: float | None = None
    mfu: float | None = None
    mtp_loss: float | None = None
    # the train job's first row: what its first step found in the compile cache (dsv4/procenv.py CacheReport)
    compile_cache: str | None = None            # cold | warm | partial
    compile_cache_entries: int | None = None    # entries there before it
    compile_cache_new: int | None = None        # entries it compiled
    restarts: int | None = None         # a restarted job's rows: the run's restarts before it (launcher/recovery.py)
    # RL
    reward_mean: float | None = None
    reward_std: float | None = None
    live_groups: Number | None = None
    response_len: float | None = None
    logprob_diff_mean: float | None = None
    logprob_diff_max: float | None = None
    rollout_kl: float | None = None
    pg_clipfrac: float | None = None
    pg_clipfrac_lower: float | None = None
    ppo_kl: float | None = None
    route_agree: float | None = None
    rollout_s: float | None = None
    rollout_tokens_per_s: float | None = None
    sync_s: float | None = None
    sync_gb_s: float | None = None
    sync_max_err: float | None = None
    weights_synced: bool | None = None
    weight_version: str | int | None = None
    samples: int | None = None
    kl: float | None = None
    tis_mean: float | None = None
    # where an RL step's time went (dsv4/rl/loop.py STEP_PARTS), summing to step_time_s
    time_rollout_s: float | None = None
    time_logprob_s: float | None = None
    time_train_s: float | None = None
    time_sync_s: float | None = None
    time_wait_s: float | None = None
    # a rollout engine lost during the step and restarted (dsv4/rl/restart.py), and the samples rolled out again
    rollout_restarts: int | None = None
    rollout_regenerated_samples: int | None = None


@dataclass
class BadLine:
    path: str
    line: int
    why: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.why}"


@dataclass
class MetricsFile:
    path: Path
    rows: list[dict] = field(default_factory=list)       # one per step, in step order
    bad: list[BadLine] = field(default_factory=list)
    exists: bool = False
    error: str = ""                                      # the file is there but could not be read at all

    @property
    def steps(self) -> list[int]:
        return [r["step"] for r in self.rows]

    def bad_summary(self, most: int = 3) -> str:
        """"2 malformed lines: PATH:4: not JSON (...); PATH:7: step: ..." (the first `most` of them)."""
        if self.error:
            return self.error
        if not self.bad:
            return ""
        shown = "; ".join(map(str, self.bad[:most])) + ("; ..." if len(self.bad) > most else "")
        return f"{len(self.bad)} malformed line{'s' if len(self.bad) > 1 else ''} skipped: {shown}"


def _why(e: ValidationError) -> str:
    parts = []
    for err in e.errors()[:3]:
        loc = ".".join(str(x) for x in err["loc"] if not isinstance(x, int) and x not in ("int", "float"))
        got = err.get("input")
        shown = repr(got) if not isinstance(got, dict) else "an object"
        if len(shown) > 40:
            shown = shown[:37] + "..."
        parts.append(f"{loc + ': ' if loc else ''}{err['msg'].lower()} (got {shown})")
    return "; ".join(dict.fromkeys(parts))


def parse_line(raw: bytes) -> dict:
    """One line as a row, or ValueError saying why it is not one."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"not UTF-8 (byte {raw[e.start]:#04x} at column {e.start + 1})") from None
    try:
        obj = json.loads(text)
    except ValueError as e:
        raise ValueError(f"not JSON ({e})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"not a JSON object but {type(obj).__name__}")
    try:
        return MetricsRow.model_validate(obj).model_dump(exclude_unset=True)
    except ValidationError as e:
        raise ValueError(_why(e)) from None


def read(run_dir: Path) -> MetricsFile:
    """RUN/metrics.jsonl checked line by line (a missing file: no rows, `exists` False)."""
    path = Path(run_dir) / "metrics.jsonl"
    out = MetricsFile(path)
    try:
        data = path.read_bytes()
    except (FileNotFoundError, NotADirectoryError):
        return out
    except OSError as e:                  # a directory, no permission
        out.exists, out.error = True, f"cannot be read ({e.strerror or e})"
        return out
    out.exists = True
    by_step: dict[int, dict] = {}
    for no, raw in enumerate(data.split(b"\n"), 1):
        if not raw.strip():
            continue
        try:
            row = parse_line(raw)
        except ValueError as e:
            out.bad.append(BadLine(str(path), no, str(e)))
            continue
        by_step[row["step"]] = row
    out.rows = [by_step[s] for s in sorted(by_step)]
    return out
