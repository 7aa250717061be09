"""The parent of a V4_EXECUTOR=local job: runs the step's command and records how it ended.

`pipeline.run_local` starts `python -I local_supervisor.py EXIT_JSON SUBMISSION_ID COMMAND` as the leader of the
job's own process group, its output going straight to the step's log file rather than through the launcher. So a
launcher that dies (SIGKILL, OOM, a second Ctrl-C while it was stopping the job) leaves a job that keeps running and
keeps logging, and a later `v4 run --resume` that cannot wait for it (only a parent can) reads how it ended from
EXIT_JSON. Standard library only, and nothing of the checkout is imported: it runs before the job does.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

# A stop signals the whole group: these are for the job. This process stays to record the job's end, and leaves
# with it (or with SIGKILL, after the stop's grace).
PASSED_ON = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)


def _default_signals() -> None:
    for sig in PASSED_ON:
        signal.signal(sig, signal.SIG_DFL)


def record(path: str, submission_id: str, code: int) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump({"submission_id": submission_id, "exit_code": code, "ended_at": time.time()}, f)
    os.replace(tmp, path)           # a reader sees the whole record or none


def main(argv: list[str]) -> int:
    exit_path, submission_id, command = argv
    for sig in PASSED_ON:
        signal.signal(sig, signal.SIG_IGN)
    try:
        # ignored signals survive exec: the job gets the default ones back (Python then installs its own SIGINT)
        child = subprocess.Popen(command, shell=True, preexec_fn=_default_signals)
    except OSError as e:
        print(f"v4: cannot start {command!r}: {e}", flush=True)
        record(exit_path, submission_id, 127)
        return 127
    code = child.wait()
    record(exit_path, submission_id, code)
    return code if code >= 0 else 128 - code          # killed by signal N: 128+N, as a shell says it


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
