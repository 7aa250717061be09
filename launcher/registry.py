"""The run registry: one directory per run under V4_OUT, written atomically, readable by scripts.

    V4_OUT/<run id>/
      run.json             id, status (running | passed | failed | stopped), times, error, exit code
      manifest.json        resolved config + provenance, code version, packages and facts per node,
                           command line, redacted environment
      plan.json            what was planned (the same Plan `--dry-run` prints)
      preflight.json       check results
      steps/<name>/status.json, steps/<name>/log     per step; job submission ids live here
      metrics.jsonl, gates.json, summary.json        written by the jobs / the pipeline

Run ids are PREFIX-YYYYmmdd-HHMMSS-xxxx (sortable by time, unique by the random suffix).
"""
from __future__ import annotations

import json
import os
import re
import secrets
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, is_dataclass
from pathlib import Path
from typing import Any

from dsv4.fileio import atomic_write
from launcher.config.schema import KEYS
from launcher.errors import ConfigError

RUN_ID_RE = re.compile(r"^(?P<prefix>[A-Za-z0-9_.]+(?:-[A-Za-z0-9_.]+)*?)-(?P<ts>\d{8}-\d{6})-(?P<rand>[0-9a-f]{4})$")
FINAL = ("passed", "failed", "stopped")
SECRET_NAME = re.compile(r"(PASSWORD|TOKEN|SECRET|CREDENTIAL|_KEY$|^KEY$|AUTH)", re.I)
ENV_PREFIXES = ("V4_", "HW_", "PRESET_", "NCCL_", "GLOO_", "CUDA_", "NVIDIA_", "RAY_", "TORCH", "PYTORCH_",
                "TL_", "TILELANG_", "HF_", "OMP_", "MASTER_", "WORLD_", "PYTHON", "VIRTUAL_ENV", "PATH",
                "LD_LIBRARY_PATH", "http_proxy", "https_proxy", "no_proxy", "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY")


def new_run_id(prefix: str = "run") -> str:
    return f"{prefix}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"


def _jsonable(obj: Any) -> Any:
    if is_dataclass(obj) and not isinstance(obj, type):
        return asdict(obj)
    if isinstance(obj, Path):
        return str(obj)
    if hasattr(obj, "to_json"):
        return obj.to_json()
    raise TypeError(f"not JSON serializable: {type(obj).__name__}")


def redact_env(environ: dict[str, str]) -> dict[str, str]:
    """The environment variables that shape a run, with secrets (and proxy passwords) hidden."""
    out = {}
    for k in sorted(environ):
        if not k.startswith(ENV_PREFIXES):
            continue
        v = environ[k]
        if SECRET_NAME.search(k) and v:
            v = "***"
        out[k] = re.sub(r"://[^/@\s]+@", "://***@", v)     # user:password@ in proxy URLs
    return out


def code_version(root: Path) -> dict:
    """git sha and whether the tree has uncommitted changes (and which files), or why unknown."""
    def git(*args):
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=20)
    try:
        sha = git("rev-parse", "HEAD")
        if sha.returncode:
            return {"sha": None, "dirty": None, "error": sha.stderr.strip()[-200:]}
        status = git("status", "--porcelain", "--untracked-files=no").stdout.splitlines()
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"sha": None, "dirty": None, "error": str(e)}
    return {"sha": sha.stdout.strip(), "dirty": bool(status), "changed": [line[3:] for line in status][:200]}


