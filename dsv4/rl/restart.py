"""Rollout engines that come back: an engine lost mid-run (its process killed, out of memory) is started again, gets
the current policy weights and the RL loop goes on from the step it lost.

The GRPO loop (`dsv4.rl.loop.run_grpo`) calls a `Restarter` when a call to its engine fails in a way that says the
engine is gone (`engine_lost`): the client could not reach the server (connection refused or reset, status None),
or the server answered 5xx and then failed its health probe (a live server's 503 for one out-of-memory batch is an
answer, not a loss); for an engine in the trainer's process, torch's out-of-memory error. The restarter builds a new
engine (`make_engine`: for a `v4 rl serve` server, `ServerProcess.restart`, the same command on the same node and
port; in process, a fresh engine), the loop pushes the weights it last synced by the run's sync method and repeats
the step's whole rollout from the same prompts and sampling seeds (so the step is what it would have been), or the
weight sync it was in. PRESET_MAX_RESTARTS (`budget`) bounds the run's restarts of every kind over its life: the
launcher passes the restarts the run recorded before this job (`spent`: lost nodes, hangs, earlier engines; across
`--resume`), and this job restarts engines while `spent` + its own stay under it. Each restart is one JSON line in
`record` (step, phase, cause, seconds to a healthy engine, samples rolled out again, the step's job attempt): the run's
registry reads them back (`v4 runs show`, launcher/recovery.py `engine_restarts`), and the next job counts them.
"""
from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable


class EngineGone(RuntimeError):
    """The rollout engine was lost and no restart is left (or none is configured)."""


def engine_lost(exc: BaseException, engine) -> bool:
    """Whether `exc`, raised by a call to `engine`, means the engine is gone (rather than a request it refused)."""
    from dsv4.rl.http import EngineHTTPError
    if isinstance(exc, EngineHTTPError):
        if exc.status is None:
            return True
        if exc.status >= 500:
            try:
                return not engine.health()
            except Exception:  # noqa: BLE001 - a probe that fails to answer at all says the same
                return True
        return False
    import torch
    return isinstance(exc, torch.OutOfMemoryError) and not hasattr(engine, "base_url")


@dataclass
class RestartRecord:
    step: int
    phase: str              # rollout | sync
    cause: str
    seconds: float          # from the loss to a healthy engine with the current weights
    restart: int            # 1 for the job's first
    at: float               # unix time of the loss
    samples: int = 0        # samples rolled out again: the step's batch for a loss in its rollout, 0 in a sync
    attempt: int = 0        # the step's job it happened in (V4_STEP_ATTEMPT: 0 the first, 1 the first restarted, ...)


class Restarter:
    """Restarts the rollout engine for the RL loop while the run's restarts (`spent` before this job, and this job's)
    stay under `budget`; see the module docstring."""

    def __init__(self, make_engine: Callable[[], object], budget: int, record: Path | None = None,
                 log: Callable[[str], None] = print, spent: int = 0, attempt: int = 0):
        self.make_engine, self.budget, self.record, self.log = make_engine, int(budget), record, log
        self.spent, self.attempt = int(spent), int(attempt)
        self.used = 0
        self.records: list[RestartRecord] = []

    def restart(self, exc: BaseException, step: int, phase: str, resync: Callable[[object], None], samples: int = 0):
        """A new engine after `exc`, with the current weights (`resync(engine)` pushes them); `samples`: what the
        loop rolls out again for it. Raises EngineGone when the run's budget is spent."""
        cause = f"{type(exc).__name__}: {exc}"
        total = self.spent + self.used
        if total >= self.budget:
            raise EngineGone(f"step {step}: the rollout engine was lost during {phase} ({cause}) and no restart is "
                             f"left (PRESET_MAX_RESTARTS={self.budget}: the run has restarted {total} time(s), "
                             f"{self.used} in this job): find why the engine dies (its log), or resume the run with a "
                             f"higher --set PRESET_MAX_RESTARTS") from exc
        self.used += 1
        at, t0 = time.time(), time.perf_counter()
        self.log(f"warning: step {step}: the rollout engine was lost during {phase} ({cause}); restarting it "
                 f"(the run's restart {total + 1} of PRESET_MAX_RESTARTS={self.budget})")
        engine = self.make_engine()
        resync(engine)
        rec = RestartRecord(step, phase, cause, time.perf_counter() - t0, self.used, at, samples, self.attempt)
        self.records.append(rec)
        if self.record is not None:
            self.record.parent.mkdir(parents=True, exist_ok=True)
            with self.record.open("a") as f:
                f.write(json.dumps(asdict(rec)) + "\n")
        self.log(f"step {step}: rollout engine back in {rec.seconds:.1f} s with the current weights; "
                 + ("regenerating the step's samples" if phase == "rollout" else "syncing the step's weights again"))
        return engine


def _die_with_parent() -> None:
    # the server must not outlive the trainer rank that owns it (a stopped Ray job kills the actor, not its children)
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)    # PR_SET_PDEATHSIG
    except OSError:
        pass


class ServerProcess:
    """A `v4 rl serve` process on this node that this process starts, and starts again with the same command after it
    dies. `info` (JSON: pid, url, argv, starts) says which process it is now."""

    def __init__(self, argv: list[str], url: str, log: Path, info: Path, cwd: str | None = None,
                 env: dict | None = None, health_timeout: float = 300.0):
        self.argv, self.url, self.log_path, self.info = list(argv), url, log, info
        self.cwd, self.env, self.health_timeout = cwd, env, health_timeout
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self):
        """Start the server (stopping the old process if it still runs), wait until it generates; -> an HTTPEngine."""
        from dsv4.rl.http import HTTPEngine
        self.stop()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("a") as log:
            self.proc = subprocess.Popen(self.argv, cwd=self.cwd, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                         preexec_fn=_die_with_parent)
        self.starts += 1
        self.info.write_text(json.dumps({"pid": self.proc.pid, "url": self.url, "argv": self.argv,
                                         "starts": self.starts}))
        client = HTTPEngine(self.url, timeout=600.0)
        end = time.monotonic() + self.health_timeout
        while not client.health_generate():
            if self.proc.poll() is not None:
                raise RuntimeError(f"the rollout server exited with {self.proc.returncode} before it was healthy: "
                                   f"read {self.log_path}")
            if time.monotonic() > end:
                raise TimeoutError(f"the rollout server at {self.url} not healthy after {self.health_timeout:g} s: "
                                   f"read {self.log_path}")
            time.sleep(0.2)
        return client

    restart = start

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
