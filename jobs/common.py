"""What every job shares: its run's resolved config, its step directory, sentinels, metrics.

A job runs as `python -m jobs.<name> --run-dir DIR`, alone or as a Ray job. DIR/config.json is
written by the launcher before the first step: {"values": {KEY: value}} with derived values
(WORLD_SIZE, DP, ATTN_IMPL, CKPT_*_DIR, ...) merged in. Jobs never re-resolve the layer files:
the run directory is the single record of what the run was asked to do.
"""
from __future__ import annotations

import argparse
import atexit
import hashlib
import json
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from dsv4.fileio import atomic_write

SENTINEL = ".v4-done.json"


@dataclass
class RunContext:
    run_dir: Path
    cfg: dict[str, Any]

    @classmethod
    def from_argv(cls, argv: list[str] | None = None, description: str = "") -> "RunContext":
        ap = argparse.ArgumentParser(description=description)
        ap.add_argument("--run-dir", required=True, type=Path, help="the run directory (holds config.json)")
        args = ap.parse_args(argv)
        return cls.load(args.run_dir)

    @classmethod
    def load(cls, run_dir: Path | str) -> "RunContext":
        run_dir = Path(run_dir)
        path = run_dir / "config.json"
        if not path.is_file():
            sys.exit(f"error: {path} not found: the launcher writes it before the first step "
                     f"(run `v4 run ...`, or pass the directory of an existing run)")
        cfg = json.loads(path.read_text())["values"]
        ctx = cls(run_dir, cfg)
        ctx._export_socket_ifname()
        _uncap_threads()
        return ctx

    def step_dir(self, name: str) -> Path:
        d = self.run_dir / "steps" / name
        d.mkdir(parents=True, exist_ok=True)
        return d

    @property
    def metrics_path(self) -> Path:
        return self.run_dir / "metrics.jsonl"

    def write_metrics(self, row: dict) -> None:
        """One step's row: a line of metrics.jsonl, the same numbers as TensorBoard scalars under RUN/tb
        (`tensorboard --logdir V4_OUT` shows every run) and, where V4_WANDB_PROJECT names a project, as a
        Weights & Biases step. W&B is a copy: when it fails, training goes on without it (`_wandb_off`).
        A job's first row supersedes what an earlier job of the run wrote from that step on (it resumed from the
        checkpoint before them: those steps run again) -- moved to metrics.superseded.jsonl, never twice in
        metrics.jsonl. A restarted job's rows carry `restarts`, the run's restarts before it (launcher/recovery.py)."""
        if "step" in row and not getattr(self, "_superseded", False):
            self._superseded = True
            supersede_metrics(self.metrics_path, int(row["step"]))
        restarts = int(os.environ.get("V4_RESTARTS") or 0)
        if restarts:
            row = {**row, "restarts": restarts}
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(row) + "\n")
        scalars = {k: v for k, v in row.items()
                   if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}
        writer = self._tensorboard()
        if writer is not None and "step" in row:
            for k, v in scalars.items():
                writer.add_scalar(k, v, row["step"])
            writer.flush()
        wb = self._wandb()
        if wb is not None and "step" in row:
            try:
                wb.log(scalars, step=int(row["step"]))
            except Exception as e:   # noqa: BLE001 - wandb raises its own errors and OSErrors alike
                self._wandb_off(f"W&B stopped taking this run's metrics at step {row['step']} ({_why(e)})")

    def _tensorboard(self):
        if not hasattr(self, "_tb"):
            try:
                from torch.utils.tensorboard import SummaryWriter
                self._tb = SummaryWriter(log_dir=str(self.run_dir / "tb"))
            except ImportError:              # tensorboard is not installed (a bare GPU host): metrics.jsonl only
                self._tb = None
        return self._tb

    def _wandb(self):
        """The run's W&B run where V4_WANDB_PROJECT is set, created at the first row: id and name the run's
        directory name (a resumed run continues its W&B run), config the run's PRESET_/HW_ values. The API key
        comes from the environment (WANDB_API_KEY) or ~/.netrc, never from a config file; V4_WANDB_MODE=offline
        keeps it under RUN/wandb for a later `wandb sync`. V4_WANDB_TIMEOUT bounds wandb.init (W&B's own default
        waits 90 s for an unreachable server) and the upload at exit (W&B's waits for all of it). Where wandb is not
        installed or does not start, the metrics still reach metrics.jsonl and TensorBoard, with one warning."""
        if not hasattr(self, "_wb"):
            self._wb = None
            if self.cfg.get("V4_WANDB_PROJECT"):
                self._wb = self._wandb_init(self.cfg["V4_WANDB_PROJECT"])
        return self._wb

    def _wandb_init(self, project: str):
        try:
            import wandb
        except ImportError:
            log(f"warning: V4_WANDB_PROJECT={project} but wandb is not installed here "
                f"(pip install 'v4-launcher[wandb]'); metrics go to metrics.jsonl and TensorBoard only")
            return None
        timeout = float(self.cfg.get("V4_WANDB_TIMEOUT") or 30)
        settings = {"init_timeout": timeout, "finish_timeout": timeout}
        if self.cfg.get("V4_WANDB_BASE_URL"):
            settings["base_url"] = self.cfg["V4_WANDB_BASE_URL"]
        run_id = re.sub(r"[^A-Za-z0-9_-]", "-", self.run_dir.name)[:64]
        try:
            run = wandb.init(project=project, id=run_id, name=self.run_dir.name, resume="allow",
                             dir=str(self.run_dir), mode=self.cfg.get("V4_WANDB_MODE") or "online",
                             config={k: v for k, v in self.cfg.items() if k.startswith(("PRESET_", "HW_"))},
                             settings=wandb.Settings(**settings))
        except Exception as e:   # noqa: BLE001 - no key (UsageError), no server (CommError), a bad setting, ...
            self._wandb_off(f"the W&B run for project {project} did not start ({_why(e)})")
            return None
        atexit.register(self._wandb_finish, run)
        return run

    def _wandb_off(self, what: str) -> None:
        """Say once why W&B stopped, and use it no more in this process: it only copies metrics.jsonl."""
        self._wb = None
        log(f"warning: {what}; training goes on, its metrics to {self.metrics_path} and TensorBoard only "
            f"(`v4 preflight --only wandb` checks the key and the server; V4_WANDB_MODE=offline keeps a run under "
            f"{self.run_dir / 'wandb'} for `wandb sync`)")
        try:
            import wandb
            # stops its service now: left to wandb's own exit hook, a broken service prints a traceback there
            wandb.teardown()
        except Exception:   # noqa: BLE001 - the failure was just reported
            pass

    def _wandb_finish(self, run) -> None:
        if self._wb is not run:                 # turned off after a failure
            return
        try:
            run.finish()
        except Exception as e:   # noqa: BLE001
            log(f"warning: the W&B run did not finish ({_why(e)}); what it holds is under {self.run_dir / 'wandb'} "
                "(`wandb sync` uploads it)")

    @property
    def paths(self) -> "Paths":
        c = self.cfg
        return Paths(hf_dir=Path(c["CKPT_HF_DIR"]), bf16_dir=Path(c["CKPT_BF16_DIR"]),
                     torch_dist_dir=Path(c["CKPT_TORCH_DIST"]), data_source=Path(c["PRESET_DATA"]),
                     sft_data=Path(c["V4_SFT_DATA"]), checkpoints=self.run_dir / "checkpoints")

    def _export_socket_ifname(self) -> None:
        # NCCL/Gloo must bind the interface that routes to the other nodes; hard-coding eth0 broke
        # clusters whose default route is elsewhere (and Gloo then bound IPv6 loopback).
        name = self.cfg.get("V4_SOCKET_IFNAME", "auto")
        if name == "auto":
            name = default_route_ifname()
        if name:
            os.environ.setdefault("GLOO_SOCKET_IFNAME", name)
            os.environ.setdefault("NCCL_SOCKET_IFNAME", name)