@dataclass
class Run:
    id: str
    dir: Path

    # files

    def path(self, name: str) -> Path:
        return self.dir / name

    def write_json(self, name: str, obj: Any, private: bool = False) -> Path:
        p = self.path(name)
        atomic_write(p, json.dumps(obj, indent=2, default=_jsonable) + "\n", private=private)
        return p

    def read_json(self, name: str, default: Any = None) -> Any:
        try:
            return json.loads(self.path(name).read_text())
        except FileNotFoundError:
            return default

    @property
    def metrics_path(self) -> Path:
        return self.path("metrics.jsonl")

    # run state

    def info(self) -> dict:
        return self.read_json("run.json", {})

    def update(self, **fields) -> dict:
        info = {**self.info(), **fields, "updated_at": time.time()}
        self.write_json("run.json", info)
        return info

    def finish(self, status: str, error: str | None = None, code: int | None = None) -> dict:
        assert status in FINAL, status
        if self.stopped:
            # stopped on purpose (`v4 runs stop`): a job failing because of it, or a launcher finishing a step
            # after it, must not turn the run back into failed or passed. Only --resume reopens it (open_run).
            return self.info()
        return self.update(status=status, finished_at=time.time(), error=error, exit_code=code)

    @property
    def stopped(self) -> bool:
        """Re-read from disk: `v4 runs stop` runs in another process."""
        return self.info().get("status") == "stopped"

    # steps

    def step_dir(self, name: str) -> Path:
        return self.dir / "steps" / name

    def step_log(self, name: str) -> Path:
        return self.step_dir(name) / "log"

    def step_status(self, name: str) -> dict:
        return self.read_json(f"steps/{name}/status.json", {})

    def set_step(self, name: str, status: str, **info) -> dict:
        """Record step `name` as `status` (running | done | failed | stopped | skipped | interrupted), merging `info`
        into what is recorded. `interrupted`: the launcher was stopped (Ctrl-C, SIGTERM) while the step ran; its
        job may still be alive, and `--resume` asks about it before anything else (pipeline.resume_action)."""
        now = time.time()
        old = self.step_status(name)
        new = {**old, **info, "name": name, "status": status, "updated_at": now}
        if status == "running" and old.get("status") != "running" and "started_at" not in info:
            new["started_at"] = now          # given: a resume following the job an earlier attempt started
        if status in ("done", "failed", "stopped", "skipped", "interrupted"):
            new["finished_at"] = now
        if info.get("submission_id"):
            ids = old.get("submission_ids", [])
            new["submission_ids"] = ids + [info["submission_id"]] if info["submission_id"] not in ids else ids
        self.write_json(f"steps/{name}/status.json", new)
        return new

    def steps(self) -> list[dict]:
        """Every step's status, in the order the plan lists them (then any others)."""
        plan = self.read_json("plan.json", {}) or {}
        order = [s["name"] for s in plan.get("steps", [])]
        d = self.dir / "steps"
        have = {p.name: self.step_status(p.name) for p in sorted(d.iterdir())} if d.is_dir() else {}
        names = [n for n in order if n in have] + [n for n in have if n not in order]
        return [have[n] for n in names]

    def record_preflight(self, results) -> None:
        """preflight.json, and the node facts it gathered into the manifest (packages per node, ...)."""
        self.write_json("preflight.json", [asdict(r) for r in results])
        facts = getattr(results, "facts", None)
        if facts:
            m = self.read_json("manifest.json", {})
            m["nodes"] = {node: node_summary(f) for node, f in facts.items()}
            self.write_json("manifest.json", m)


def node_summary(f: dict) -> dict:
    """The manifest's view of one node's facts: what could change a result."""
    g = f.get("gpu", {})
    return {"hostname": f.get("hostname"), "python": f.get("python"), "python_executable": f.get("python_executable"),
            "packages": f.get("packages"), "sglang": f.get("sglang"), "gpus": [x["name"] for x in g.get("gpus", [])],
            "driver": g.get("driver"), "cuda": g.get("cuda"), "memlock": f.get("memlock"),
            "socket_ifname": (f.get("net") or {}).get("default_if"),
            "ib": [d["device"] for d in f.get("ib", [])]}


def out_dir(cfg) -> Path:
    return Path(str(cfg["V4_OUT"]))        # absolute: the config checks refuse anything else


