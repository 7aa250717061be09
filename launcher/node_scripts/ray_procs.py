"""Record, inspect and stop the Ray processes the launcher started on this node.

Usage: python - record|status|stop|footprint LOCAL_DIR  (script on stdin; prints JSON)

Every process of a launcher-started Ray carries V4_RAY_SESSION=<token> in its environment (set
before `ray start`; Ray's daemons and workers inherit it). That token, not a process name, is
what makes a process ours: another user's Ray on the same host never carries it. The exception:
raylet's dashboard and runtime-env agents, whose /proc/PID/environ showed the token after some
starts and not after others (then about 11 variables); `stop` also takes everything below the
recorded daemons in the process tree, before it signals any.
"""
import json
import os
import signal
import sys
import time

RECORD = "ray_procs.json"
IDENTITY = "identity.json"


def proc_stat(pid):
    """(state, parent PID, start time in clock ticks since boot) from /proc/PID/stat; the start time
    guards against PID reuse."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return fields[0], int(fields[1]), int(fields[19])


def proc_start(pid):
    return proc_stat(pid)[2]


def proc_name(pid):
    """raylet, gcs_server, dashboard, ray::IDLE, ...: the role, from the binary or the script run."""
    try:
        argv = open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace").split("\0")
        comm = open(f"/proc/{pid}/comm").read().strip()
    except OSError:
        return "?"
    if comm in ("raylet", "gcs_server") or argv[0].startswith("ray::"):
        return comm if comm in ("raylet", "gcs_server") else argv[0].split()[0]
    args = argv[1:]
    for i, a in enumerate(args):
        if a == "-m" and i + 1 < len(args):
            return {"ray.util.client.server": "client_server"}.get(args[i + 1], args[i + 1])
        if a.endswith(".py"):
            return os.path.basename(a)[:-3]
        if a == "-c":
            return "python -c"
    return comm


def descendants(roots):
    """PIDs below `roots` in the process tree (children, their children, ...)."""
    children = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                ppid = proc_stat(d)[1]
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d))
    out, todo = set(), list(roots)
    while todo:
        for c in children.get(todo.pop(), ()):
            if c not in out:
                out.add(c)
                todo.append(c)
    out.discard(os.getpid())       # as in `marked`: never this script itself
    return out


def marked(token):
    """PIDs whose environment holds V4_RAY_SESSION=token."""
    needle = f"V4_RAY_SESSION={token}".encode()
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


def alive(p):
    """Still running: same start time (not a reused PID) and not a zombie nobody reaped."""
    try:
        state, _, start = proc_stat(p["pid"])
    except (OSError, IndexError, ValueError):
        return False
    return start == p["start"] and state != "Z"


def load(local_dir):
    try:
        with open(os.path.join(local_dir, RECORD)) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def record(local_dir):
    token = open(os.path.join(local_dir, "ray.session")).read().strip()
    procs = []
    for pid in marked(token):
        try:
            p = {"pid": pid, "start": proc_start(pid), "name": proc_name(pid)}
        except OSError:
            continue
        # Daemons only: task/actor workers (ray::IDLE, ray::f) come and go; `stop` finds them by token.
        if not p["name"].startswith("ray::") or p["name"].endswith("Agent"):
            procs.append(p)
    rec = {"session": token, "recorded_at": time.time(), "procs": procs}
    tmp = os.path.join(local_dir, RECORD + ".tmp")
    with open(tmp, "w") as f:
        json.dump(rec, f, indent=1)
    os.replace(tmp, os.path.join(local_dir, RECORD))
    return rec


def status(local_dir):
    rec = load(local_dir)
    if rec is None:
        return {"recorded": False, "procs": [], "unrecorded_alive": []}
    recorded = {p["pid"] for p in rec["procs"]}
    procs = [dict(p, alive=alive(p)) for p in rec["procs"]]
    return {"recorded": True, "session": rec["session"], "procs": procs,
            "unrecorded_alive": [p for p in marked(rec["session"]) if p not in recorded]}


def footprint(local_dir):
    """How many processes our Ray runs here (what `stop` would stop), and the memory they hold: their PSS, each
    shared page counted once among its sharers (the RSS sum counts Ray's shared libraries once a process: 2.5x as
    much for a local head), VmRSS where smaps_rollup cannot be read."""
    rec = load(local_dir)
    if rec is None:
        return {"recorded": False, "procs": 0, "mem_kb": 0}
    live = {p["pid"] for p in rec["procs"] if alive(p)}
    pids = {p for p in live | descendants(live) | set(marked(rec["session"])) if _up(p)}
    mem = 0
    for pid in pids:
        for path, field in ((f"/proc/{pid}/smaps_rollup", "Pss:"), (f"/proc/{pid}/status", "VmRSS:")):
            try:
                with open(path) as f:
                    mem += next(int(line.split()[1]) for line in f if line.startswith(field))
                break
            except (OSError, ValueError, IndexError, StopIteration):
                continue
    return {"recorded": True, "procs": len(pids), "mem_kb": mem}


# Signalled together, Ray's daemons wait on one another: raylet, gcs_server and monitor outlived a SIGTERM by more
# than 8 s, so every stop fell through to SIGKILL after the whole grace. One after another in this order, each exited on
# its SIGTERM within 0.7 s (Ray 2.60, local head: 0.83 s for all of it); whatever is left goes last.
STOP_ORDER = ("raylet", "monitor", "gcs_server")
# How long the SIGTERMs get before SIGKILL: the grace Ray's own stop command gives by default (--grace-period 16).
# It costs nothing when the daemons exit at once (the wait ends when they are gone); 5 s was too short on a loaded
# host, where a head's daemons, one after another, took longer and were killed.
STOP_GRACE_S = 16.0


def stop(local_dir, grace=STOP_GRACE_S):
    rec = load(local_dir)
    if rec is None:
        return {"recorded": False, "stopped": [], "killed": [], "remaining": []}
    token = rec["session"]
    # Recorded processes (start time checked), what they started (raylet's agents do not always show the
    # token: missed, they outlived the raylet by minutes), and anything else carrying our token (workers).
    live = {p["pid"] for p in rec["procs"] if alive(p)}
    targets = live | descendants(live) | set(marked(token))
    deadline = time.time() + grace
    for role in STOP_ORDER + ("",):
        group = {p for p in targets if _up(p) and (not role or proc_name(p) == role)}
        _signal(group, signal.SIGTERM)
        _wait(group, deadline)
    targets = {p for p in targets if _up(p)} | set(marked(token))
    killed = [{"pid": p, "name": proc_name(p)} for p in sorted(targets)]     # what SIGTERM did not stop
    if targets:
        _signal(targets, signal.SIGKILL)
        _wait(targets, time.time() + grace)
        targets = {p for p in targets if _up(p)} | set(marked(token))
    remaining = sorted(targets)
    if not remaining:
        os.replace(os.path.join(local_dir, RECORD), os.path.join(local_dir, RECORD + ".stopped"))
        # the stopped head's cluster id (ray_gcs.py): no later Ray on this port is that cluster
        try:
            os.unlink(os.path.join(local_dir, IDENTITY))
        except FileNotFoundError:
            pass
    return {"recorded": True, "stopped": sorted({p["pid"] for p in rec["procs"]}), "killed": killed,
            "remaining": remaining}


def _signal(pids, sig):
    for pid in sorted(pids):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _wait(pids, deadline):
    while time.time() < deadline and any(_up(p) for p in pids):
        time.sleep(0.05)


def _up(pid):
    return os.path.exists(f"/proc/{pid}") and _not_zombie(pid)


def _not_zombie(pid):
    try:
        return proc_stat(pid)[0] != "Z"
    except (OSError, IndexError, ValueError):
        return False


if __name__ == "__main__":
    action, local_dir = sys.argv[1], sys.argv[2]
    print(json.dumps({"record": record, "status": status, "stop": stop, "footprint": footprint}[action](local_dir)))