SUPERSEDED = "metrics.superseded.jsonl"


def supersede_metrics(path: Path, from_step: int) -> int:
    """Move the rows of metrics file `path` at step >= `from_step` (an earlier job's, past the checkpoint this one
    resumed from), and any line that is not a row (a job killed mid-write leaves half a line), to SUPERSEDED beside
    it, each with when and by which attempt; how many lines moved."""
    try:
        lines = [raw for raw in Path(path).read_bytes().split(b"\n") if raw.strip()]
    except FileNotFoundError:
        return 0
    keep, gone = [], []
    for raw in lines:
        try:
            step = json.loads(raw).get("step")
        except (ValueError, AttributeError):
            step = None
        (keep if isinstance(step, int) and not isinstance(step, bool) and step < from_step else gone).append(raw)
    if not gone:
        return 0
    note = {"superseded_at": time.time(), "by_attempt": int(os.environ.get("V4_STEP_ATTEMPT") or 0),
            "resumed_at_step": from_step}
    with open(Path(path).with_name(SUPERSEDED), "a") as f:
        for raw in gone:
            try:
                f.write(json.dumps({**json.loads(raw), **note}) + "\n")
            except (ValueError, TypeError):
                f.write(json.dumps({"line": raw.decode("utf-8", "replace"), **note}) + "\n")
    atomic_write(path, b"\n".join(keep).decode("utf-8", "replace") + ("\n" if keep else ""))
    log(f"metrics: {len(gone)} row(s) from step {from_step} on, written by an earlier job of this run, superseded "
        f"(moved to {Path(path).with_name(SUPERSEDED)})")
    return len(gone)


@dataclass(frozen=True)
class Paths:
    hf_dir: Path
    bf16_dir: Path
    torch_dist_dir: Path
    data_source: Path
    sft_data: Path
    checkpoints: Path


def ranks_local(cfg: dict) -> bool:
    """Whether a step's ranks run as local processes (the local executor: this one machine, no Ray) rather
    than as Ray actors; `dsv4.megatron.launch.launch(local=...)`."""
    return cfg.get("V4_EXECUTOR") == "local"


