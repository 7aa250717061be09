"""Ray on the configured nodes: render the per-node commands, bring up, tear down, report.

The same rendered commands serve `--dry-run` (via `cluster_commands`) and the real bring-up.
Readiness is what Ray's GCS says: exactly the expected node addresses, ALIVE, with the expected
GPUs/CPUs. Processes are ours only if they carry the V4_RAY_SESSION token `up` gave them, so
`down` never touches another Ray on the same host.
"""
from __future__ import annotations

import json
import os
import re
import secrets
import shlex
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Callable

from launcher.errors import ClusterError
from launcher.node_scripts import source
from launcher.nodes import Node, Result, fan_out, node_local_dir, nodes_from_config, opened, python_on_nodes

TEMPLATES = Path(__file__).parent / "templates"
STATUS_SCHEMA = 1
Progress = Callable[[str], None]
HEARTBEAT_S = 15.0          # while waiting for readiness, a progress line at least this often


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@lru_cache(maxsize=1)
def _jinja():
    import jinja2
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATES)), undefined=jinja2.StrictUndefined,
                             keep_trailing_newline=True)
    # Every value pasted into a script goes through `q` (a shell word), or `comment` inside a `#` line (where a
    # newline in the value would otherwise start a command).
    env.filters["q"] = lambda v: shlex.quote(str(v))
    env.filters["comment"] = lambda v: re.sub(r"[\x00-\x1f\x7f]", "?", str(v))
    return env


def render(template: str, **ctx) -> str:
    return _jinja().get_template(template).render(**ctx)


# --- the commands ---------------------------------------------------------------------------

@dataclass(frozen=True)
class NodeCommands:
    ip: str
    role: str               # head | worker
    local_dir: str          # V4_LOCAL_DIR of this node
    state_dir: str          # our Ray's temp dir and process record, inside local_dir
    container: str          # runs on the host first: makes sure the container runs ("" = none)
    start: str              # starts Ray (in the container, if any) and records its processes
    stop: str               # stops exactly the processes `start` recorded
    container_rm: str = ""

    def display(self) -> list[str]:
        """The commands as a plan shows them (the embedded node script abbreviated)."""
        def short(script: str) -> str:
            body = source("ray_procs")
            return script.replace(body, "<launcher/node_scripts/ray_procs.py>\n")
        return [c for c in (self.container, short(self.start)) if c]


def expected_gpus(cfg) -> int:
    # On hw=cpu, V4_NUM_GPUS_PER_NODE counts gloo processes, not devices Ray should advertise.
    return int(cfg["V4_NUM_GPUS_PER_NODE"]) if cfg.get("HW_DEVICE", "cpu") == "cuda" else 0


def expected_cpus(cfg) -> int | None:
    raw = str(cfg.get("V4_RAY_NUM_CPUS", "") or "").strip()
    return int(float(raw)) if raw else None


def ray_state_dir(cfg, ip: str) -> str:
    """Where a node keeps this cluster's Ray: temp dir, start log, process record. Keyed by the
    GCS port, so two clusters sharing V4_LOCAL_DIR (two local clusters) never see each other's."""
    return f"{node_local_dir(cfg, ip)}/ray{cfg['V4_RAY_PORT']}"


def gcs_address(cfg) -> str:
    return f"{cfg['V4_MASTER_IP']}:{cfg['V4_RAY_PORT']}"


def dashboard_url(cfg) -> str:
    return f"http://{cfg['V4_MASTER_IP']}:{cfg['V4_DASHBOARD_PORT']}"


# Ray's token authentication: without it anyone who reaches the dashboard or the GCS can submit a job, i.e. run
# code on every node. One random token a cluster, written by `up` into each node's state directory (a 0700
# directory, the file 0600) before that node's `ray start`. The mode must be explicit and the same on every node:
# Ray >= 2.59 turns token auth on by itself on a head where ~/.ray/auth_token exists, and workers then cannot join.
def auth_token_path(cfg, ip: str) -> str:
    return f"{ray_state_dir(cfg, ip)}/auth/token"


def auth_env(cfg, ip: str) -> dict[str, str]:
    """What a process on node `ip` needs to talk to the cluster's Ray (ray start, the GCS probe, ray job submit)."""
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": auth_token_path(cfg, ip)}


def read_auth_token(cfg, head: Node | None = None) -> str:
    """The running cluster's token, read from the head ('' when there is none: not up, or started without auth)."""
    own = head is None
    head = head or nodes_from_config(cfg)[0]
    try:
        r = head.run(f"cat {shlex.quote(auth_token_path(cfg, head.name))} 2>/dev/null", timeout=60)
    except Exception as e:   # noqa: BLE001 - SSH: unreachable, refused, authentication, host key, channel refused
        raise ClusterError(f"cannot read the Ray auth token from the head {head.name}: {type(e).__name__}: {e}",
                           fix=f"`v4 preflight --only ssh` shows what is wrong with SSH to {head.name}") from None
    finally:
        if own and hasattr(head, "close"):        # an SSH connection opened only for this
            head.close()
    return r.stdout.strip() if r.ok else ""


