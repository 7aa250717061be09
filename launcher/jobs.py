"""Submitting work to the cluster through the Ray Jobs API, waiting with a deadline, keeping logs.

The dashboard address comes from the config (http://V4_MASTER_IP:V4_DASHBOARD_PORT). The log is
followed while the job runs (progress lines) and written whole to the run directory at the end.
Interrupting the wait (Ctrl-C) does not stop the job, as with `ray job submit`; `v4 runs stop` does, and
`v4 run --resume` follows it again instead of starting a second one, or with `--restart-running` stops it and
waits for its end before the new one (pipeline.resume_action).
"""
from __future__ import annotations

import json
import shlex
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from launcher.cluster import dashboard_url, read_auth_token
from launcher.errors import ClusterError, JobError
from launcher.nodes import python_on_nodes

TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")
Progress = Callable[[str], None]


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclass
class Outcome:
    submission_id: str
    status: str                 # SUCCEEDED | FAILED | STOPPED | TIMEOUT | HUNG (launcher/watchdog.py) | NODE_LOST
    exit_code: int | None
    elapsed_s: float
    message: str
    log_path: str
    log_tail: str
    hang: dict | None = None    # HUNG: launcher.watchdog.Hang (the rank(s) behind, where the stacks are)
    lost: dict | None = None    # NODE_LOST: launcher.recovery.Lost (the nodes the GCS declared dead)

    @property
    def ok(self) -> bool:
        return self.status == "SUCCEEDED"

    def to_json(self) -> dict:
        # "job_status", not "status": this lands in a step's status.json next to the step's own status.
        d = asdict(self)
        d["job_status"] = d.pop("status")
        return {**d, "ok": self.ok}


# dashboards whose Ray this process has seen to be this checkout's (cluster.status: the holder of the ports and the
# cluster id recorded at `up`); checked once a process, before the first token or job leaves for it
_OURS: set[str] = set()


def _check_ours(cfg, url: str) -> None:
    if url in _OURS:
        return
    from launcher import cluster
    st = cluster.status(cfg, procs=False)
    if st.foreign:
        raise ClusterError(f"cluster {st.cluster}: {st.foreign}; v4 does not submit to it or send it this checkout's "
                           "token", fix=cluster._foreign_fix(cfg, st))
    if st.gcs_ok:
        _OURS.add(url)


def client(cfg):
    """A JobSubmissionClient for the cluster's dashboard (ClusterError if nothing answers, or if what answers is not
    the Ray this checkout started)."""
    from ray.job_submission import JobSubmissionClient
    url = dashboard_url(cfg)
    _check_ours(cfg, url)
    # the token goes in this client's header, not the process environment: Ray caches a token per process, and one
    # process may talk to several clusters (each with its own)
    token = read_auth_token(cfg)
    try:
        return JobSubmissionClient(url, headers={"Authorization": f"Bearer {token}"} if token else None)
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise ClusterError(f"the Ray Jobs API at {url} does not answer: {e}",
                           fix="`v4 cluster up` (or `v4 cluster status` to see what is wrong)") from None


def _info(c, submission_id: str):
    try:
        return c.get_job_info(submission_id)
    except RuntimeError as e:          # 404: no such job
        if "does not exist" in str(e) or "404" in str(e):
            return None
        raise


def submit(cfg, job, c=None, progress: Progress = _stderr) -> str:
    """Submit `job` (a plan.JobSpec); a job already running under its id is attached to, not resubmitted."""
    c = c or client(cfg)
    sid = job.submission_id
    for attempt in range(1, 100):
        info = _info(c, sid)
        if info is None:
            break
        if info.status.value in ("PENDING", "RUNNING", "SUCCEEDED"):
            progress(f"job {sid}: already {info.status.value}; following it")
            return sid
        sid = f"{job.submission_id}-r{attempt}"          # Ray never reuses a submission id
    c.submit_job(entrypoint=job.entrypoint, submission_id=sid, runtime_env=job.runtime_env,
                 entrypoint_num_cpus=job.entrypoint_num_cpus, entrypoint_num_gpus=job.entrypoint_num_gpus,
                 entrypoint_resources=getattr(job, "entrypoint_resources", None) or None, metadata={"v4": "1"})
    progress(f"job {sid}: submitted to {dashboard_url(cfg)}")
    return sid