def _uncap_threads() -> None:
    """A Ray job's entrypoint computes on every core, as under the local executor: Ray starts it with
    OMP_NUM_THREADS=1 (its one reserved CPU), which made the weights, dequantize and convert steps 1.6-2.8x slower on a
    16-core host (dsv4/procenv.py)."""
    from dsv4.procenv import physical_cores, undo_ray_thread_cap
    cap = undo_ray_thread_cap()
    if cap is not None:
        log(f"CPU threads: {physical_cores()} (the OMP_NUM_THREADS={cap} Ray set for this job's entrypoint removed)")


def with_compile_cache(write: Callable[[dict], None], say: Callable[[str], None] | None = None
                       ) -> Callable[[dict], None]:
    """`write` (a train step's metrics sink) with the compile cache's state added to the first row of this job, and
    said in the step log: its entries counted now, before the first step compiles, and again after it
    (dsv4.procenv.CacheReport: cold, warm or partly warm; compile_cache* in the row). Nothing is added where no
    compile cache is active (a job not started by v4, or a cache refused with a warning)."""
    from dsv4.procenv import CACHE_DIR, CacheCount, CacheReport
    sub = os.environ.get(CACHE_DIR)
    if not sub:
        return write
    say = say or log
    before, pending = CacheCount.of(sub), [True]

    def on_metrics(row: dict) -> None:
        if pending and "step" in row:
            pending.clear()
            report = CacheReport(before, CacheCount.of(sub))
            say(report.line())
            row = {**row, **report.metrics()}
        write(row)
    return on_metrics


def default_route_ifname() -> str | None:
    try:
        for line in Path("/proc/net/route").read_text().splitlines()[1:]:
            fields = line.split()
            if len(fields) > 2 and fields[1] == "00000000":
                return fields[0]
    except OSError:
        pass
    return None


# --- sentinels: a finished artifact records what it was made from -------------------------------

def sentinel_path(artifact: Path) -> Path:
    artifact = Path(artifact)
    return artifact / SENTINEL if artifact.is_dir() or not artifact.suffix else artifact.with_name(artifact.name + SENTINEL)


def done(artifact: Path, inputs: dict | None = None) -> bool:
    """True when the artifact is complete and was made from the same inputs."""
    p = sentinel_path(artifact)
    if not p.is_file():
        return False
    if inputs is None:
        return True
    return json.loads(p.read_text()).get("inputs") == _jsonable(inputs)


def mark_done(artifact: Path, inputs: dict | None = None, **info) -> None:
    atomic_write(sentinel_path(artifact), json.dumps({"inputs": _jsonable(inputs or {}), "finished": time.time(), **info},
                                                      indent=2))


def foreign_sft_data(ctx: "RunContext") -> str | None:
    """Why V4_SFT_DATA is not this run's data, or None. It is one path for whatever PRESET_DATA a run has (a
    shared cache): when another run prepared its own source into it since, training on it would silently use
    that run's data."""
    data, source = ctx.paths.sft_data, ctx.paths.data_source
    mark = sentinel_path(data)
    if not mark.is_file():
        return None                      # data put there by hand, not by prepare_data: nothing recorded to compare
    made = json.loads(mark.read_text()).get("inputs", {})
    if made.get("source") == str(source) and (not source.is_file() or made.get("fingerprint") == fingerprint(source)):
        return None
    return (f"V4_SFT_DATA={data} now holds data prepared from {made.get('source')} (fingerprint "
            f"{made.get('fingerprint')}), not from this run's PRESET_DATA={source}: another run prepared its source "
            "into the same file. Give each data source its own V4_SFT_DATA (--set V4_SFT_DATA=...), then run this "
            "one again (a new run, so that prepare_data runs)")


def fingerprint(path: Path) -> str:
    """Content hash of a file (or of a directory's file names, sizes and mtimes)."""
    path = Path(path)
    h = hashlib.sha256()
    if path.is_file():
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    elif path.is_dir():
        for p in sorted(path.rglob("*")):
            if p.is_file() and p.name != SENTINEL:
                st = p.stat()
                h.update(f"{p.relative_to(path)}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def _jsonable(d: dict) -> dict:
    return json.loads(json.dumps(d, default=str))


def _why(e: BaseException) -> str:
    """An exception as one line: its type and the first line of its message."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:300]}" if text else type(e).__name__


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def byte_progress(label: str, every: float = 0.1, unit: str = "MB"):
    """A (done, total, name) callback that logs each `every` fraction of the way; `done`/`total` count bytes
    (unit "MB") or anything else counted in millions (e.g. unit "M params")."""
    state = {"next": 0.0, "t0": time.time()}

    def report(done: int, total: int, name: str) -> None:
        frac = done / total if total else 1.0
        if frac >= state["next"] or done >= total:
            rate = done / max(time.time() - state["t0"], 1e-9) / 1e6
            log(f"{label}: {frac:6.1%} ({done / 1e6:.1f}/{total / 1e6:.1f} {unit}, {rate:.0f} {unit}/s) {name}")
            state["next"] = frac + every
    return report