def redis_password_path(cfg, ip: str) -> str:
    return f"{ray_state_dir(cfg, ip)}/auth/redis_password"


def redis_namespace(cfg) -> str:
    """The GCS's key prefix in the external Redis: one cluster's state, found again by its next head (GCS fault
    tolerance), never another cluster's sharing the Redis."""
    return f"v4-{cfg['V4_CLUSTER_NAME']}-{cfg['V4_RAY_PORT']}"


def _install_token(cfg, node: Node, token: str) -> Result:
    return _install_secret(cfg, node, auth_token_path(cfg, node.name), token)


def _install_secret(cfg, node: Node, path: str, text: str) -> Result:
    # On the host, where `put` writes (the state directory is mounted at the same path in a container, whose root reads
    # the file); only the secrets' own directory is private, the state directory keeps its usual mode. By SFTP, never
    # on a command line, where `ps` would show it.
    host = node.host()
    d = Path(path).parent
    r = host.run(f"mkdir -p {shlex.quote(str(d.parent))} && (umask 077 && mkdir -p {shlex.quote(str(d))}) && "
                 f"chmod 700 {shlex.quote(str(d))}", timeout=60)
    if not r.ok:
        raise ClusterError(f"{node.name}: cannot create {d}: {r.tail(3)}",
                           fix=f"make {d.parent} writable for V4_SSH_USER on {node.name} (V4_LOCAL_DIR)")
    fd, tmp = tempfile.mkstemp(prefix="v4-secret-")         # 0600
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        host.put(tmp, path)
    finally:
        os.unlink(tmp)
    r = host.run(f"chmod 600 {shlex.quote(path)}", timeout=60)
    if not r.ok:
        raise ClusterError(f"{node.name}: cannot protect {path}: {r.tail(3)}",
                           fix=f"check the owner of {d} on {node.name}: it must be V4_SSH_USER")
    return r


REDIS_CLEANUP = """import os, sys
from ray._private.gcs_utils import cleanup_redis_storage
host, port, namespace, pw_file = sys.argv[1:5]
password = open(pw_file).read() if os.path.isfile(pw_file) else ""
cleanup_redis_storage(host, int(port), password, False, namespace)
if os.path.isfile(pw_file):
    os.unlink(pw_file)
"""


def _forget_in_redis(cfg, head: Node, progress: Progress) -> dict:
    """`down` is a deliberate end: the GCS state this cluster kept in the external Redis goes too, or the next head
    would take it up again (the dead nodes and finished jobs of this one). On the head, which can reach the Redis."""
    ns, pw_file = redis_namespace(cfg), redis_password_path(cfg, head.name)
    cmd = (f"{shlex.quote(python_on_nodes(cfg))} - {shlex.quote(str(cfg['V4_REDIS_HOST']))} "
           f"{int(cfg['V4_REDIS_PORT'])} {shlex.quote(ns)} {shlex.quote(pw_file)} <<'V4_REDIS'\n{REDIS_CLEANUP}V4_REDIS\n")
    r = head.run(cmd, timeout=120)
    if not r.ok:
        return {"ok": False, "error": f"removing the GCS state {ns} from Redis {cfg['V4_REDIS_HOST']}:"
                                      f"{cfg['V4_REDIS_PORT']}: {r.tail(4)}"}
    progress(f"{head.name}: removed the GCS state {ns} from Redis {cfg['V4_REDIS_HOST']}:{cfg['V4_REDIS_PORT']}")
    return {"redis_cleared": ns}


def _remove_token(cfg, node: Node) -> Result:
    # Where `_install_token` wrote it: on the host (a removed container cannot hide it).
    return node.host().run(f"rm -f {shlex.quote(auth_token_path(cfg, node.name))}", timeout=60)


# --- the container (container mode) -------------------------------------------------------------

CONTAINER_LABEL = "v4.launcher"       # its value: the V4_CLUSTER_NAME whose `up` created the container


def container_state(cfg, node: Node) -> dict:
    """V4_CONTAINER on `node`'s host, asked with `docker inspect` there: state absent | running | stopped | error,
    owner (the cluster that made it, '' if not v4), ours, image, error. Never runs anything inside it."""
    name = str(cfg.get("V4_CONTAINER", "") or "")
    fmt = f'{{{{.State.Running}}}}|{{{{index .Config.Labels "{CONTAINER_LABEL}"}}}}|{{{{.Config.Image}}}}'
    r = node.host().run(f"docker inspect -f {shlex.quote(fmt)} {shlex.quote(name)}", timeout=60)
    out = {"name": name, "state": "error", "owner": "", "ours": False, "image": "", "error": ""}
    if r.ok and r.stdout.count("|") >= 2:
        running, owner, image = r.stdout.strip().splitlines()[-1].split("|", 2)
        owner = "" if owner == "<no value>" else owner
        out.update(state="running" if running == "true" else "stopped", owner=owner, image=image,
                   ours=owner == str(cfg["V4_CLUSTER_NAME"]))
    elif "no such" in r.stderr.lower():
        out["state"] = "absent"
    elif r.rc == 127:
        out["error"] = f"docker not found on the host {node.name}: {r.tail(2)}"
    else:
        out["error"] = f"`docker inspect {name}` on {node.name} failed (rc {r.rc}): {r.tail(3)}"
    return out


