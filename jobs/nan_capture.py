"""`steps/train/nan_capture.json`: what a run that stopped with exit 16 keeps for `v4 nan bisect` to replay.

Written once by the trainer at the failing step (dsv4/megatron/train.py `_stop_nonfinite`), read by the bisect
(launcher/nanbisect.py) and by each of its replays (jobs/nan_replay.py). `NanCapture` is the schema both readers
hold it to: a file cut short (a full disk, a copy interrupted) or edited by hand is an error that names the file
and the field, never a traceback deep in a replay.
"""
from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

CAPTURE = Path("steps") / "train" / "nan_capture.json"


class CaptureError(ValueError):
    """The capture is there but cannot be used (unreadable, not JSON, not a capture)."""


class NanCapture(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    step: int = Field(ge=1)                     # the optimizer step that went non-finite
    checkpoint: str = Field(min_length=1)       # the weights that step started from
    iteration: int = Field(ge=0)
    # each data-parallel rank's rows of the step, by content hash (dsv4.megatron.train.row_hash), ranks "0".."n-1"
    rows_by_dp_rank: dict[str, list[str]] = Field(min_length=1)
    micro_batch_size: int = Field(ge=1)
    plant: str = ""

    @model_validator(mode="after")
    def _ranks(self):
        ranks = sorted(self.rows_by_dp_rank, key=lambda k: int(k) if k.isdigit() else -1)
        if ranks != [str(i) for i in range(len(ranks))]:
            raise ValueError(f"rows_by_dp_rank's keys must be the data-parallel ranks 0..{len(ranks) - 1}, "
                             f"got {', '.join(ranks)}")
        sizes = {len(v) for v in self.rows_by_dp_rank.values()}
        if len(sizes) != 1 or 0 in sizes:
            raise ValueError("rows_by_dp_rank must give every data-parallel rank the same, non-zero number of rows, "
                             f"got {', '.join(f'{k}: {len(v)}' for k, v in self.rows_by_dp_rank.items())}")
        return self


def _why(e: ValidationError) -> str:
    parts = []
    for err in e.errors()[:4]:
        loc = ".".join(str(x) for x in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        parts.append(f"{loc + ': ' if loc else ''}{msg[0].lower() + msg[1:]}")
    return "; ".join(parts)


def load_capture(run_dir: Path) -> dict:
    """The run's capture, checked against `NanCapture`, as a dict. FileNotFoundError: no capture, or its
    checkpoint is gone; CaptureError: a capture that is not one."""
    path = Path(run_dir) / CAPTURE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: the run did not stop on a non-finite step, or stopped before "
                                f"captures were kept (re-run it to the failing step)")
    fix = "the file is written once, at exit 16: re-run the run to its failing step to capture it again"
    try:
        raw = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise CaptureError(f"{path} is not a JSON capture ({e}): cut short or edited; {fix}") from None
    try:
        cap = NanCapture.model_validate(raw).model_dump()
    except ValidationError as e:
        raise CaptureError(f"{path} is not a valid capture: {_why(e)}; {fix}") from None
    if not Path(cap["checkpoint"]).is_dir():
        raise FileNotFoundError(f"the capture's checkpoint {cap['checkpoint']} is gone (pruned or moved)")
    return cap