def create_run(cfg, plan=None, argv: list[str] | None = None, run_id: str | None = None,
               prefix: str | None = None) -> Run:
    """A new run directory with run.json, manifest.json and (given a plan) plan.json."""
    run_id = run_id or (plan.run_id if plan is not None else new_run_id(prefix or cfg.get("PRESET_RUN_ID_PREFIX", "run")))
    if not RUN_ID_RE.match(run_id):
        raise ConfigError(f"run id {run_id!r} is not PREFIX-YYYYmmdd-HHMMSS-xxxx")
    run = Run(run_id, out_dir(cfg) / run_id)
    run.dir.mkdir(parents=True, exist_ok=False)
    sel = cfg.selection
    run.write_json("run.json", {
        "id": run_id, "status": "running", "created_at": time.time(), "updated_at": time.time(),
        "cluster": str(cfg["V4_CLUSTER_NAME"]), "selection": {"cluster": sel.cluster, "hw": sel.hw, "preset": sel.preset},
        "stage": cfg.get("PRESET_STAGE", ""), "launcher": {"host": socket.gethostname(), "pid": os.getpid()}})
    run.write_json("manifest.json", {
        "schema": 1, "run_id": run_id, "created_at": time.time(),
        "command_line": redact_argv(argv) if argv is not None else None,
        "config": cfg.to_json(),
        "code": code_version(Path(sel.root)),
        "launcher_python": {"executable": sys.executable, "version": sys.version.split()[0]},
        "nodes": None,                                    # filled from preflight (record_preflight)
        "env": redact_env(dict(os.environ)),
    })
    if plan is not None:
        run.write_json("plan.json", plan.to_json())
    return run


def redact_argv(argv: list[str]) -> list[str]:
    """A command line as it may be saved: the value of every secret `--set KEY=VALUE` replaced by ***."""
    from launcher.config.resolve import redact_set

    out, after_set = [], False
    for arg in argv:
        if after_set:
            arg = redact_set(arg)
        elif arg.startswith("--set="):
            arg = "--set=" + redact_set(arg[len("--set="):])
        out.append(arg)
        after_set = arg == "--set"
    return out


# A resumed run is judged afresh: an earlier attempt's verdict must not show as this attempt's.
STALE_ON_RESUME = ("gates.json", "summary.json")


# What a run computes: changed on --resume, the steps it finished (data, checkpoints, metrics) would not be the ones
# the rest of it builds on. Every preset key but the operational ones, and what sets the world and the data.
RESUME_SAME = tuple(k.name for k in KEYS if k.layer == "preset"
                    and k.name not in ("PRESET_JOB_TIMEOUT", "PRESET_STRICT_PREFLIGHT", "PRESET_RUN_ID_PREFIX",
                                       "PRESET_NONFINITE_LOCATE", "PRESET_HANG_TIMEOUT", "PRESET_MAX_RESTARTS")) + (
    "V4_NUM_NODES", "V4_NUM_GPUS_PER_NODE", "HW_DEVICE", "V4_SFT_DATA")


def resume_conflicts(run: "Run", cfg) -> list[str]:
    """`KEY: was -> now` for each RESUME_SAME key on which `cfg` differs from the config the run was made with."""
    was = (run.read_json("config.json") or {}).get("values") or {}
    now = json.loads(json.dumps(cfg.job_values(), default=str))
    shown = lambda k, v: "***" if cfg.is_secret(k) else repr(v)       # a value may have taken in a secret
    return [f"{k}: {shown(k, was[k])} -> {shown(k, now.get(k))}" for k in RESUME_SAME if k in was and was[k] != now.get(k)]