def site_env(cfg) -> dict[str, str]:
    """What every process on the nodes needs from the site: proxy (never for the cluster's own
    addresses) and time zone. Ray daemons and job steps both get it."""
    env: dict[str, str] = {}
    if cfg.get("V4_HTTP_PROXY"):
        proxy = str(cfg["V4_HTTP_PROXY"])
        env.update(http_proxy=proxy, https_proxy=proxy, HTTP_PROXY=proxy, HTTPS_PROXY=proxy,
                   no_proxy=",".join(["localhost", "127.0.0.1", *cfg.nodes]))
        env["NO_PROXY"] = env["no_proxy"]
    if cfg.get("V4_TZ"):
        env["TZ"] = str(cfg["V4_TZ"])
    return env


def _node_env(cfg) -> dict[str, str]:
    env: dict[str, str] = site_env(cfg)
    if str(cfg["V4_MASTER_IP"]).startswith("127."):
        # Otherwise Ray silently advertises the default-route address instead of loopback.
        env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    env.update(health_check_env(float(cfg["V4_NODE_DEAD_TIMEOUT"])))
    return env


def health_check_env(dead_after_s: float) -> dict[str, str]:
    """The GCS's health checks of the raylets (RayConfig, read from the environment of `ray start`), so that a node
    that stops answering is declared DEAD after `dead_after_s` (V4_NODE_DEAD_TIMEOUT; docs/resilience.md): five
    failed checks a period apart, each waiting a period -- a killed raylet (refused at once) is dead in half that."""
    period_ms = max(100, int(dead_after_s * 1000 / 10))
    return {"RAY_health_check_period_ms": str(period_ms), "RAY_health_check_timeout_ms": str(period_ms),
            "RAY_health_check_failure_threshold": "5"}


def same_path_mounted(path: str, mounts: list[str]) -> bool:
    """`path` is visible at the same path in the container through one of the src:dst mounts."""
    for m in mounts:
        src, _, rest = m.partition(":")
        dst = rest.split(":")[0]
        if src == dst and (path == dst or path.startswith(dst.rstrip("/") + "/")):
            return True
    return False


def cluster_commands(cfg, force: bool = False) -> list[NodeCommands]:
    """Every node's bring-up and teardown commands, head first."""
    python = python_on_nodes(cfg)
    container, image = str(cfg.get("V4_CONTAINER", "") or ""), str(cfg.get("V4_IMAGE", "") or "")
    if container and not image:
        raise ClusterError(f"V4_CONTAINER={container} but V4_IMAGE is empty",
                           fix="set V4_IMAGE in the cluster file, or empty V4_CONTAINER to run on the hosts")
    common = dict(python=python, bin_dir=str(Path(python).parent) if python.startswith("/") else "", procs_py=source("ray_procs").rstrip("\n"),
                  cluster_name=cfg["V4_CLUSTER_NAME"], master_ip=cfg["V4_MASTER_IP"],
                  ray_port=cfg["V4_RAY_PORT"], dashboard_port=cfg["V4_DASHBOARD_PORT"],
                  client_port=cfg["V4_RAY_CLIENT_PORT"],
                  num_gpus=expected_gpus(cfg), num_cpus=expected_cpus(cfg), env=_node_env(cfg),
                  socket_ifname=str(cfg.get("V4_SOCKET_IFNAME", "auto") or "auto"), force=force)
    out = []
    for i, ip in enumerate(cfg.nodes):
        local, state = node_local_dir(cfg, ip), ray_state_dir(cfg, ip)
        ctx = dict(common, ip=ip, state_dir=state, env={**common["env"], **auth_env(cfg, ip)}, redis_password_file="")
        if i == 0 and cfg["V4_REDIS_HOST"]:
            # GCS fault tolerance: the head's GCS keeps its state in the external Redis, under this cluster's prefix
            ctx["env"].update(RAY_REDIS_ADDRESS=f"{cfg['V4_REDIS_HOST']}:{cfg['V4_REDIS_PORT']}",
                              RAY_external_storage_namespace=redis_namespace(cfg))
            ctx["redis_password_file"] = redis_password_path(cfg, ip) if cfg["V4_REDIS_PASSWORD"] else ""
        run_container = rm_container = ""
        if container:
            mounts = list(cfg.get("V4_DOCKER_MOUNTS", []) or [])
            work = str(cfg["V4_WORK"])
            # Paths are baked on the host and used inside: V4_WORK and the node-local directory
            # must be at the same path there.
            for path in (work, local):
                if not same_path_mounted(path, mounts):
                    mounts.append(f"{path}:{path}")
            run_container = render("container_run.sh.j2", **ctx, container=container, image=image,
                                   gpus=expected_gpus(cfg) > 0, shm_size=cfg.get("V4_CONTAINER_SHM_SIZE", "200g"),
                                   mounts=mounts, workdir=work)
            rm_container = render("container_rm.sh.j2", **ctx, container=container)
        out.append(NodeCommands(
            ip=ip, role="head" if i == 0 else "worker", local_dir=local, state_dir=state, container=run_container,
            start=render("ray_head.sh.j2" if i == 0 else "ray_worker.sh.j2", **ctx),
            stop=render("ray_stop.sh.j2", **ctx), container_rm=rm_container))
    return out


