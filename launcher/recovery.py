"""Runs that survive (docs/resilience.md): bad nodes left out before a run, lost nodes and hung steps restarted
without a person.

A run calls in here at three points:
  - preflight, with `v4 run --exclude-bad-nodes`: `Recovery.leave_out` turns the nodes that fail a check (never the
    head) into a smaller cluster -- standbys (V4_STANDBY_IPS) that pass preflight take their places -- and `derive`
    re-resolves the configuration for it: the layout for the smaller world, or a refusal naming what no longer
    divides (or the floor V4_MIN_NODES);
  - the wait for a Ray job (`launcher.jobs.wait`): a `NodeWatch` reads the GCS's node table every NODE_POLL_S seconds
    through the dashboard (where the Jobs API is reached, with the same token). A node of the run that the GCS
    declares DEAD ends the wait at once, named; the job is stopped (its ranks elsewhere would wait for the dead ones).
    A head that stops answering for V4_NODE_DEAD_TIMEOUT ends it with `HeadLost`: not a restart -- the GCS, the
    dashboard and the jobs are gone with it -- but an error that prints the resume command;
  - a job step that did not succeed: `Recovery.restart` asks what ended it -- the watch's verdict, the watchdog's
    (HUNG), or for a job that failed on its own, `cluster.status` finding a node unreachable, DEAD or its raylet gone
    -- and, for a lost node or a hang, within PRESET_MAX_RESTARTS restarts over the run's life (`spent`: every
    restart its directory records, across `--resume`, the RL job's rollout-engine restarts among them), leaves the
    lost nodes out (a standby in their place), starts the standby's Ray, rewrites config.json and plan.json, records
    the restart, and hands back the step to run again: from its last complete checkpoint (dsv4/megatron/train.py;
    the metrics rows past it are superseded, jobs/common.py). A job that fails with every node healthy is not
    restarted: the same code on the same data fails the same way.
What a run left out and why, its standbys and its restarts are recorded in run.json ("recovery"; `v4 runs show`),
and the nodes left out also in V4_WORK/.v4-quarantine/<cluster>.json, which `v4 cluster status` shows and a later
preflight that passes on the node clears. A rollout engine the RL job restarted by itself (dsv4/rl/restart.py) is a
line of RUN/steps/train/rollout_restarts.jsonl, written by the job as it happens: `engine_restarts` reads them back
beside run.json's. A `--resume` applies the run's own record again: its world stays what it was when it stopped,
and its restarts stay spent.
"""
from __future__ import annotations

import copy
import json
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Literal

from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError

from dsv4.fileio import atomic_write
from launcher.errors import ClusterError, JobError, PreflightError, V4Error

Progress = Callable[[str], None]
NODE_POLL_S = 2.0            # how often a NodeWatch reads the GCS's node table (one ~15 ms HTTP request)
NODE_QUERY_TIMEOUT_S = 5.0   # one such request
QUARANTINE_DIR = ".v4-quarantine"   # under V4_WORK: the nodes runs left out, per cluster
LATEST = "latest_checkpointed_iteration.txt"   # dsv4/megatron/train.py's pointer (the one authority on a checkpoint)


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------------ the records
class LeftOut(BaseModel):
    """A node a run does without: failed preflight (`by` preflight) or was lost during a step (`by` lost)."""
    model_config = ConfigDict(extra="forbid")
    ip: str
    why: str                          # one line a person reads
    by: Literal["preflight", "lost"]
    at: float
    run: str
    checks: list[str] = []            # preflight: the checks it failed
    step: str = ""                    # lost: the step it was lost in
    replaced_by: str = ""             # the standby that took its place


class Restart(BaseModel):
    """One restart of a step: what ended the job, what was lost, what ran next."""
    model_config = ConfigDict(extra="forbid")
    n: int                            # 1, 2, ... over the run's life (resumes go on counting)
    step: str
    cause: Literal["node_lost", "hung"]
    detail: str
    nodes: list[str] = []             # node_lost: the nodes lost
    at: float                         # when the launcher noticed
    job: str                          # the job that ended
    job_elapsed_s: float
    noticed_after_s: float | None = None   # node_lost: since the GCS declared it dead; hung: since the last heartbeat
    from_step: int                    # the checkpoint the next job resumes from (0: the step's start)
    last_step: int                    # the last step the ended job logged
    steps_lost: int                   # last_step - from_step: steps trained twice
    world_before: int
    world_after: int
    nodes_after: list[str]
    standby: list[str] = []           # standbys brought in for it
    next_job: str = ""
    restart_s: float = 0.0            # from noticing to the next job's submission
    stacks: str = ""                  # hung: where the first attempt's stacks were kept