def follow_logs(c, sid: str, sink: Callable[[str], None], stop: threading.Event | None = None,
                poll: float = 1.0) -> None:
    """Pass each new piece of job `sid`'s log to `sink` until the job ends (or `stop` is set).

    Polls the whole log and emits the unseen suffix: unlike Ray's log websocket, which closes at
    once while a job is still PENDING, this cannot miss or repeat output."""
    seen = 0
    while True:
        done = c.get_job_info(sid).status.value in TERMINAL
        text = c.get_job_logs(sid)
        if len(text) > seen:
            sink(text[seen:])
            seen = len(text)
        if done or (stop is not None and stop.is_set()):
            return
        time.sleep(poll)


def _follow_quietly(c, sid, sink, stop) -> None:
    try:
        follow_logs(c, sid, sink, stop)
    except Exception:   # noqa: BLE001 - live output is a convenience; wait() fetches the full log
        pass


def wait(cfg, sid: str, timeout_s: float, log_path: Path | str | None = None, c=None,
         progress: Progress = _stderr, echo: bool = True, run_dir: Path | str | None = None,
         watch=None) -> Outcome:
    """Follow job `sid` until it ends or `timeout_s` passes (then it is stopped: TIMEOUT). With `run_dir`, the hang
    watchdog (launcher/watchdog.py) reads its ranks' heartbeats meanwhile: a hang is stopped too (HUNG, exit 124).
    With `watch` (launcher.recovery.NodeWatch), a node the GCS declares dead stops it (NODE_LOST, the nodes named).
    A head that stops answering -- the Jobs API, or the watch's query -- for V4_NODE_DEAD_TIMEOUT raises
    recovery.HeadLost (exit 5), which names it, instead of the HTTP library's traceback."""
    from launcher import watchdog
    from launcher.recovery import HeadLost
    c = c or client(cfg)
    dog = watchdog.for_job(cfg, run_dir, progress)
    hang = lost = None
    t0 = time.monotonic()
    stop = threading.Event()
    pending = [""]
    grace = float(cfg.get("V4_NODE_DEAD_TIMEOUT") or 30)
    failing_since = None

    def sink(chunk: str) -> None:
        if echo:
            text = pending[0] + chunk
            *lines, pending[0] = text.split("\n")
            for line in lines:
                progress(f"  | {line}")

    streamer = threading.Thread(target=_follow_quietly, args=(c, sid, sink, stop), daemon=True)
    streamer.start()
    status, timed_out, info = "PENDING", False, None
    try:
        while True:
            if watch is not None and (lost := watch.poll()) is not None:
                progress(f"job {sid}: {lost.message}; stopping it (its ranks elsewhere would wait for the lost ones)")
            elif watch is not None and not watch.answering:
                time.sleep(1.0)      # the Jobs API would block for a minute on a head whose GCS is gone
                continue
            else:
                try:
                    # bounded: with the head's GCS gone, the dashboard takes a minute to answer 500
                    info = _bounded(lambda: c.get_job_info(sid), JOB_INFO_TIMEOUT_S)
                    failing_since = None
                except (OSError, RuntimeError) as e:     # requests' errors are OSErrors; HTTP 5xx a RuntimeError
                    now = time.monotonic()
                    failing_since = failing_since or now
                    if now - failing_since >= grace:
                        raise HeadLost(f"the Ray Jobs API at {dashboard_url(cfg)} has not answered about job {sid} "
                                       f"for {now - failing_since:.0f} s (V4_NODE_DEAD_TIMEOUT={grace:g}): "
                                       f"{type(e).__name__}: {str(e)[:200]}; the head's GCS or dashboard is gone, "
                                       "and the job with them",
                                       fix="`v4 cluster status` shows what is left; `v4 cluster up` starts the head "
                                           "again; then resume the run") from None
                    time.sleep(1.0)
                    continue
                status = info.status.value
                if status in TERMINAL:
                    break
                if dog is not None and (hang := dog.poll()) is not None:
                    progress(f"job {sid}: hung; stopping it")
            if lost is not None or hang is not None or time.monotonic() - t0 > timeout_s:
                timed_out = hang is None and lost is None
                if timed_out:
                    progress(f"job {sid}: still {status} after {timeout_s:g} s; stopping it")
                info = _stop_and_wait(c, sid) or info
                break
            time.sleep(1.0)
    finally:
        stop.set()
    streamer.join(timeout=5)
    try:
        logs = c.get_job_logs(sid)
    except (OSError, RuntimeError) as e:
        logs = f"(the job's log could not be read: {type(e).__name__}: {str(e)[:200]})\n"
    if log_path is not None:
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        Path(log_path).write_text(logs)
    code = getattr(info, "driver_exit_code", None)
    st = "NODE_LOST" if lost else "HUNG" if hang else "TIMEOUT" if timed_out else info.status.value
    msg = lost.message if lost else hang.message if hang else (info.message or "")
    return Outcome(submission_id=sid, status=st, exit_code=124 if timed_out or hang else None if lost else code,
                   elapsed_s=round(time.monotonic() - t0, 2), message=msg, log_path=str(log_path or ""),
                   log_tail="\n".join(logs.splitlines()[-40:]), hang=hang.model_dump() if hang else None,
                   lost=lost.to_json() if lost else None)


