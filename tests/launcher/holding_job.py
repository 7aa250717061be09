"""A stand-in for a training job, for the interrupt-and-resume tests: `holding_job.py MARKS PORT`.

It holds PORT as a trainer holds its rendezvous port (a second job beside it dies of EADDRINUSE, as in issue 42),
runs while MARKS/hold exists, and on SIGTERM "saves a checkpoint" until MARKS/saved exists, then exits 143. Each
event is a line `EVENT PID TIME` appended to MARKS/events, so a test can tell whether two jobs ever overlapped.
Every wait is bounded: a test that fails leaves no job behind for long."""
from __future__ import annotations

import os
import signal
import socket
import sys
import time
from pathlib import Path

marks, port = Path(sys.argv[1]), int(sys.argv[2])


def event(what: str) -> None:
    with open(marks / "events", "a") as f:          # O_APPEND: one short line is one write
        f.write(f"{what} {os.getpid()} {time.time()}\n")


def wait_while(pred, limit_s: float) -> None:
    deadline = time.monotonic() + limit_s
    while pred() and time.monotonic() < deadline:
        time.sleep(0.05)


def on_term(signum, frame):
    event("term")
    wait_while(lambda: not (marks / "saved").exists(), 60)
    event("end-term")
    sys.exit(143)


sock = socket.socket()
try:
    sock.bind(("127.0.0.1", port))
    sock.listen()
except OSError as e:
    event("EADDRINUSE")
    print(f"port {port}: {e}", flush=True)
    sys.exit(1)
signal.signal(signal.SIGTERM, on_term)
event("start")
print("started", flush=True)
wait_while(lambda: (marks / "hold").exists(), 120)
print("after the hold", flush=True)          # maybe after its launcher is gone: the log must still take it
event("end")