class RunRecovery(BaseModel):
    """run.json's "recovery"."""
    model_config = ConfigDict(extra="forbid")
    left_out: list[LeftOut] = []
    standby_in: list[str] = []
    restarts: list[Restart] = []


class EngineRestart(BaseModel):
    """A rollout engine that an RL job restarted (one line of RUN/steps/<step>/rollout_restarts.jsonl, written by
    dsv4/rl/restart.py): the job noticed and recovered it, so it is in the job's record, not in run.json's."""
    model_config = ConfigDict(extra="ignore")
    step: int                         # the training step it was lost in
    phase: str                        # rollout | sync
    cause: str
    seconds: float                    # from the loss to a healthy engine with the current weights
    restart: int                      # its job's first is 1
    at: float
    samples: int = 0                  # samples rolled out again (the step's batch after a loss in its rollout)
    attempt: int = 0                  # which of the step's jobs (V4_STEP_ATTEMPT)
    in_step: str = ""                 # the pipeline step (the file's directory), set when read
    job: str = ""                     # that job's id, from the step's status, where known


ENGINE_RESTARTS = "rollout_restarts.jsonl"


def engine_restarts(run) -> list[EngineRestart]:
    """The rollout engines the run's jobs restarted, oldest first. A line that does not parse (a job killed while it
    wrote) is skipped: the job's metrics row of that step counts it too."""
    out = []
    for path in sorted((run.dir / "steps").glob(f"*/{ENGINE_RESTARTS}")):
        ids = run.step_status(path.parent.name).get("submission_ids") or []
        try:
            lines = path.read_text().splitlines()
        except (OSError, UnicodeDecodeError):
            continue
        for line in lines:
            try:
                e = EngineRestart.model_validate_json(line)
            except ValidationError:
                continue
            e.in_step, e.job = path.parent.name, ids[e.attempt] if 0 <= e.attempt < len(ids) else ""
            out.append(e)
    return sorted(out, key=lambda e: e.at)


def spent(run) -> int:
    """The restarts the run has recorded, of every kind and over all its launches: what PRESET_MAX_RESTARTS bounds."""
    return len(run_record(run).restarts) + len(engine_restarts(run))


class Quarantine(BaseModel):
    """V4_WORK/.v4-quarantine/<cluster>.json: the nodes of a cluster that runs left out, by address."""
    model_config = ConfigDict(extra="forbid")
    nodes: dict[str, LeftOut] = {}


def run_record(run) -> RunRecovery:
    """The run's recovery record (empty for a run that never left a node out nor restarted)."""
    try:
        return RunRecovery.model_validate(run.info().get("recovery") or {})
    except ValidationError as e:
        raise JobError(f"{run.dir / 'run.json'}: its \"recovery\" record is not one this launcher wrote: "
                       f"{e.errors()[0]['msg']} at {'.'.join(map(str, e.errors()[0]['loc']))}",
                       fix="restore the file, or start a new run") from None


def _save_record(run, rec: RunRecovery) -> None:
    run.update(recovery=rec.model_dump())


def quarantine_path(cfg) -> Path:
    return Path(str(cfg["V4_WORK"])) / QUARANTINE_DIR / f"{cfg['V4_CLUSTER_NAME']}.json"


def quarantined(cfg) -> dict[str, LeftOut]:
    """The cluster's nodes that runs left out, and why (a record that does not parse counts as none)."""
    try:
        return Quarantine.model_validate_json(quarantine_path(cfg).read_bytes()).nodes
    except (OSError, ValueError):
        return {}


def quarantine(cfg, entries: list[LeftOut]) -> None:
    """Add `entries` to the cluster's record of the nodes left out (`v4 cluster status` shows it)."""
    q = quarantined(cfg)
    q.update({e.ip: e for e in entries})
    atomic_write(quarantine_path(cfg), Quarantine(nodes=q).model_dump_json(indent=2))


def readmit(cfg, ips, progress: Progress = _stderr) -> None:
    """Take nodes a preflight passed on out of the cluster's quarantine record."""
    q = quarantined(cfg)
    back = [ip for ip in ips if ip in q]
    if not back:
        return
    for ip in back:
        progress(f"[preflight] {ip} passes again: no longer left out (run {q[ip].run} left it out: {q[ip].why})")
        del q[ip]
    atomic_write(quarantine_path(cfg), Quarantine(nodes=q).model_dump_json(indent=2))


# ------------------------------------------------------------------------------------------------ the smaller world
class Refused(Exception):
    """The run cannot go on without these nodes; `message` says why (the floor, or what no longer divides)."""

    def __init__(self, message: str, fix: str = ""):
        super().__init__(message)
        self.message, self.fix = message, fix