JOB_INFO_TIMEOUT_S = 10.0    # one question to the Jobs API while a job runs


def _bounded(fn, timeout_s: float):
    """`fn()`, or TimeoutError (an OSError, as the HTTP library's own) when it has not returned within `timeout_s`;
    it then goes on in a daemon thread, which a launcher that exits does not wait for."""
    box: dict = {}

    def call() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:   # noqa: BLE001 - handed to the caller
            box["error"] = e

    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        raise TimeoutError(f"no answer within {timeout_s:g} s")
    if "error" in box:
        raise box["error"]
    return box["value"]


def _stop_and_wait(c, sid: str, wait_s: int = 30):
    """Ask Ray to stop job `sid` and wait (up to `wait_s`) until it is over; its last info (None if none came)."""
    info = None
    try:
        c.stop_job(sid)
        for _ in range(wait_s):
            info = c.get_job_info(sid)
            if info.status.value in TERMINAL:
                break
            time.sleep(1)
    except (OSError, RuntimeError):
        pass
    return info


def submit_and_wait(cfg, job, log_path: Path | str | None = None, progress: Progress = _stderr,
                    watch=None) -> Outcome:
    from launcher import watchdog
    c = client(cfg)
    run_dir = job.runtime_env.get("env_vars", {}).get("V4_RUN_DIR")
    watchdog.clear(run_dir)           # before the job starts: an earlier job's heartbeats are not this one's
    sid = submit(cfg, job, c, progress)
    return wait(cfg, sid, job.timeout_s, log_path, c, progress, run_dir=run_dir, watch=watch)


def job_status(cfg, sid: str, c=None) -> str | None:
    """Ray's status of job `sid` (PENDING | RUNNING | SUCCEEDED | FAILED | STOPPED), None if Ray does not know it.
    A resumed step asks this about its earlier job before starting another (pipeline.resume_action)."""
    info = _info(c or client(cfg), sid)
    return None if info is None else info.status.value


def stop(cfg, sid: str) -> bool:
    """Ask Ray to stop a job; False when it had already ended (or is unknown)."""
    c = client(cfg)
    info = _info(c, sid)
    if info is None or info.status.value in TERMINAL:
        return False
    return bool(c.stop_job(sid))


# --- the built-in probe job ---------------------------------------------------------------------

def probe(cfg, run=None, progress: Progress = _stderr, timeout_s: float = 300) -> tuple[Outcome, list[dict]]:
    """Run launcher/probe_job.py on the cluster: one task per node. Returns the outcome and the
    nodes it saw; recorded as the step `probe` of `run` when given."""
    from launcher.plan import JobSpec
    work = Path(tempfile.mkdtemp(prefix="v4-probe-"))
    try:
        shutil.copy(Path(__file__).with_name("probe_job.py"), work / "probe_job.py")
        sid = f"{run.id}-probe" if run is not None else f"probe-{time.strftime('%Y%m%d-%H%M%S')}"
        job = JobSpec(submission_id=sid,
                      entrypoint=f"{shlex.quote(python_on_nodes(cfg))} probe_job.py --expect {len(cfg.nodes)}",
                      runtime_env={"working_dir": str(work)}, entrypoint_num_cpus=0, entrypoint_num_gpus=0,
                      timeout_s=timeout_s, submit="")
        log = run.step_log("probe") if run is not None else None
        if run is not None:
            run.set_step("probe", "running", submission_id=sid)
        outcome = submit_and_wait(cfg, job, log_path=log, progress=progress)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    seen = []
    for line in outcome.log_tail.splitlines():
        if line.startswith("V4_PROBE "):
            seen = json.loads(line[len("V4_PROBE "):])["nodes"]
    if run is not None:
        run.set_step("probe", "done" if outcome.ok else "failed", **outcome.to_json(), nodes=seen)
        run.finish("passed" if outcome.ok else "failed", error=None if outcome.ok else outcome.message,
                   code=0 if outcome.ok else 1)
    if not outcome.ok:
        raise JobError(f"probe job {outcome.submission_id} {outcome.status}: {outcome.message}\n{outcome.log_tail}",
                       fix="`v4 cluster status`, then the log above")
    return outcome, seen