# --- what is running ----------------------------------------------------------------------------

@dataclass
class NodeState:
    ip: str
    role: str
    reachable: bool = True
    error: str = ""
    recorded: bool = False                                  # our ray_procs.json exists there
    procs: list[dict] = field(default_factory=list)         # recorded processes with `alive`
    gcs_state: str = "missing"                              # ALIVE | DEAD | missing
    hostname: str = ""
    resources: dict = field(default_factory=dict)

    def proc(self, name: str) -> dict | None:
        return next((p for p in self.procs if p["name"] == name), None)


@dataclass
class ClusterStatus:
    cluster: str
    head: str
    gcs: str
    dashboard: str
    gcs_ok: bool = False
    gcs_error: str = ""
    dashboard_ok: bool = False
    nodes: list[NodeState] = field(default_factory=list)
    extra_nodes: list[dict] = field(default_factory=list)    # ALIVE in the GCS but not configured
    jobs: list[dict] | None = None
    problems: list[str] = field(default_factory=list)
    changed: bool = False                                    # set by `up` when it started anything
    cluster_id: str = ""                                     # the GCS's, once it proved to be ours
    foreign: str = ""                                        # what answers on our ports instead of our Ray
    foreign_port: int = 0                                    # the port it holds
    foreign_cluster_id: bool = False                         # held by our processes, but not the cluster id recorded
    left_out: list[dict] = field(default_factory=list)       # nodes runs left out (launcher/recovery.py): ip, why, run

    @property
    def healthy(self) -> bool:
        return not self.problems

    def to_json(self) -> dict:
        return {"schema": STATUS_SCHEMA, **asdict(self), "healthy": self.healthy}


def _probe_gcs(cfg, head: Node, timeout: float = 45, record: bool = False) -> dict:
    """The head's view of the GCS (node_scripts/ray_gcs.py): nodes, jobs, and whether it is the Ray this checkout
    started; `record`: write the GCS's cluster id as the one later probes must find."""
    cmd = (f"{shlex.quote(python_on_nodes(cfg))} - {shlex.quote(gcs_address(cfg))} {shlex.quote(dashboard_url(cfg))} "
           f"{shlex.quote(ray_state_dir(cfg, head.name))}{' record' if record else ''} "
           f"<<'V4_GCS'\n{source('ray_gcs')}V4_GCS\n")
    r = head.run(cmd, env=auth_env(cfg, head.name), timeout=timeout)
    if not r.ok:
        return {"gcs_ok": False, "error": f"probe on {head.name} failed (rc {r.rc}): {r.tail(5)}",
                "nodes": [], "dashboard_ok": False, "jobs": None}
    return json.loads(r.stdout.strip().splitlines()[-1])


def _procs_status(cfg, node: Node) -> dict:
    if node.container:
        # Ours runs only in our running container; `docker exec` into an absent one would look like a dead node.
        box = container_state(cfg, node)
        if box["state"] == "error":
            raise ConnectionError(box["error"])
        if not (box["state"] == "running" and box["ours"]):
            return {"recorded": False}
    state = shlex.quote(ray_state_dir(cfg, node.name))
    cmd = (f"if [ -s {state}/ray_procs.json ]; then {shlex.quote(python_on_nodes(cfg))} - status "
           f"{state} <<'V4_PROCS'\n{source('ray_procs')}V4_PROCS\nelse echo '{{\"recorded\": false}}'; fi")
    r = node.run(cmd, timeout=30)
    if not r.ok:
        raise ConnectionError(r.tail(5))
    return json.loads(r.stdout.strip().splitlines()[-1])