def derive(base, left_out: list[str], standby_in: list[str], where: str):
    """`base` (the configuration as resolved from its files) for the cluster without `left_out`, `standby_in` added
    as workers: re-resolved, so the world, DP and every cross-check follow. The new values cite `where`."""
    from launcher.config.checks import InvalidConfig
    from launcher.config.resolve import Overlay, resolve

    if not left_out and not standby_in:
        return base
    head = base.nodes[0]
    if head in left_out:
        raise Refused(f"the head {head} cannot be left out: it runs the Ray GCS, the dashboard and the rendezvous",
                      fix="fix the head (the checks above say what), or make another node the head (V4_MASTER_IP)")
    workers = [n for n in base.nodes[1:] if n not in left_out] + [s for s in standby_in if s not in base.nodes]
    standby = [s for s in base["V4_STANDBY_IPS"] if s not in standby_in and s not in left_out]
    n = 1 + len(workers)
    floor = int(base["V4_MIN_NODES"])
    gone = ", ".join(left_out) or "none"
    if floor and n < floor:
        raise Refused(f"{n} node(s) would be left ({gone} left out), fewer than V4_MIN_NODES={floor} "
                      f"({base.origin('V4_MIN_NODES').where})",
                      fix="bring the nodes back (the reasons above), add standbys (V4_STANDBY_IPS), or lower "
                          "V4_MIN_NODES")
    overlay = Overlay(where, (("V4_WORKER_IPS", " ".join(workers)), ("V4_NUM_NODES", str(n)),
                              ("V4_STANDBY_IPS", " ".join(standby))))
    try:
        return resolve(base.selection, overlay)
    except InvalidConfig as e:
        raise Refused(f"with {gone} left out the run does not fit the {n} node(s) left: " + "; ".join(e.errors),
                      fix="a layout that divides the smaller world (PRESET_TP/PP/CP/EP, PRESET_GLOBAL_BATCH_SIZE, "
                          "PRESET_NUM_NODES), standbys (V4_STANDBY_IPS), or the nodes back") from None


def world(cfg) -> int:
    return int(cfg.get("WORLD_SIZE") or 0)


# ------------------------------------------------------------------------------------------------ watching the GCS
class HeadLost(ClusterError):
    """The head stopped answering during a job: its GCS or dashboard, and with them the job, are gone."""


class _GcsNode(BaseModel):
    """What a NodeWatch reads of one entry of the dashboard's /api/v0/nodes (Ray's state API)."""
    model_config = ConfigDict(extra="ignore")
    node_id: str
    node_ip: str
    state: str
    state_message: str | None = None
    end_time_ms: int | None = None


_NODES = TypeAdapter(list[_GcsNode])


QUERY_ERRORS = (OSError, ValueError, KeyError, TypeError, ValidationError)   # requests' errors are OSErrors


def gcs_nodes(url: str, headers: dict) -> list[_GcsNode]:
    """The GCS's node table, from the dashboard's state API at `url` (.../api/v0/nodes); QUERY_ERRORS when it does not
    answer with one."""
    import requests
    r = requests.get(url, params={"detail": "1", "limit": "10000"}, headers=headers, timeout=NODE_QUERY_TIMEOUT_S)
    r.raise_for_status()
    return _NODES.validate_python(r.json()["data"]["result"]["result"])


@dataclass
class Lost:
    """Nodes of the run that are gone, as noticed: the GCS's verdict, or cluster status after a job failed."""
    nodes: list[str]
    why: dict[str, str]                   # ip -> what was seen
    how: str                              # "gcs" | "status" | "head"
    noticed_at: float = field(default_factory=time.time)
    after_s: float | None = None          # since the GCS declared the first of them dead

    @property
    def message(self) -> str:
        return "; ".join(f"node {ip} lost: {self.why[ip]}" for ip in self.nodes)

    def to_json(self) -> dict:
        return {"nodes": self.nodes, "why": self.why, "how": self.how, "noticed_at": self.noticed_at,
                "after_s": self.after_s, "message": self.message}