def open_run(cfg, plan=None, force: bool = False) -> Run:
    """An existing run, for --resume: the plan's run id must already have a directory. Refused while another
    launcher on this host still drives it, and (unless `force`) when the configuration would change what it
    computes."""
    run = find_run(cfg, plan.run_id if plan is not None else "")
    info = run.info()
    la = info.get("launcher") or {}
    if (info.get("status") == "running" and la.get("host") == socket.gethostname() and la.get("pid") != os.getpid()
            and la.get("pid") and _pid_alive(la["pid"])):
        raise ConfigError(f"run {run.id} is still driven by launcher pid {la['pid']} on this host: a second one would "
                          "run its steps twice", fix=f"wait for it, or `v4 runs stop {run.id}` first")
    conflicts = resume_conflicts(run, cfg)
    if conflicts and not force:
        raise ConfigError(f"--resume {run.id} with another configuration than it was made with: "
                          + "; ".join(conflicts[:6]) + ("; ..." if len(conflicts) > 6 else ""),
                          fix="resume with the run's own --preset/--env-file/--set (its manifest.json has the command "
                              "line), start a new run for the new values, or pass --force to continue it with them")
    if conflicts:
        print(f"warning: --force: run {run.id} continues with changed settings: {'; '.join(conflicts)}",
              file=sys.stderr)
    for name in STALE_ON_RESUME:
        run.path(name).unlink(missing_ok=True)
    run.update(status="running", resumed_at=time.time(), finished_at=None, error=None, exit_code=None,
               launcher={"host": socket.gethostname(), "pid": os.getpid()})
    return run


def resolve_resume(cfg, ref: str) -> str:
    """The run id `--resume REF` means (an id, a unique prefix of one, or `latest`), before anything is planned:
    the plan's run directory and job ids are built from it."""
    try:
        run = find_run(cfg, ref)
    except ConfigError as e:
        raise ConfigError(f"--resume {ref!r}: {e.message}",
                          fix=f"`v4 runs ls` lists the runs under {out_dir(cfg)}; pass one's id "
                              "(or a unique prefix of it, or `latest`)") from None
    if not RUN_ID_RE.match(run.id):
        raise ConfigError(f"--resume {ref!r}: {run.dir} is not a run directory of this tool "
                          "(ids are PREFIX-YYYYmmdd-HHMMSS-xxxx)", fix="`v4 runs ls` lists the runs")
    return run.id


def find_run(cfg, ref: str) -> Run:
    """A run by id, by a unique prefix of its id, or `latest`."""
    out = out_dir(cfg)
    ids = sorted((p.name for p in out.iterdir() if (p / "run.json").is_file()), key=_sort_key) if out.is_dir() else []
    if ref in ("latest", "last") and ids:
        return Run(ids[-1], out / ids[-1])
    if ref in ids:
        return Run(ref, out / ref)
    hits = [i for i in ids if i.startswith(ref)] if ref else []
    if len(hits) == 1:
        return Run(hits[0], out / hits[0])
    if len(hits) > 1:
        raise ConfigError(f"run {ref!r} is ambiguous: {', '.join(hits[:5])}", fix="give more of the id")
    raise ConfigError(f"no run {ref!r} under {out}", fix="`v4 runs ls` lists the runs")


def _sort_key(run_id: str) -> tuple:
    m = RUN_ID_RE.match(run_id)
    return (m.group("ts"), run_id) if m else ("", run_id)


def list_runs(cfg) -> list[dict]:
    """One summary per run, oldest first."""
    out = out_dir(cfg)
    if not out.is_dir():
        return []
    rows = []
    for name in sorted((p.name for p in out.iterdir() if (p / "run.json").is_file()), key=_sort_key):
        run = Run(name, out / name)
        info = run.info()
        steps = run.steps()
        rows.append({"id": name, "status": effective_status(info), "stage": info.get("stage", ""),
                     "preset": (info.get("selection") or {}).get("preset"), "cluster": info.get("cluster"),
                     "created_at": info.get("created_at"), "finished_at": info.get("finished_at"),
                     "steps_done": sum(s.get("status") == "done" for s in steps), "steps": len(steps),
                     "dir": str(run.dir)})
    return rows


def effective_status(info: dict) -> str:
    """run.json's status, except a `running` run whose launcher process is gone on this host."""
    st = info.get("status", "?")
    la = info.get("launcher") or {}
    if st == "running" and la.get("host") == socket.gethostname() and la.get("pid") and not _pid_alive(la["pid"]):
        return "interrupted"
    return st


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