def _judge(cfg, st: ClusterStatus, gcs: dict) -> None:
    """Fill the GCS view into `st` and list every way it differs from the configuration."""
    st.gcs_ok, st.gcs_error = gcs["gcs_ok"], gcs.get("error", "")
    st.dashboard_ok, st.jobs = gcs.get("dashboard_ok", False), gcs.get("jobs")
    st.cluster_id, st.foreign = gcs.get("cluster_id", ""), gcs.get("foreign", "")
    st.foreign_port, st.foreign_cluster_id = gcs.get("foreign_port", 0), gcs.get("foreign_cluster_id", False)
    if st.foreign:
        # nothing it reports is about our cluster: its nodes are not ours to judge, its jobs not ours to show
        st.problems.append(f"not this checkout's Ray: {st.foreign}")
        st.gcs_ok, st.dashboard_ok, st.jobs = False, False, None
        return
    alive = {n["ip"]: n for n in gcs["nodes"] if n["state"] == "ALIVE"}
    dead = {n["ip"]: n for n in gcs["nodes"] if n["state"] == "DEAD"}
    if not st.gcs_ok:
        st.problems.append(f"Ray GCS at {st.gcs}: {st.gcs_error}")
    for ns in st.nodes:
        n = alive.get(ns.ip) or dead.get(ns.ip)
        if n:
            ns.gcs_state, ns.hostname, ns.resources = n["state"], n["hostname"], n["resources"]
        if not ns.reachable:
            st.problems.append(f"{ns.ip} ({ns.role}): unreachable: {ns.error}")
        if st.gcs_ok and ns.gcs_state != "ALIVE":
            st.problems.append(f"{ns.ip} ({ns.role}): {'DEAD' if ns.gcs_state == 'DEAD' else 'not registered'} "
                               "in the Ray GCS")
        st.problems += _resource_problems(cfg, ns)
        for p in ns.procs:
            if not p["alive"] and p["name"] in ("raylet", "gcs_server"):
                st.problems.append(f"{ns.ip}: {p['name']} (pid {p['pid']}, started by v4) is not running")
    expected = {ns.ip for ns in st.nodes}
    st.extra_nodes = [n for ip, n in alive.items() if ip not in expected]
    for n in st.extra_nodes:
        st.problems.append(f"{n['ip']} ({n['hostname']}): ALIVE in the Ray GCS but not in the cluster file")
    if st.gcs_ok and not st.dashboard_ok:
        st.problems.append(f"dashboard / Jobs API at {st.dashboard} does not answer")


def _resource_problems(cfg, ns: NodeState) -> list[str]:
    """How the resources Ray registered for a live node differ from what the configuration asks for."""
    if ns.gcs_state != "ALIVE":
        return []
    gpus, cpus = expected_gpus(cfg), expected_cpus(cfg)
    have_gpu, have_cpu = ns.resources.get("GPU", 0), ns.resources.get("CPU", 0)
    problems = []
    if have_gpu != gpus:
        problems.append(f"{ns.ip}: Ray sees {have_gpu:g} GPU(s), expected {gpus}")
    if cpus is not None and have_cpu != cpus:
        problems.append(f"{ns.ip}: Ray sees {have_cpu:g} CPU(s), expected {cpus} (V4_RAY_NUM_CPUS)")
    return problems


def status(cfg, nodes: list[Node] | None = None, *, procs: bool = True) -> ClusterStatus:
    """The cluster as it is: per-node recorded processes, the GCS's node table, jobs, problems."""
    with opened(cfg, nodes) as nodes:
        return _status(cfg, nodes, procs)


def _status(cfg, nodes: list[Node], procs: bool) -> ClusterStatus:
    st = ClusterStatus(cluster=str(cfg["V4_CLUSTER_NAME"]), head=cfg.nodes[0], gcs=gcs_address(cfg),
                       dashboard=dashboard_url(cfg),
                       nodes=[NodeState(ip=n.name, role="head" if i == 0 else "worker") for i, n in enumerate(nodes)])
    if procs:
        for ns, res in zip(st.nodes, fan_out(nodes, lambda n: _procs_status(cfg, n),
                                             on_error=lambda n, e: {"error": f"{type(e).__name__}: {e}"})):
            if "error" in res:
                ns.reachable, ns.error = False, res["error"]
            else:
                ns.recorded, ns.procs = res["recorded"], res.get("procs", [])
    if st.nodes[0].reachable:
        try:
            gcs = _probe_gcs(cfg, nodes[0])
        except Exception as e:   # noqa: BLE001 - becomes a problem line
            gcs = {"gcs_ok": False, "error": f"{type(e).__name__}: {e}", "nodes": []}
    else:
        gcs = {"gcs_ok": False, "error": "head unreachable", "nodes": []}
    _judge(cfg, st, gcs)
    from launcher.recovery import quarantined
    st.left_out = [e.model_dump() for ip, e in quarantined(cfg).items()
                   if ip in cfg.nodes or ip in cfg["V4_STANDBY_IPS"]]
    return st