class NodeWatch:
    """Reads the GCS's node table through the dashboard (the way the Jobs API is reached) at most every `poll_s`.
    `poll()`: None while every node of the run is ALIVE; a `Lost` once one is DEAD or gone from the table; raises
    HeadLost once the head has not answered for `head_grace_s` (V4_NODE_DEAD_TIMEOUT)."""

    def __init__(self, cfg, token: str = "", poll_s: float = NODE_POLL_S, clock: Callable[[], float] = time.monotonic):
        from launcher.cluster import dashboard_url
        self.url = dashboard_url(cfg) + "/api/v0/nodes"
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.nodes, self.head = list(cfg.nodes), cfg.nodes[0]
        self.head_grace_s = float(cfg["V4_NODE_DEAD_TIMEOUT"])
        self.poll_s, self.clock = poll_s, clock
        self.lost: Lost | None = None
        self.error = ""                        # the last failed query's error ("": it answered)
        self.failing_since: float | None = None
        self._read_at = -1e18

    @property
    def answering(self) -> bool:
        """False while the head's dashboard does not answer (then asking the Jobs API would block a minute)."""
        return self.failing_since is None

    def poll(self) -> Lost | None:
        if self.lost is not None:
            return self.lost
        now = self.clock()
        if now - self._read_at < self.poll_s:
            return None
        self._read_at = now
        try:
            table = gcs_nodes(self.url, self.headers)
        except QUERY_ERRORS as e:
            self.error = f"{type(e).__name__}: {str(e)[:200]}"
            if self.failing_since is None:
                self.failing_since = now
            if now - self.failing_since >= self.head_grace_s:
                raise HeadLost(f"the head {self.head} has not answered for {now - self.failing_since:.0f} s "
                               f"(V4_NODE_DEAD_TIMEOUT={self.head_grace_s:g}): {self.url}: {self.error}; its Ray GCS "
                               "or dashboard is gone, and the running job with them",
                               fix="`v4 cluster status` shows what is left; `v4 cluster up` starts the head again "
                                   "(and the workers); then resume the run") from None
            return None
        self.failing_since, self.error = None, ""
        self.lost = judge_table(self.nodes, table)
        return self.lost


def judge_table(nodes: list[str], table: list[_GcsNode]) -> Lost | None:
    """The nodes of `nodes` that the GCS's node table does not hold ALIVE, with what it says of them."""
    alive = {n.node_ip for n in table if n.state == "ALIVE"}
    dead: dict[str, _GcsNode] = {}
    for n in table:                  # an address may have died before (then came back): its latest death is this one
        if n.state != "ALIVE" and (n.node_ip not in dead or (n.end_time_ms or 0) > (dead[n.node_ip].end_time_ms or 0)):
            dead[n.node_ip] = n
    gone = [ip for ip in nodes if ip not in alive]
    if not gone:
        return None
    why, since = {}, []
    for ip in gone:
        n = dead.get(ip)
        if n is None:
            why[ip] = "not in the Ray GCS's node table"
            continue
        msg = (n.state_message or "").strip().splitlines()
        why[ip] = f"{n.state} in the Ray GCS" + (f" ({msg[0][:200]})" if msg else "")
        if n.end_time_ms:
            since.append(time.time() - n.end_time_ms / 1000)
    return Lost(gone, why, "gcs", after_s=round(max(since), 1) if since else None)


def node_watch(cfg) -> NodeWatch | None:
    """The watch for a Ray job of this configuration (None under the local executor: one machine, nothing to lose)."""
    if cfg["V4_EXECUTOR"] != "ray":
        return None
    from launcher.cluster import read_auth_token
    return NodeWatch(cfg, read_auth_token(cfg))


def lost_after_failure(cfg) -> Lost | None:
    """For a Ray job that failed by itself: the nodes the GCS no longer holds ALIVE, else (a killed host's survivors
    fail on a reset connection before the GCS has decided) those `cluster status` finds unreachable or with their
    raylet gone."""
    from launcher import cluster
    try:
        headers = {"Authorization": f"Bearer {t}"} if (t := cluster.read_auth_token(cfg)) else {}
        lost = judge_table(cfg.nodes, gcs_nodes(cluster.dashboard_url(cfg) + "/api/v0/nodes", headers))
        if lost is not None:
            return lost
    except (*QUERY_ERRORS, V4Error):
        pass                                   # the head does not answer: cluster status says how
    st = cluster.status(cfg)
    why = {}
    for ns in st.nodes:
        raylet = ns.proc("raylet")
        if not ns.reachable:
            why[ns.ip] = f"unreachable: {ns.error[:200]}"
        elif st.gcs_ok and ns.gcs_state != "ALIVE":
            why[ns.ip] = f"{'DEAD' if ns.gcs_state == 'DEAD' else 'not registered'} in the Ray GCS"
        elif raylet is not None and not raylet["alive"]:
            why[ns.ip] = f"its raylet (pid {raylet['pid']}, started by v4) is gone"
    if not st.gcs_ok and cfg.nodes[0] not in why:
        why[cfg.nodes[0]] = f"the Ray GCS does not answer: {st.gcs_error[:200]}"
    if not why:
        return None
    return Lost([ip for ip in cfg.nodes if ip in why], why, "status")


