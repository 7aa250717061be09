"""Record, inspect and stop the SGLang rollout server the launcher started on this node.

Usage: python rollout_procs.py running|record|status|stop STATE_DIR [ARGS]  (prints JSON; `running` sets the exit
code). The start script (templates/sglang_server.sh.j2) writes this file into STATE_DIR and runs it there.

What makes a process ours is the V4_ROLLOUT_SESSION=<token> the start script exports before it starts the server:
the server's schedulers, detokenizer and data-parallel controller inherit it, another user's SGLang on the same host
never carries it. The record (sglang_procs.json) holds the session, the server's PID with its start time (a reused
PID is not ours) and the spec (a digest of the command line and environment) it was started with.

Standalone on purpose (it runs on the nodes, with the node's python, and imports nothing of the launcher), so the
/proc helpers repeat those of ray_procs.py.
"""
import json
import os
import signal
import sys
import time

RECORD = "sglang_procs.json"
SESSION_VAR = "V4_ROLLOUT_SESSION"


def proc_stat(pid):
    """(state, parent PID, start time in clock ticks since boot) from /proc/PID/stat."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return fields[0], int(fields[1]), int(fields[19])


def running_pid(pid, start):
    """The process `pid` still runs, is the one that started at `start`, and is no zombie."""
    try:
        state, _, started = proc_stat(pid)
    except (OSError, IndexError, ValueError):
        return False
    return started == start and state != "Z"


def marked(token):
    """PIDs whose environment holds V4_ROLLOUT_SESSION=token (never this script's own)."""
    needle = f"{SESSION_VAR}={token}".encode()
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit() and int(d) != os.getpid():
            try:
                env = open(f"/proc/{d}/environ", "rb").read().split(b"\0")
            except OSError:
                continue
            if needle in env:
                out.append(int(d))
    return sorted(out)


def descendants(root):
    """PIDs below `root` in the process tree: SGLang's subprocesses keep the session variable, but a child that
    cleared its environment would escape `marked`."""
    children = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                children.setdefault(proc_stat(d)[1], []).append(int(d))
            except (OSError, IndexError, ValueError):
                continue
    out, todo = set(), [root]
    while todo:
        for c in children.get(todo.pop(), ()):
            if c not in out:
                out.add(c)
                todo.append(c)
    out.discard(os.getpid())
    return out


def load(state_dir):
    try:
        with open(os.path.join(state_dir, RECORD)) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def record(state_dir, pid, session, spec):
    pid = int(pid)
    rec = {"session": session, "pid": pid, "start": proc_stat(pid)[2], "spec": spec, "recorded_at": time.time()}
    tmp = os.path.join(state_dir, RECORD + ".tmp")
    with open(tmp, "w") as f:
        json.dump(rec, f, indent=1)
    os.replace(tmp, os.path.join(state_dir, RECORD))
    return rec


def status(state_dir):
    rec = load(state_dir)
    if rec is None:
        return {"recorded": False, "alive": False}
    return {"recorded": True, "pid": rec["pid"], "session": rec["session"], "spec": rec.get("spec", ""),
            "alive": running_pid(rec["pid"], rec["start"]), "tagged": marked(rec["session"])}


def running(state_dir, spec):
    """Exit 0 when the recorded server runs and was started with `spec` (then `up` keeps it), else 1."""
    st = status(state_dir)
    return st, 0 if st["alive"] and st["spec"] == spec else 1


def stop(state_dir, grace=20.0):
    """SIGTERM to the server and everything of its session (SGLang's own handler then ends its subprocesses),
    SIGKILL to what is left after `grace` seconds."""
    rec = load(state_dir)
    if rec is None:
        return {"recorded": False, "stopped": [], "killed": [], "remaining": []}
    token = rec["session"]
    alive = running_pid(rec["pid"], rec["start"])
    targets = set(marked(token)) | (({rec["pid"]} | descendants(rec["pid"])) if alive else set())
    stopped = sorted(targets)
    _signal(targets, signal.SIGTERM)
    _wait(targets, time.time() + grace)
    targets = {p for p in targets if _up(p)} | set(marked(token))
    killed = sorted(targets)
    if targets:
        _signal(targets, signal.SIGKILL)
        _wait(targets, time.time() + 5)
        targets = {p for p in targets if _up(p)} | set(marked(token))
    remaining = sorted(targets)
    if not remaining:
        # kept for the record (what ran, until when), no longer a process to stop
        os.replace(os.path.join(state_dir, RECORD), os.path.join(state_dir, RECORD + ".stopped"))
    return {"recorded": True, "pid": rec["pid"], "stopped": stopped, "killed": killed, "remaining": remaining}


def _signal(pids, sig):
    for pid in sorted(pids):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _up(pid):
    try:
        return proc_stat(pid)[0] != "Z"
    except (OSError, IndexError, ValueError):
        return False


def _wait(pids, deadline):
    while time.time() < deadline and any(_up(p) for p in pids):
        time.sleep(0.1)


if __name__ == "__main__":
    action, state_dir, rest = sys.argv[1], sys.argv[2], sys.argv[3:]
    if action == "running":
        out, rc = running(state_dir, rest[0])
        print(json.dumps(out))
        sys.exit(rc)
    if action == "record":
        print(json.dumps(record(state_dir, *rest)))
    elif action == "status":
        print(json.dumps(status(state_dir)))
    elif action == "stop":
        print(json.dumps(stop(state_dir)))
    else:
        sys.exit(f"unknown action {action!r}: running | record | status | stop")