def left_running(cfg) -> dict:
    """What stays up after a run: the cluster's Ray, its addresses, and on this machine (V4_TRANSPORT=local) how many
    processes it runs and the memory they hold (PSS). Runs leave it up (the next starts at once; another run of this checkout may be
    using it); `v4 cluster down` stops it."""
    out = {"cluster": str(cfg["V4_CLUSTER_NAME"]), "nodes": len(cfg.nodes), "gcs": gcs_address(cfg),
           "dashboard": dashboard_url(cfg), "client_server": f"{cfg['V4_MASTER_IP']}:{cfg['V4_RAY_CLIENT_PORT']}",
           "processes": None, "memory_mb": None}
    if cfg["V4_TRANSPORT"] == "local" and not cfg.get("V4_CONTAINER"):
        from launcher.node_scripts import ray_procs
        fp = ray_procs.footprint(ray_state_dir(cfg, cfg.nodes[0]))
        if fp["recorded"]:
            out.update(processes=fp["procs"], memory_mb=round(fp["mem_kb"] / 1024))
    return out


# --- up / down ----------------------------------------------------------------------------------

def _needs_start(ns: NodeState) -> bool:
    raylet = ns.proc("raylet")
    return not (ns.gcs_state == "ALIVE" and raylet is not None and raylet["alive"])


def _check(results: list[Result], what: str) -> None:
    bad = [r for r in results if not r.ok]
    if bad:
        detail = "\n".join(f"  {r.node}: rc {r.rc}: {r.tail(12)}" for r in bad)
        raise ClusterError(f"{what} failed on {', '.join(r.node for r in bad)}:\n{detail}",
                           fix="read the output above; `v4 cluster status` shows what is running")


def up(cfg, nodes: list[Node] | None = None, progress: Progress = _stderr) -> ClusterStatus:
    """Bring Ray up on every node, head first; a healthy cluster is left as it is."""
    cmds = cluster_commands(cfg)
    with opened(cfg, nodes) as nodes:
        return _up(cfg, nodes, cmds, progress)


def _on_node(node: Node, what: str, fn: Callable[[], Result]) -> Result:
    """`fn()`, with any failure to reach `node` (SSH, SFTP) turned into a ClusterError that names it."""
    try:
        return fn()
    except ClusterError:
        raise
    except Exception as e:   # noqa: BLE001 - paramiko and socket errors alike
        raise ClusterError(f"{what} on {node.name} failed: {type(e).__name__}: {e}",
                           fix=f"`v4 preflight --only ssh` checks SSH (and SFTP) to {node.name}; then `v4 cluster up` "
                               "again") from None


def _settled_problems_fix(cfg, st: ClusterStatus) -> str:
    """What to do about a cluster whose every Ray runs yet is not healthy (waiting would not change it)."""
    fixes = []
    if any(_resource_problems(cfg, ns) for ns in st.nodes):
        fixes.append("Ray was started with other resources than the configuration now asks for (V4_NUM_GPUS_PER_NODE, "
                     "V4_RAY_NUM_CPUS, --hw): `v4 cluster down`, then `v4 cluster up`")
    if st.extra_nodes:
        fixes.append(f"stop the Ray on {', '.join(n['ip'] for n in st.extra_nodes)} (it joined this GCS) or add it "
                     "to V4_WORKER_IPS")
    if st.gcs_ok and not st.dashboard_ok:
        fixes.append(f"read {ray_state_dir(cfg, st.head)}/session_latest/logs/dashboard.log on {st.head}; "
                     "`v4 cluster down`, then `v4 cluster up`")
    return "; ".join(fixes) or "`v4 cluster status` shows it; `v4 cluster down`, then `v4 cluster up` restarts everything"


def _foreign_fix(cfg, st: ClusterStatus) -> str:
    """What to do when something other than this checkout's Ray holds a port of this cluster."""
    from launcher.config.checks import at
    from launcher.config.ports import is_auto, record_path
    if st.foreign_cluster_id:
        return (f"the record was left by an earlier head, or changed by hand: `v4 cluster down`, then `v4 cluster up` "
                f"(a new head records its own id in {ray_state_dir(cfg, st.head)}/identity.json)")
    key = next((k for k in ("V4_RAY_PORT", "V4_DASHBOARD_PORT") if cfg[k] == st.foreign_port), "V4_RAY_PORT")
    stop = "or stop what holds it (a Ray of another checkout: `v4 cluster down` there)"
    if is_auto(cfg, key):
        return (f"{key}={cfg[key]} was picked free for this checkout and recorded in {record_path(cfg.values)}: "
                f"`v4 cluster down`, delete that file and run again (free ports are picked again); {stop}")
    return f"choose another {key} than {at(cfg, key)} (the cluster file, or --set {key}=PORT); {stop}"


