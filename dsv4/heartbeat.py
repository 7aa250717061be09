"""Progress heartbeats of a training rank: what a watchdog needs to tell a hung step from a slow one, and which rank
did not arrive.

Each rank keeps one small JSON file, DIR/rank<N>.json, rewritten at every mark: before it joins the process group,
before a checkpoint load or save, at the start of an optimizer step and before each collective the trainer issues
in it (the loss all-reduce, the gradient check, the optimizer's step). Every rank passes the same marks in the same
order, so a mark's sequence number `seq` compares ranks: when no file changes for a while, the rank with the lowest
`seq` is the one the others wait for. The record carries what it takes to look inside the process from outside
(pid, host, the address that reaches the rendezvous, the interpreter, next to which py-spy lives).

A mark is a rename of a ~250-byte file, without fsync (a heartbeat lost to a crash means nothing): 0.28 ms on this
machine's ext4 (5,000 marks), where renaming over a file flushes it; a round trip on a network filesystem. Four marks
a step against steps of a second or more.

Test hook: `plant="RANK:STEP[:PHASE]"` makes that rank sleep, without end, just before it would mark PHASE
(default `reduce_losses`: the loss all-reduce) of optimizer step STEP -- its peers then wait in that collective.
"""
from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path

from pydantic import BaseModel, ConfigDict

HEARTBEAT_DIR = "heartbeat"          # under the run directory: RUN/heartbeat/rank<N>.json
# The marks, in the order a rank passes them within one optimizer step (start and restore come before the first).
PHASES = ("start", "restore", "step", "reduce_losses", "grads_finite", "optimizer", "save")
PLANT_PHASE = "reduce_losses"


class Mark(BaseModel):
    """One rank's latest heartbeat (the file's whole content)."""
    model_config = ConfigDict(extra="forbid", frozen=True)

    rank: int
    world: int
    seq: int                  # marks this process has passed: comparable across the ranks of one job
    step: int                 # the optimizer step the mark belongs to (0 before the first)
    phase: str                # one of PHASES
    time: float               # the writer's wall clock (the reader judges staleness by its own clock)
    pid: int
    host: str                 # hostname
    ip: str                   # the address this rank's host uses to reach the rendezvous
    python: str               # sys.executable: py-spy is installed beside it


def rank_file(directory: str | Path, rank: int) -> Path:
    return Path(directory) / f"rank{rank}.json"


def _route_ip(master_addr: str) -> str:
    """The local address that routes to `master_addr` (a UDP connect sends nothing)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((master_addr, 9))
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def parse_plant(spec: str) -> tuple[int, int, str] | None:
    """"RANK:STEP[:PHASE]" -> (rank, step, phase); "" -> None; ValueError naming the problem otherwise."""
    if not spec:
        return None
    parts = spec.split(":")
    if len(parts) not in (2, 3) or not all(p.strip().isdigit() for p in parts[:2]):
        raise ValueError(f"planted hang {spec!r}: expected RANK:STEP[:PHASE], e.g. 1:2")
    phase = parts[2] if len(parts) == 3 else PLANT_PHASE
    if phase not in PHASES:
        raise ValueError(f"planted hang {spec!r}: phase {phase!r} is not one of {', '.join(PHASES)}")
    return int(parts[0]), int(parts[1]), phase


def planted_hang(rank: int, step: int, phase: str) -> None:
    """The planted fault: never return (the watchdog's stacks show this frame)."""
    print(f"planted hang: rank {rank} sleeps before {phase} of step {step}", file=sys.stderr, flush=True)
    while True:
        time.sleep(3600)


class Heartbeat:
    """Writes this rank's marks; `directory` "" makes every mark a no-op (no watchdog)."""

    def __init__(self, directory: str | Path, rank: int, world: int, master_addr: str | None = None,
                 plant: str = ""):
        self.path = rank_file(directory, rank) if directory else None
        self.rank, self.world = rank, world
        self.plant = parse_plant(plant)
        self.seq = 0
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        addr = master_addr or os.environ.get("MASTER_ADDR", "127.0.0.1")
        self._fixed = dict(rank=rank, world=world, pid=os.getpid(), host=socket.gethostname(),
                           ip=_route_ip(addr), python=sys.executable)
        # One process may open several writers (the worker, then each Trainer): its count goes on.
        try:
            last = Mark.model_validate_json(self.path.read_bytes())
            if last.pid == os.getpid():
                self.seq = last.seq
        except (OSError, ValueError):
            pass

    def mark(self, step: int, phase: str) -> None:
        if self.plant is not None and self.plant == (self.rank, step, phase):
            planted_hang(self.rank, step, phase)
        if self.path is None:
            return
        self.seq += 1
        m = Mark(seq=self.seq, step=step, phase=phase, time=time.time(), **self._fixed)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        tmp.write_text(m.model_dump_json())
        os.replace(tmp, self.path)


def collective_timeout_s(backend: str, hang_timeout_s: float) -> float | None:
    """The process group's timeout when a watchdog with `hang_timeout_s` watches the ranks: twice that, never less
    than torch's default for the backend (NCCL 10 min, gloo 30 min). Otherwise a rank waiting for a peer that never
    arrives would end with a backend timeout first -- an anonymous failure, without the stacks. None: keep torch's."""
    if not hang_timeout_s or hang_timeout_s <= 0:
        return None
    default = 600.0 if backend == "nccl" else 1800.0
    return max(default, 2 * float(hang_timeout_s))
