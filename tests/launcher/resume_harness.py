"""What the interrupt-and-resume tests share (tests/launcher/test_resume.py on the local executor,
tests/cluster/test_resume_ray.py on a real local Ray): the launcher as a process of its own, running the real CLI
on a plan cut to one job step (one_step_v4.py) whose job is holding_job.py, and reading back what happened."""
from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

PY = sys.executable
ROOT = Path(__file__).resolve().parents[2]
ONE_STEP = ROOT / "tests" / "launcher" / "one_step_v4.py"
HOLDING_JOB = ROOT / "tests" / "launcher" / "holding_job.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(pred, timeout: float = 15.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (v := pred()):
            return v
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def group_gone(pgid: int) -> bool:
    """No live process in group `pgid` (zombies do not count: where pid 1 reaps nothing, orphans stay zombies)."""
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = Path(f"/proc/{d}/stat").read_bytes()
            except OSError:
                continue
            state, _, pgrp = stat[stat.rindex(b")") + 2:].split()[:3]
            if int(pgrp) == pgid and state not in (b"Z", b"X"):
                return False
    return True


class Launcher:
    """`v4 ARGS` as a process of its own (the real CLI, one job step running `entry`), its stderr in a file read as
    it grows."""

    def __init__(self, tmp_path: Path, name: str, args: list[str], entry: str):
        self.err_path = tmp_path / f"{name}.err"
        with open(self.err_path, "w") as err, open(tmp_path / f"{name}.out", "w") as out:
            self.proc = subprocess.Popen([PY, str(ONE_STEP), *args], cwd=ROOT, stdin=subprocess.DEVNULL, stdout=out,
                                         stderr=err, env={**os.environ, "V4_TEST_ENTRY": entry})

    @property
    def err(self) -> str:
        return self.err_path.read_text()

    def said(self, text: str) -> bool:
        return text in self.err

    def ended(self) -> bool:
        return self.proc.poll() is not None

    def wait(self, timeout: float = 120) -> int:
        return self.proc.wait(timeout=timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    @property
    def run_id(self) -> str:
        m = re.search(r"^run (\S+): ", self.err, re.M)
        assert m, self.err
        return m.group(1)

    def printed(self, label: str) -> list[str]:
        """The args of the `v4 ...` command it printed after `label`: to run it as it says."""
        line = next((ln.strip() for ln in self.err.splitlines() if ln.strip().startswith(label)), None)
        assert line, f"no {label!r} line in:\n{self.err}"
        words = shlex.split(line[len(label):].split("   (")[0])
        assert words[0] == "v4", line
        return words[1:]


def events(marks: Path) -> list[tuple[str, int]]:
    """(event, pid) of every holding_job, in order."""
    p = marks / "events"
    return [(w[0], int(w[1])) for w in (ln.split() for ln in p.read_text().splitlines())] if p.exists() else []


def count(marks: Path, what: str) -> int:
    return [w for w, _ in events(marks)].count(what)


def never_overlapped(marks: Path) -> bool:
    """No job started while another was alive, and none met the port taken (holding_job's events). A job with no
    end event counts as alive to the last: a false alarm, never a false pass."""
    alive: set[int] = set()
    for what, pid in events(marks):
        if what == "EADDRINUSE" or (what == "start" and alive):
            return False
        if what == "start":
            alive.add(pid)
        elif what in ("end", "end-term"):
            alive.discard(pid)
    return True


def holding_setup(tmp_path: Path, *sets: str) -> tuple[Path, str, list[str]]:
    """(the marks directory, the step's command, the `v4 run` args of a one-step run under tmp_path)."""
    marks = tmp_path / "marks"
    marks.mkdir()
    (marks / "hold").touch()
    entry = f"{PY} {HOLDING_JOB} {marks} {free_port()}"
    return marks, entry, ["run", "--preset", "smoke", "--hw", "cpu", "--set", f"V4_WORK={tmp_path}", *sets]


def step_status(tmp_path: Path, run_id: str, step: str = "weights") -> dict:
    return json.loads((tmp_path / "runs" / run_id / "steps" / step / "status.json").read_text())


def stop_leftovers(tmp_path: Path, *launchers: Launcher) -> None:
    """After a test, pass or fail: no launcher, and no local job it recorded, outlives it."""
    for la in launchers:
        la.kill()
    for st in (tmp_path / "runs").glob("*/steps/*/status.json"):
        pgid = json.loads(st.read_text()).get("pgid")
        if pgid and not group_gone(pgid):
            os.killpg(pgid, signal.SIGKILL)