def _up(cfg, nodes: list[Node], cmds: list[NodeCommands], progress: Progress) -> ClusterStatus:
    t0 = time.monotonic()
    st = status(cfg, nodes)
    if st.healthy:
        progress(f"cluster {st.cluster}: already up ({len(st.nodes)} nodes ALIVE); nothing to do")
        return st
    down_nodes = [ns.ip for ns in st.nodes if not ns.reachable]
    if down_nodes:
        raise ClusterError(f"cannot reach {', '.join(down_nodes)}: " +
                           "; ".join(ns.error for ns in st.nodes if not ns.reachable),
                           fix="run `v4 preflight --only ssh` and fix SSH access first")
    head = st.nodes[0]
    if st.foreign:
        raise ClusterError(f"cluster {st.cluster}: {st.foreign}; v4 does not join it, submit to it or send it this "
                           "checkout's token", fix=_foreign_fix(cfg, st))
    if st.gcs_ok and not head.recorded:
        raise ClusterError(f"a Ray that v4 did not start answers at {st.gcs}",
                           fix="stop it, or choose another V4_RAY_PORT / V4_DASHBOARD_PORT")
    by_ip = {n.name: n for n in nodes}
    fresh: set[str] = set()          # nodes whose container was (re)created now: whatever Ray ran there is gone
    if cmds[0].container:
        progress(f"containers: ensuring {cfg['V4_CONTAINER']} runs {cfg['V4_IMAGE']} on {len(nodes)} node(s)")
        results = fan_out(nodes, lambda n: n.host().run(next(c for c in cmds if c.ip == n.name).container))
        _check(results, "docker run")
        fresh = {r.node for r in results if "created" in r.stdout.split()}
    head_started = _needs_start(head) or not st.gcs_ok or head.ip in fresh
    if head_started:
        token = secrets.token_urlsafe(32)     # a new head, a new token
        hn = by_ip[head.ip]
        _on_node(hn, "installing the Ray auth token", lambda: _install_token(cfg, hn, token))
        if cfg["V4_REDIS_HOST"] and cfg["V4_REDIS_PASSWORD"]:
            _on_node(hn, "installing the Redis password", lambda: _install_secret(
                cfg, hn, redis_password_path(cfg, hn.name), str(cfg["V4_REDIS_PASSWORD"])))
        progress(f"head {head.ip}: starting Ray (GCS :{cfg['V4_RAY_PORT']}, dashboard :{cfg['V4_DASHBOARD_PORT']}, "
                 f"client server :{cfg['V4_RAY_CLIENT_PORT']})")
        _check([_on_node(hn, "ray start (head)", lambda: hn.run(cmds[0].start))], "ray start (head)")
        todo = cmds[1:]                       # a new head: every worker must (re)join it
    else:
        token = read_auth_token(cfg, by_ip[head.ip])
        if not token:
            raise ClusterError(f"the Ray head on {head.ip} has no auth token (started by an earlier v4, without token "
                               "auth): workers started now could not join it", fix="`v4 cluster down`, then `v4 cluster up`")
        todo = [c for c, ns in zip(cmds[1:], st.nodes[1:]) if _needs_start(ns) or ns.ip in fresh]
        if not todo:
            # Every node's Ray runs and is registered: what is wrong will not change by waiting for it.
            raise ClusterError(f"cluster {st.cluster}: Ray runs on every node but the cluster is not healthy: "
                               + "; ".join(st.problems), fix=_settled_problems_fix(cfg, st))
    if todo:
        progress(f"workers: starting Ray on {', '.join(c.ip for c in todo)}")
        _check(fan_out([by_ip[c.ip] for c in todo], lambda n: _install_token(cfg, n, token)),
               "auth token")
        _check(fan_out([by_ip[c.ip] for c in todo], lambda n: n.run(next(c for c in todo if c.ip == n.name).start)),
               "ray start (worker)")
    wait_ready(cfg, nodes, progress=progress)
    if head_started:
        # The GCS just started is ours (its port is held by our tagged processes): its cluster id is what every
        # later `up`, `status` and run must find there before they trust it.
        hn = by_ip[head.ip]
        ident = _on_node(hn, "recording the cluster id", lambda: _probe_gcs(cfg, hn, record=True))
        if not ident["gcs_ok"] or ident["recorded_cluster_id"] != ident["cluster_id"]:
            raise ClusterError(f"could not record the cluster id of the Ray head on {head.ip}: "
                               f"{ident['foreign'] or ident['error']}", fix="`v4 cluster status` shows what runs there")
    # Record again now that every daemon is up (agents start after `ray start` returns).
    started = [cmds[0], *todo] if head_started else todo
    fan_out([by_ip[c.ip] for c in started],
            lambda n: n.run(f"{shlex.quote(python_on_nodes(cfg))} {shlex.quote(ray_state_dir(cfg, n.name))}/ray_procs.py "
                            f"record {shlex.quote(ray_state_dir(cfg, n.name))} >/dev/null", timeout=60))
    st = status(cfg, nodes)
    st.changed = True
    progress(f"cluster {st.cluster}: ready, {len(st.nodes)} node(s) in {time.monotonic() - t0:.1f} s")
    return st