# ------------------------------------------------------------------------------------------------ checkpoints, metrics
def checkpoint_step(run_dir: Path, cfg) -> int:
    """The step the next job of the train step resumes from: what the `latest` pointer names, when its directory is
    there (dsv4.megatron.train.latest_checkpoint), counted in steps (an RL step is PRESET_RL_MINIBATCHES updates)."""
    ckpt = Path(run_dir) / "checkpoints"
    try:
        it = int((ckpt / LATEST).read_text().strip())
    except (OSError, ValueError):
        return 0
    if not (ckpt / f"iter_{it:07d}").is_dir():
        return 0
    per = max(1, int(cfg.get("PRESET_RL_MINIBATCHES") or 1)) if cfg.get("PRESET_MODE") == "rl" else 1
    return it // per


def last_logged_step(run_dir: Path) -> int:
    from launcher import metrics
    steps = metrics.read(Path(run_dir)).steps
    return steps[-1] if steps else 0


# ------------------------------------------------------------------------------------------------ the run's side
@dataclass
class Again:
    """What a restart hands back: the configuration and step to run next."""
    cfg: object
    step: object
    restart: Restart


class Recovery:
    """One `v4 run`'s recovery: the configuration as resolved from its files (`base`), the nodes this run does without
    and the standbys it took (from run.json on a resume), the restarts left in its budget. The budget is the run's,
    not the launch's: a `--resume` finds the restarts its earlier launches (and its RL jobs' engines) spent, so a
    fault that comes back on every resume is not restarted without end; `--set PRESET_MAX_RESTARTS` on the resume
    raises it."""

    def __init__(self, base, run, skip_checks=(), progress: Progress = _stderr):
        self.base, self.run, self.skip_checks, self.say = base, run, tuple(skip_checks), progress
        self.budget = int(base["PRESET_MAX_RESTARTS"])
        self.used = 0                         # restarts in this launch (spent() counts the run's)
        self.t0 = time.time()                 # this launch's start: engine restarts since are this launch's
        self.note = ""                        # why the last failure was not restarted ("": it was not a candidate)
        self.plan = None                      # the plan rebuilt for the latest configuration

    # -- the roster -------------------------------------------------------------------------------
    def current(self):
        """The configuration for the nodes the run's record says it has (base when it left none out)."""
        rec = run_record(self.run)
        out = [e.ip for e in rec.left_out]
        if not out and not rec.standby_in:
            return self.base
        try:
            return derive(self.base, out, rec.standby_in, self._where(rec))
        except Refused as e:
            raise JobError(f"run {self.run.id} left out {', '.join(out)}; {e.message}", fix=e.fix) from None

    def _where(self, rec: RunRecovery) -> str:
        parts = [f"{e.ip} left out ({e.by}: {', '.join(e.checks) or e.step})" for e in rec.left_out]
        parts += [f"standby {s} in" for s in rec.standby_in]
        return f"run {self.run.id}: " + "; ".join(parts)

    def _shrink(self, cfg, leaving: list[LeftOut]):
        """Leave `leaving` out too, standbys that pass preflight in their places: (new config, standbys taken).
        Raises Refused."""
        rec = run_record(self.run)
        out = [e.ip for e in rec.left_out] + [e.ip for e in leaving]
        # standbys not taken yet, nor left out themselves (a standby lost after it took a place stays out)
        free = [s for s in self.base["V4_STANDBY_IPS"] if s not in rec.standby_in and s not in out]
        taken: list[str] = []
        if free:
            want = min(len(leaving), len(free))
            taken = self._standbys(cfg, free, want)
        for e, s in zip(leaving, taken):
            e.replaced_by = s
        standby_in = [s for s in rec.standby_in if s not in out] + taken
        new_rec = rec.model_copy(update={"left_out": rec.left_out + leaving, "standby_in": standby_in})
        new = derive(self.base, out, standby_in, self._where(new_rec))
        return new, new_rec, taken

    def _standbys(self, cfg, candidates: list[str], want: int) -> list[str]:
        """Up to `want` of the standby nodes that pass preflight (judged beside the head, which writes the token the
        shared-directory check reads)."""
        from launcher import preflight
        from launcher.nodes import close_all, nodes_from_config
        self.say(f"[recovery] preflight of standby node(s) {', '.join(candidates)}")
        probe = copy.copy(cfg)
        probe.values = {**cfg.values, "V4_WORKER_IPS": list(candidates)}
        nodes = nodes_from_config(probe)
        try:
            results = preflight.run_checks(cfg, nodes=nodes)
        finally:
            close_all(nodes)
        strict = bool(cfg.get("PRESET_STRICT_PREFLIGHT"))
        bad: dict[str, list[str]] = {}
        for r in preflight.failed(results, strict):
            if r.node in candidates and r.name not in self.skip_checks:
                bad.setdefault(r.node, []).append(f"{r.name}: {r.detail}")
        for ip, why in bad.items():
            self.say(f"[recovery] standby {ip} not taken: " + "; ".join(why)[:400])
        good = [ip for ip in candidates if ip not in bad]
        readmit(cfg, good, self.say)
        return good[:want]

    # -- preflight, --exclude-bad-nodes -------------------------------------------------------------
    def leave_out(self, cfg, results, failing):
        """Preflight failed on some nodes: the configuration without them (standbys in their places), recorded; or
        PreflightError naming what cannot be left out or what no longer fits."""
        head = cfg.nodes[0]
        on_head = [r for r in failing if r.node == head]
        if on_head:
            raise PreflightError(
                "preflight failed on the head, which --exclude-bad-nodes never leaves out (it runs the Ray GCS, the "
                "dashboard and the rendezvous): " + "; ".join(f"{r.name}: {r.detail}" for r in on_head[:5]),
                fix=(on_head[0].fix or "") + "   (or make another node the head: V4_MASTER_IP)")
        by_node: dict[str, list] = {}
        for r in failing:
            by_node.setdefault(r.node, []).append(r)
        now = time.time()
        leaving = [LeftOut(ip=ip, by="preflight", at=now, run=self.run.id, checks=sorted({r.name for r in rs}),
                           why="; ".join(f"{r.name}: {r.detail}" for r in rs)[:500])
                   for ip, rs in by_node.items()]
        try:
            new, rec, taken = self._shrink(cfg, leaving)
        except Refused as e:
            raise PreflightError(f"preflight failed on {', '.join(by_node)}; leaving "
                                 f"{'it' if len(by_node) == 1 else 'them'} out: {e.message}", fix=e.fix) from None
        for e in leaving:
            self.say(f"[preflight] leaving out {e.ip}: {e.why}" + (f"; standby {e.replaced_by} takes its place"
                                                                  if e.replaced_by else ""))
        self._stop_ray_on(cfg, [e.ip for e in leaving])
        _save_record(self.run, rec)
        quarantine(cfg, leaving)
        self.say(f"[preflight] going on with {len(new.nodes)} node(s): {' '.join(new.nodes)} "
                 f"(world {world(cfg)} -> {world(new)}, DP {new['DP']})")
        return new

    def _stop_ray_on(self, cfg, ips: list[str]) -> None:
        """A left-out node's Ray (from an earlier `cluster up`) must not take the run's ranks: stop what v4 started
        there (its recorded processes, as `cluster down` does node by node), where the node answers. Not through
        `cluster.down`, which also forgets the cluster's GCS state in Redis: the cluster goes on."""
        from launcher.cluster import cluster_commands
        from launcher.nodes import close_all, fan_out, nodes_from_config
        stops = {c.ip: c.stop for c in cluster_commands(cfg)}
        nodes = [n for n in nodes_from_config(cfg) if n.name in ips]
        try:
            for n, r in zip(nodes, fan_out(nodes, lambda n: n.run(stops[n.name], timeout=120))):
                try:
                    rep = json.loads(r.stdout.strip().splitlines()[-1]) if r.ok else {}
                except (ValueError, IndexError):
                    rep = {}
                if rep.get("stopped"):
                    self.say(f"[preflight] {n.name}: stopped the {len(rep['stopped'])} Ray process(es) v4 had "
                             "started there")
                elif not r.ok:
                    self.say(f"[preflight] note: {n.name}: could not stop a Ray v4 may have started there: "
                             f"{r.tail(3)}")
        finally:
            close_all(nodes)
        self._wait_gone_from_gcs(cfg, ips)

    def _wait_gone_from_gcs(self, cfg, ips: list[str]) -> None:
        """Until the GCS no longer counts `ips` as ALIVE (a raylet stopped unregisters; one that did not is declared
        dead within V4_NODE_DEAD_TIMEOUT): `cluster up` for the smaller cluster refuses a live node it does not hold."""
        from launcher.cluster import dashboard_url, read_auth_token
        try:
            token = read_auth_token(cfg)
        except V4Error:
            return                                  # no head to ask: no Ray, nothing registered
        url, headers = dashboard_url(cfg) + "/api/v0/nodes", {"Authorization": f"Bearer {token}"} if token else {}
        deadline = time.monotonic() + float(cfg["V4_NODE_DEAD_TIMEOUT"]) + 10
        while time.monotonic() < deadline:
            try:
                live = {n.node_ip for n in gcs_nodes(url, headers) if n.state == "ALIVE"} & set(ips)
            except QUERY_ERRORS:
                return                              # no Ray answers: nothing registered either
            if not live:
                return
            time.sleep(0.5)

    # -- a step that did not succeed ----------------------------------------------------------------
    def restart(self, cfg, step, outcome) -> Again | None:
        """The step to run again after `outcome`, or None (then `note` says why not, when it was a candidate)."""
        self.note = ""
        cause, lost = self._cause(cfg, outcome)
        if cause is None:
            return None
        if lost is not None and cfg.nodes[0] in lost.nodes:
            self.note = f"the head {cfg.nodes[0]} is lost ({lost.why[cfg.nodes[0]]}): no restart without it"
            return None
        detail = lost.message if lost is not None else (outcome.hang or {}).get("message", outcome.message)
        if spent(self.run) >= self.budget:
            self.note = self.spent_note()
            self.say(f"[recovery] {cause.replace('_', ' ')}: {detail}; {self.note}")
            return None
        t0 = time.time()
        rec = run_record(self.run)
        n = len(rec.restarts) + 1
        from_step, last = checkpoint_step(self.run.dir, cfg), last_logged_step(self.run.dir)
        new, standby, stacks = cfg, [], ""
        if lost is not None:
            leaving = [LeftOut(ip=ip, by="lost", at=lost.noticed_at, run=self.run.id, step=step.name,
                               why=lost.why[ip]) for ip in lost.nodes]
            try:
                new, new_rec, standby = self._shrink(cfg, leaving)
            except Refused as e:
                self.note = e.message
                self.say(f"[recovery] {lost.message}; no restart: {e.message}")
                return None
            rec = new_rec
            quarantine(cfg, leaving)
            if standby:
                from launcher import cluster
                self.say(f"[recovery] bringing up Ray on standby {', '.join(standby)}")
                cluster.up(new, progress=self.say)
        if outcome.hang:
            stacks = self._keep_stacks(n, outcome.hang)
        r = Restart(n=n, step=step.name, cause=cause, detail=detail[:1000], nodes=lost.nodes if lost else [],
                    at=lost.noticed_at if lost else t0, job=outcome.submission_id, job_elapsed_s=outcome.elapsed_s,
                    noticed_after_s=(lost.after_s if lost else (outcome.hang or {}).get("stalled_s")),
                    from_step=from_step, last_step=last, steps_lost=max(0, last - from_step), world_before=world(cfg),
                    world_after=world(new), nodes_after=list(new.nodes), standby=standby, stacks=stacks)
        self.used += 1
        new_step = self._rebuild(new, step)
        r.restart_s = round(time.time() - t0, 2)
        rec.restarts.append(r)
        _save_record(self.run, rec)
        change = (f" on {len(new.nodes)} node(s) {' '.join(new.nodes)}, world {r.world_before} -> {r.world_after}"
                  + (f" (standby {', '.join(standby)} in place of {', '.join(r.nodes)})" if standby else "")
                  if lost is not None else "")
        again = f"step {last} runs" if r.steps_lost == 1 else f"steps {from_step + 1}-{last} run"
        lost_steps = (f"{again} again ({r.steps_lost} lost; PRESET_SAVE_INTERVAL={cfg['PRESET_SAVE_INTERVAL']})"
                      if r.steps_lost else "no step lost")
        total = spent(self.run)
        before = total - self._this_launch()
        self.say(f"[recovery] restart {n} ({total} of PRESET_MAX_RESTARTS={self.budget} for the run"
                 + (f", {before} before this launch" if before else "") + f"): {cause.replace('_', ' ')}: "
                 f"{detail[:300]}")
        self.say(f"[recovery] {step.name} resumes from "
                 + (f"the checkpoint of step {from_step}" if from_step else "its start (no checkpoint yet)")
                 + f"; {lost_steps}{change}")
        return Again(new, new_step, r)

    def spent_note(self) -> str:
        """Why no restart is left: the budget, where it was set, what the run spent it on, how to raise it."""
        where = self.base.origin("PRESET_MAX_RESTARTS").where
        if not self.budget:
            return f"no restart left: PRESET_MAX_RESTARTS=0 ({where}) forbids it"
        return f"no restart left: PRESET_MAX_RESTARTS={self.budget} ({where}) is spent: {self._spent_words()}"

    def _spent_words(self) -> str:
        rec, eng = run_record(self.run), engine_restarts(self.run)
        n = len(rec.restarts) + len(eng)
        kinds = [f"{sum(r.cause == c for r in rec.restarts)} {c.replace('_', ' ')}" for c in ("node_lost", "hung")
                 if any(r.cause == c for r in rec.restarts)] + ([f"{len(eng)} rollout engine"] if eng else [])
        here = self._this_launch()
        when = "" if here == n else "all before this launch" if not here else f"{n - here} before this launch"
        return (f"run {self.run.id} has restarted {n} time(s) ({', '.join(kinds)}" + (f"; {when}" if when else "")
                + f"); to allow more, resume it with --set PRESET_MAX_RESTARTS={n + 1} (or more)")

    def _this_launch(self) -> int:
        return self.used + sum(e.at >= self.t0 for e in engine_restarts(self.run))

    def budget_line(self) -> str:
        """What a resume says of the restarts its run has left ("" for a run that never restarted)."""
        n = spent(self.run)
        if not n:
            return ""
        if n < self.budget:
            return (f"resume: run {self.run.id} has restarted {n} time(s); {self.budget - n} of PRESET_MAX_RESTARTS="
                    f"{self.budget} left")
        return (f"resume: PRESET_MAX_RESTARTS={self.budget} ({self.base.origin('PRESET_MAX_RESTARTS').where}) is "
                f"spent, so a lost node, a hung step or a lost rollout engine now ends the run: {self._spent_words()}")

    def started(self, sid: str) -> None:
        """The job that ran after the latest restart, into its record."""
        rec = run_record(self.run)
        if rec.restarts and not rec.restarts[-1].next_job:
            rec.restarts[-1].next_job = sid
            _save_record(self.run, rec)

    def _cause(self, cfg, outcome) -> tuple[str | None, Lost | None]:
        if getattr(outcome, "lost", None):
            d = outcome.lost
            return "node_lost", Lost(d["nodes"], d["why"], d["how"], d["noticed_at"], d.get("after_s"))
        if outcome.hang:
            return "hung", None
        if cfg["V4_EXECUTOR"] != "ray" or outcome.status not in ("FAILED", "STOPPED"):
            return None, None
        try:
            lost = lost_after_failure(cfg)
        except V4Error as e:
            self.say(f"[recovery] note: cluster status after the failure did not answer: {e.message}")
            return None, None
        return ("node_lost", lost) if lost is not None else (None, None)

    def _keep_stacks(self, n: int, hang: dict) -> str:
        """The hung attempt's stacks (RUN/hang) move to RUN/restarts/<n>/hang: the next attempt's watchdog writes its
        own there."""
        src = Path(hang.get("stacks_dir") or self.run.dir / "hang")
        dst = self.run.dir / "restarts" / str(n) / "hang"
        if not src.is_dir():
            return ""
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(dst, ignore_errors=True)
        shutil.move(str(src), str(dst))
        return str(dst)

    def _rebuild(self, cfg, step):
        """The step's job for `cfg`, config.json and plan.json rewritten (every later job reads the new values)."""
        from launcher import plan as planning
        self.run.write_json("config.json", {"values": cfg.job_values()}, private=True)
        self.plan = planning.build(cfg, run_id=self.run.id)
        self.run.write_json("plan.json", self.plan.to_json())
        return next(s for s in self.plan.steps if s.name == step.name)