def wait_ready(cfg, nodes: list[Node], progress: Progress = _stderr, timeout: float | None = None,
               heartbeat: float = HEARTBEAT_S) -> ClusterStatus:
    """Poll the GCS until it reports exactly the expected nodes with their resources; say what it waits for when
    that changes, and at least every `heartbeat` seconds how long it has waited and has left."""
    timeout = float(cfg["V4_RAY_READY_TIMEOUT"]) if timeout is None else timeout
    t0 = time.monotonic()
    deadline, last, beat = t0 + timeout, None, t0 + heartbeat
    while True:
        st = status(cfg, nodes, procs=False)
        alive = [ns.ip for ns in st.nodes if ns.gcs_state == "ALIVE"]
        line = (f"ray: {len(alive)}/{len(st.nodes)} nodes registered"
                + (f"; waiting for: {'; '.join(st.problems)}" if st.problems else ""))
        now = time.monotonic()
        if line != last:
            progress(line)
            last, beat = line, now + heartbeat
        elif now >= beat and not st.healthy:
            progress(f"ray: still waiting, {now - t0:.0f} s so far, {max(0.0, deadline - now):.0f} s left "
                     f"(V4_RAY_READY_TIMEOUT={timeout:g}): {len(alive)}/{len(st.nodes)} nodes registered")
            beat = now + heartbeat
        if st.healthy:
            return st
        if st.foreign:
            # waiting will not make another's Ray ours
            raise ClusterError(f"cluster {st.cluster}: {st.foreign}", fix=_foreign_fix(cfg, st))
        if now > deadline:
            missing = [ns.ip for ns in st.nodes if ns.gcs_state != "ALIVE"]
            raise ClusterError(
                f"Ray not ready after {timeout:g} s (V4_RAY_READY_TIMEOUT): " + "; ".join(st.problems),
                fix=(f"look at {ray_state_dir(cfg, '<node>')}/ray_start.log and session_latest/logs/raylet.out on "
                     f"{', '.join(missing)}" if missing else "see `v4 cluster status`"))
        time.sleep(1.0)


def down(cfg, nodes: list[Node] | None = None, force: bool = False,
         progress: Progress = _stderr) -> list[dict]:
    """Stop the Ray processes this tool started, workers and head in parallel; per-node report."""
    cmds = {c.ip: c for c in cluster_commands(cfg, force=force)}
    container = str(cfg.get("V4_CONTAINER", "") or "")

    def stop(n: Node) -> dict:
        c = cmds[n.name]
        box = container_state(cfg, n) if container else None
        if box and box["state"] == "error":
            return {"node": n.name, "ok": False, "error": box["error"], "container": "error"}
        if box is None or (box["state"] == "running" and box["ours"]):
            r = n.run(c.stop, timeout=120)
            rep = json.loads(r.stdout.strip().splitlines()[-1]) if r.ok and r.stdout.strip() else {}
            ok, errors = r.ok and not rep.get("remaining"), [] if r.ok else [r.tail(8)]
        else:
            # No container, a stopped one, or someone else's: nothing v4 started runs in it (and `docker exec`
            # into a removed container would fail, so a second `down` would).
            rep, ok, errors = {"recorded": False, "stopped": [], "killed": [], "remaining": []}, True, []
        if box:
            rep["container"] = box["state"] if box["ours"] or box["state"] == "absent" else "not v4's"
            if box["state"] != "absent":
                rm = n.host().run(c.container_rm, timeout=120)
                rep["container_removed"] = rm.ok and box["ours"]
                if not rm.ok:
                    ok = False
                    errors.append(f"removing container {container}: rc {rm.rc}: {rm.tail(4)}")
        if ok:
            # `up` wrote it on the host before `ray start`: with Ray gone, `v4 cluster token` must not print it.
            t = _remove_token(cfg, n)
            if not t.ok:
                ok = False
                errors.append(f"removing {auth_token_path(cfg, n.name)}: {t.tail(3)}")
        rep.update(node=n.name, ok=ok, error="; ".join(errors))
        return rep

    with opened(cfg, nodes) as nodes:
        reports = fan_out(nodes, stop, on_error=lambda n, e: {"node": n.name, "ok": False,
                                                              "error": f"{type(e).__name__}: {e}"})
        if cfg["V4_REDIS_HOST"] and reports[0]["ok"]:
            reports[0].update(_forget_in_redis(cfg, nodes[0], progress))
    for rep in reports:
        if not rep["ok"]:
            progress(f"{rep['node']}: stop failed: {rep.get('error') or 'still running: %s' % rep.get('remaining')}")
        elif not rep.get("recorded"):
            progress(f"{rep['node']}: no Ray started by v4 here"
                     + {"absent": f" (no container {container})", "not v4's": f" (container {container} is not v4's: "
                        "left alone)"}.get(rep.get("container", ""), ""))
        else:
            killed = rep.get("killed") or []
            progress(f"{rep['node']}: stopped {len(rep['stopped'])} recorded Ray process(es)"
                     + (f"; SIGKILL for {', '.join(sorted({k['name'] for k in killed}))}" if killed else ""))
    return reports