def mark_restart(job, n_restarts: int, attempt: int, n_spent: int = 0) -> None:
    """What a job learns of its place in the run: V4_RESTARTS (the run's restarts of a step so far; its metrics rows
    carry it), V4_STEP_ATTEMPT (this step's earlier jobs: a fault planted `@once` fires in the first only) and
    V4_RESTARTS_SPENT (every restart the run recorded, engines' too: the RL job restarts engines only within what is
    left of PRESET_MAX_RESTARTS)."""
    env = job.runtime_env.setdefault("env_vars", {})
    env["V4_STEP_ATTEMPT"] = str(attempt)
    env["V4_RESTARTS_SPENT"] = str(n_spent)
    if n_restarts:
        env["V4_RESTARTS"] = str(n_restarts)
    else:
        env.pop("V4_RESTARTS", None)


def summary(run) -> dict:
    """What summary.json and the PASSED line say of the run's recovery: `restarts` counts the steps' restarts (lost
    nodes, hangs), `engine_restarts` the rollout engines the RL job restarted (each also in `restart_causes`)."""
    rec, eng = run_record(run), engine_restarts(run)
    return {"left_out": [{"ip": e.ip, "by": e.by, "why": e.why, "replaced_by": e.replaced_by} for e in rec.left_out],
            "restarts": len(rec.restarts), "steps_lost": sum(r.steps_lost for r in rec.restarts),
            "engine_restarts": len(eng), "samples_regenerated": sum(e.samples for e in eng),
            "restart_causes": [f"{r.cause}: {', '.join(r.nodes) or r.detail[:80]}" for r in rec.restarts]
            + [f"rollout_engine: step {e.step} {e.phase}: {e.cause[:80]}" for e in eng]}

