"""The staged NaN bisect: from a run that stopped with exit 16 to the switch that cures it.

A training step that goes non-finite keeps a capture (`steps/train/nan_capture.json`: the checkpoint the step
started from, the step, its rows by hash). Every rung here is a real job, `python -m jobs.nan_replay`, that loads
that checkpoint, rebuilds the step's batch from the run's data order and runs forward and backward once with some
switches flipped; nothing is downloaded, dequantized or converted again. The ladder:

1. **Reproduce** with no switch. Not finite: reproduced, with the forensics of the first non-finite tensor.
   Finite: stop and say so (the fault needs something the capture does not hold).
2. **Each applicable switch alone** (in parallel where there is room): the TileLang kernels -> torch, the FP8/FP4
   quantisation points off, bf16 -> fp32, recompute off, the parallel layout -> one process, the offending sample
   removed. Any that cures alone is a culprit.
3. Else **all of them together** must cure, and a delta-debugging pass drops switches one at a time while the
   rest still cure (as the kernel bisector minimises pass configs): the smallest set that cures.
4. A sample culprit is confirmed alone (every row a copy of it); a kernel culprit goes to the kernel bisector
   (`v4 nan bisect-kernel`) at the step's attention shape when this machine has a GPU and TileLang.

The report (report.md + report.json) names the culprit, the forensics and every rung with its time.

A culprit is only worth its data: the reproduction checks the step's rows against the capture's hashes, and where
the data file changed since the run the bisect stops there (exit 2, naming the rows) unless told
`allow_changed_data`, and then the report says on what it was found. An attempt that could not replay the step at
all (a truncated checkpoint, a crash) leaves an earlier report where it is.
"""
from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SWITCHES = {
    "attn_torch": "the TileLang attention and indexer kernels (replayed with the torch reference)",
    "fp8_off": "the FP8/FP4 quantisation points (replayed without them)",
    "fp32": "bf16 precision (replayed in fp32)",
    "recompute_off": "activation recompute (replayed without it)",
    "layout_1": "the parallel layout (replayed in one process)",
    "sample": "one sample of the step (replayed without it)",
}

OK, NO_CULPRIT, USAGE = 0, 1, 2


@dataclass
class RungResult:
    name: str
    switches: list[str]
    sample: dict | None
    finite: bool | None = None        # None: the rung failed to run
    seconds: float = 0.0
    result: dict = field(default_factory=dict)
    error: str = ""


@dataclass
class Report:
    run: str
    step: int
    reproduced: bool
    verdict: str
    culprit: list[str] = field(default_factory=list)
    culprit_text: str = ""
    forensics: dict = field(default_factory=dict)
    candidates: list[str] = field(default_factory=list)
    rungs: list[RungResult] = field(default_factory=list)
    sample: dict | None = None
    kernel: dict | None = None
    joint: bool = False               # the culprit switches cure only together (else: each one alone)
    left_out: dict = field(default_factory=dict)    # switch -> why it could not run here
    cut_layers: int | None = None     # layout_1 ran on the first cut_layers layers (the whole model outgrows a GPU)
    seconds: float = 0.0
    exit_code: int = NO_CULPRIT
    replayed: bool = False            # the step was replayed at all (else: no verdict about the fault)
    data_changed_rows: list[int] = field(default_factory=list)   # rows of the step's global batch unlike the capture
    data_changed: bool = False        # the replayed rows are not the captured ones
    allowed_changed_data: bool = False
    fix: str = ""                     # what to do, where the bisect refused or could not run


def one_device_state_gb(m) -> float:
    """Weights, gradients and Adam state of the whole model `m` (a ModelConfig) on one device (the launcher's
    estimate's bytes)."""
    from launcher.config.checks import GRAD_BYTES, OPTIMIZER_BYTES, WEIGHT_BYTES
    per = WEIGHT_BYTES.get(m.dtype, 2) + GRAD_BYTES + OPTIMIZER_BYTES.get(m.dtype, 12)
    return sum(math.prod(sh) for sh in m.param_shapes().values()) * per / 2 ** 30


def forward_layer(forensics: dict) -> int | None:
    """The main layer of the first non-finite forward tensor ("layers.2.attn" -> 2), None if elsewhere or none."""
    m = re.match(r"layers\.(\d+)\b", (forensics.get("forward") or {}).get("module") or "")
    return int(m.group(1)) if m else None


def candidates(cfg: dict, forensics: dict, capture: dict, skipped: dict | None = None,
               memory_gb: float | None = None, plan: dict | None = None) -> list[str]:
    """The switches that can change anything in this run (and, in `skipped`, those that cannot run here, why).
    Decided from the run's values and its ModelConfig alone: the launcher imports neither torch nor megatron.
    `memory_gb`: what one device holds (default: the run's HW_GPU_MEMORY_GB; 0: no limit). Where the whole model
    outgrows it and the fault is a forward one in layer K, the one-process rung keeps layers 0..K only (their
    forward is unchanged by what follows them): `plan["cut_layers"]` = K + 1."""
    skipped = {} if skipped is None else skipped
    plan = {} if plan is None else plan
    from jobs.train_sft import model_config, world_size
    m = model_config(cfg)
    out = []
    if m.attn_impl == "tilelang":
        out.append("attn_torch")
    if m.qat_kv_fp8 or m.qat_indexer_fp4 or m.fp8_gemm_inputs or m.mxfp4_experts:
        out.append("fp8_off")
    if m.dtype == "bf16":
        out.append("fp32")
    if cfg.get("HW_RECOMPUTE_GRANULARITY") == "full":       # what train_config turns into recompute="full"
        out.append("recompute_off")
    if world_size(cfg) > 1:
        limit = cfg.get("HW_GPU_MEMORY_GB") or 0 if memory_gb is None else memory_gb
        need, k = one_device_state_gb(m), forward_layer(forensics)
        if not limit or need <= limit:
            out.append("layout_1")
        elif k is not None and k + 1 < m.n_layers and one_device_state_gb(m.with_overrides(n_layers=k + 1)) <= limit:
            out.append("layout_1")
            plan["cut_layers"] = k + 1
        else:
            why = f"one device cannot hold the model's ~{need:.0f} GB of weights, gradients and optimizer state " \
                  f"({limit:g} GB)"
            why += (f", nor its layers 0..{k}, up to the first non-finite forward tensor" if k is not None else
                    "; the forensics name no forward fault in a main layer to cut the model after")
            skipped["layout_1"] = why
    if sample_of(forensics, capture) is not None and sum(len(r) for r in capture["rows_by_dp_rank"].values()) > 1:
        out.append("sample")
    return out


def sample_of(forensics: dict, capture: dict) -> dict | None:
    """The first row the forensics saw go non-finite, as its row in the captured global batch."""
    for phase in ("forward", "backward"):
        ev = forensics.get(phase)
        if ev and ev.get("rows"):
            per_rank = len(capture["rows_by_dp_rank"][str(ev.get("dp_rank", 0))])
            g = ev["dp_rank"] * per_rank + ev["micro_batch"] * capture["micro_batch_size"] + ev["rows"][0]
            return {"global_row": g, "dp_rank": ev["dp_rank"], "micro_batch": ev["micro_batch"], "row": ev["rows"][0],
                    "rows": ev["rows"], "phase": phase}
    return None


class Ladder:
    """Runs rungs as jobs: Ray jobs on the run's cluster when it ran under the Ray executor (their ranks Ray actors,
    placed by Ray), else processes on this machine, `parallel` at a time (each on its own GPUs when there are)."""

    def __init__(self, run_dir: Path, out: Path, world: int, device: str, parallel: int, timeout: float, log,
                 cfg=None):
        self.run_dir, self.out, self.world, self.timeout, self.log = run_dir, out, world, timeout, log
        self.cut_layers: int | None = None     # what the layout_1 rung keeps of the model (None: all of it)
        self.cfg = cfg
        gpus = _gpu_count() if device == "cuda" else 0
        room = max(1, gpus // max(world, 1)) if device == "cuda" else max(1, (os.cpu_count() or 1) // max(world, 1))
        # Ray places a rung's ranks itself and queues what does not fit: a few in flight at once
        self.parallel = max(1, parallel or 4) if self.cfg is not None else max(1, min(parallel or room, room))
        self.slots = list(range(self.parallel))
        self.gpus = gpus
        self.rungs: list[RungResult] = []

    def run(self, name: str, switches: list[str], sample: dict | None = None, slot: int = 0) -> RungResult:
        d = self.out / "rungs" / name
        d.mkdir(parents=True, exist_ok=True)
        (d / "result.json").unlink(missing_ok=True)
        spec = {"switches": [s for s in switches if s != "sample"]}
        if "sample" in switches or sample:
            spec["sample"] = sample
        if "layout_1" in switches and self.cut_layers:
            spec["cut_layers"] = self.cut_layers
        (d / "rung.json").write_text(json.dumps(spec, indent=2))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        if self.gpus:
            n = 1 if "layout_1" in switches else self.world
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in range(slot * n, slot * n + n))
        t0 = time.perf_counter()
        rr = RungResult(name, list(switches), spec.get("sample"))
        if self.cfg is not None:
            code = self._ray_job(name, d)
        else:
            with open(d / "log", "w") as logf:
                try:
                    p = subprocess.run([sys.executable, "-m", "jobs.nan_replay", "--run-dir", str(self.run_dir),
                                        "--rung-dir", str(d)], cwd=ROOT, env=env, stdout=logf,
                                       stderr=subprocess.STDOUT, timeout=self.timeout)
                    code = p.returncode
                except subprocess.TimeoutExpired:
                    code = 124
        rr.seconds = round(time.perf_counter() - t0, 1)
        if (d / "result.json").is_file():
            rr.result = json.loads((d / "result.json").read_text())
            rr.finite = bool(rr.result["finite"])
        else:
            rr.error = f"exit {code}: {_log_error(d / 'log')} (log: {d / 'log'})"
        self.rungs.append(rr)
        state = "finite" if rr.finite else "non-finite" if rr.finite is False else f"failed: {rr.error}"
        self.log(f"  rung {name:<28} {state:<11} {rr.seconds:6.1f} s")
        return rr

    def _ray_job(self, name: str, d: Path) -> int:
        """The rung as a Ray job on the run's cluster, submitted and followed like a pipeline step."""
        import shlex

        from launcher import jobs
        from launcher.nodes import python_on_nodes
        from launcher.plan import JobSpec, job_env, working_dir_excludes
        cfg, run = self.cfg, str(self.run_dir)
        job = JobSpec(
            submission_id=f"{self.run_dir.name}-nan-{name}-{int(time.time())}",
            entrypoint=f"{shlex.quote(python_on_nodes(cfg))} -m jobs.nan_replay --run-dir {shlex.quote(run)} "
                       f"--rung-dir {shlex.quote(str(d))}",
            runtime_env={"working_dir": str(ROOT), "excludes": working_dir_excludes(ROOT),
                         "env_vars": {**job_env(cfg, run), "V4_JOB_DRIVER_CPUS": "1"}},
            entrypoint_num_cpus=1, entrypoint_num_gpus=0, timeout_s=self.timeout, submit="")
        out = jobs.submit_and_wait(cfg, job, log_path=d / "log", progress=lambda m: None)
        return out.exit_code if out.exit_code is not None else 1

    def run_many(self, specs: list[tuple[str, list[str], dict | None]]) -> list[RungResult]:
        if self.parallel == 1 or len(specs) == 1:
            return [self.run(*s) for s in specs]
        with ThreadPoolExecutor(self.parallel) as pool:
            futs = [pool.submit(self.run, *s, slot=i % self.parallel) for i, s in enumerate(specs)]
            return [f.result() for f in futs]


class BadRun(ValueError):
    """The run directory's own files (config.json) cannot be read: nothing to replay."""


def run_values(run_dir: Path) -> dict:
    """The run's resolved configuration (config.json's values); BadRun where it cannot be read."""
    path = run_dir / "config.json"
    try:
        values = json.loads(path.read_bytes().decode("utf-8"))["values"]
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} not found: {run_dir} is not a run directory of this tool") from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise BadRun(f"{path} cannot be read as a run's configuration ({type(e).__name__}: {e})") from None
    if not isinstance(values, dict):
        raise BadRun(f"{path}: its values are not an object")
    return values


def bisect(run_dir: Path, out: Path, parallel: int = 0, timeout: float = 1800.0, kernel: bool = True,
           log=lambda m: print(m, file=sys.stderr, flush=True), cluster_cfg=None,
           memory_gb: float | None = None, allow_changed_data: bool = False) -> Report:
    """`cluster_cfg`: the launcher's configuration of the run's cluster; with the Ray executor the rungs are Ray
    jobs there. `memory_gb`: what one device holds, for the one-process rung (default: the run's
    HW_GPU_MEMORY_GB). `allow_changed_data`: go on where the replayed rows are not the captured ones.
    FileNotFoundError, BadRun or jobs.nan_capture.CaptureError: nothing to replay."""
    from jobs.nan_capture import load_capture
    from jobs.train_sft import world_size
    t0 = time.perf_counter()
    cfg = run_values(run_dir)
    capture = load_capture(run_dir)
    report = Report(run_dir.name, capture["step"], False, "", allowed_changed_data=allow_changed_data)
    # the rungs run where the run's train step ran: its own executor decides, not this command's
    ladder = Ladder(run_dir, out, world_size(cfg), cfg["HW_DEVICE"], parallel, timeout, log,
                    cluster_cfg if cfg.get("V4_EXECUTOR") == "ray" else None)
    where = "as Ray jobs on the cluster" if ladder.cfg is not None else "as processes on this machine"
    log(f"nan bisect {run_dir.name}: step {capture['step']} from {Path(capture['checkpoint']).name}; rungs {where}, "
        f"{ladder.parallel} at a time")

    def finish(verdict: str, code: int) -> Report:
        report.verdict, report.exit_code = verdict, code
        report.rungs, report.seconds = ladder.rungs, round(time.perf_counter() - t0, 1)
        return report

    base = ladder.run("reproduce", [])
    if base.finite is None:
        report.fix = (f"the rung's log says why ({out / 'rungs' / 'reproduce' / 'log'}); where the capture's "
                      f"checkpoint {capture['checkpoint']} cannot be read (cut short, corrupted), re-run the run to "
                      f"its failing step to capture it again")
        return finish(f"could not replay the step: {base.error}", NO_CULPRIT)
    report.replayed = True
    report.forensics = base.result.get("forensics") or {}
    data_note = ""
    if not base.result.get("data_matches_capture"):
        report.data_changed = True
        report.data_changed_rows = list(base.result.get("data_changed_rows") or [])
        n = sum(len(v) for v in capture["rows_by_dp_rank"].values())
        rows = (f"{len(report.data_changed_rows)} of step {capture['step']}'s {n} rows, "
                f"{_rows_text(report.data_changed_rows, capture)}," if report.data_changed_rows else
                f"step {capture['step']}'s rows")
        changed = (f"{rows} are not the rows the run trained on (their hashes differ from the capture's): "
                   f"{cfg.get('V4_SFT_DATA') or 'the data file'} changed since the run")
        if not allow_changed_data:
            report.replayed = False
            report.fix = ("restore the data the run trained on, or pass --allow-changed-data to bisect on the rows "
                          "as they are now (the report then says so)")
            return finish(f"refused: {changed}; a culprit found on other data would answer for another step",
                          USAGE)
        data_note = f" (on changed data: {changed})"
        log(f"warning: {changed}; going on (--allow-changed-data)")
    if base.finite:
        return finish(f"not reproduced: step {capture['step']} replayed from {capture['checkpoint']} is finite"
                      f"{data_note}; the fault needs something the capture does not hold (another host or GPU, a "
                      f"non-deterministic kernel, an environment variable the run had)", NO_CULPRIT)
    report.reproduced = True
    log(f"reproduced: {_where(report.forensics, base.result, capture['step'])}{data_note}")
    report.sample = sample_of(report.forensics, capture)
    plan: dict = {}
    cands = candidates(cfg, report.forensics, capture, report.left_out, memory_gb, plan)
    report.candidates = cands
    report.cut_layers = ladder.cut_layers = plan.get("cut_layers")
    for name, why in report.left_out.items():
        log(f"  rung {name} left out: {why}")
    if report.cut_layers:
        log(f"  rung layout_1 keeps layers 0..{report.cut_layers - 1}: the whole model outgrows one device")
    if not cands:
        return finish("reproduced; no switch applies to this run (torch kernels, fp32, no FP8, one process, "
                      f"one sample): the forensics are the lead{data_note}", NO_CULPRIT)

    def drop(switches: list[str]) -> dict | None:
        return {"op": "drop", "global_row": report.sample["global_row"]} if "sample" in switches else None

    singles = ladder.run_many([(s, [s], drop([s])) for s in cands])
    failed = [r for r in singles if r.finite is None]
    cures = [r.switches[0] for r in singles if r.finite]
    if not cures:
        if len(cands) == 1 or not ladder.run("all", cands, drop(cands)).finite:
            return finish(_no_cure(cands, failed) + data_note, NO_CULPRIT)
        keep = list(cands)
        for s in cands:                         # drop each switch that the rest can cure without
            trial = [k for k in keep if k != s]
            if trial and ladder.run("without_" + s, trial, drop(trial)).finite:
                keep = trial
        cures, report.joint = keep, True
    report.culprit = cures
    if "sample" in cures:
        alone = ladder.run("sample_alone", [], {"op": "only", "global_row": report.sample["global_row"]})
        report.sample["alone_reproduces"] = alone.finite is False
    report.culprit_text = _culprit_text(cures, report)
    if "attn_torch" in cures and kernel:
        report.kernel = _kernel_handover(cfg, report, out / "kernel", log)
    return finish(f"culprit: {report.culprit_text}{data_note}", OK)


def _log_error(log: Path) -> str:
    """What a failed rung's log says went wrong: its last `error:` line or exception, else its last lines."""
    try:
        lines = [re.sub(r"^\[rank\d+\]:\s*", "", ln) for ln in log.read_text(errors="replace").strip().splitlines()]
    except OSError:
        return "no log"
    for ln in reversed(lines):
        if re.match(r"(error: |([A-Za-z_][\w.]*)?(Error|Exception)\b.*: )", ln):
            return ln.strip()
    return " | ".join(ln.strip() for ln in lines[-5:]) or "empty log"


def _rows_text(rows: list[int], capture: dict) -> str:
    """Global rows of the captured step as "rows 0-2, 5 (data-parallel rank 0 rows 0-2; rank 1 row 1)"."""
    from launcher.compare import ranges
    per = len(capture["rows_by_dp_rank"]["0"])
    by: dict[int, list[int]] = {}
    for g in rows:
        by.setdefault(g // per, []).append(g % per)
    ranks = "; ".join(f"rank {k}: {ranges(v)}" for k, v in sorted(by.items()))
    return f"row{'s' if len(rows) > 1 else ''} {ranges(rows)} (by data-parallel rank, {ranks})"


def _where(forensics: dict, result: dict, step: int) -> str:
    """"layers.1.attn forward output, step 3, rank 0, micro-batch 2, rows [1]"."""
    phase = "forward" if "forward" in forensics else "backward" if "backward" in forensics else None
    if phase is None:
        first = result.get("first") or {}
        return f"{first.get('module')} {first.get('phase')}, step {step} (no forensics event)"
    ev = forensics[phase]
    rows = f", rows {ev['rows']}" if ev.get("rows") else ""
    return f"{ev['module']} {phase} {ev['kind']}, step {step}, rank {ev['rank']}, micro-batch {ev['micro_batch']}{rows}"


def _no_cure(cands: list[str], failed: list[RungResult]) -> str:
    msg = (f"reproduced, but no switch cures it ({', '.join(cands)} tried alone"
           + (" and together" if len(cands) > 1 else "") + "): the fault is in what every rung keeps (the weights "
           "at the capture, the model code, the hardware); the forensics are the lead")
    if failed:
        msg += f"; {len(failed)} rung(s) failed to run: " + "; ".join(f"{r.name}: {r.error}" for r in failed)
    return msg


def _culprit_text(cures: list[str], report: Report) -> str:
    parts = []
    for c in cures:
        text = SWITCHES[c]
        if c == "sample":
            s = report.sample
            text = (f"the sample at row {s['global_row']} of step {report.step} (data-parallel rank {s['dp_rank']}, "
                    f"micro-batch {s['micro_batch']}, row {s['row']})"
                    + ("; alone it reproduces the fault" if s.get("alone_reproduces") else
                       "; alone it does not reproduce it" if "alone_reproduces" in s else ""))
        if c == "layout_1" and report.cut_layers:
            text += f" (the model cut to layers 0..{report.cut_layers - 1}, where the fault is)"
        parts.append(f"{c}: {text}")
    if len(cures) > 1:
        return ("only together: " if report.joint else "each alone cures it: ") + "; ".join(parts)
    return parts[0]


def attention_shape(cfg: dict) -> str:
    """The kernel bisector's B,S,H,D,topk for the run's sparse attention (heads on one TP rank)."""
    from jobs.train_sft import model_config
    m, seq = model_config(cfg), cfg["PRESET_SEQ_LEN"]
    topk = m.window_size + min(m.index_topk, seq // 4)
    return f"{cfg['PRESET_MICRO_BATCH_SIZE']},{seq},{m.n_heads // cfg['PRESET_TP']},{m.head_dim},{topk}"


def _kernel_handover(cfg: dict, report: Report, out: Path, log) -> dict:
    """The kernel bisector at the step's attention shape: which TileLang pass configs (if any) cause it."""
    fwd = "forward" in report.forensics and ".attn" in report.forensics["forward"]["module"]
    kernel = "sparse_attn_fwd" if fwd else "sparse_attn_bwd"
    shape = attention_shape(cfg)
    command = f"v4 nan bisect-kernel --kernel {kernel} --shape {shape}"
    try:
        import torch
        import tilelang  # noqa: F401
        if not torch.cuda.is_available():
            raise ImportError("no CUDA GPU")
    except ImportError as e:
        return {"ran": False, "kernel": kernel, "shape": shape, "command": command,
                "note": f"the kernel bisector needs a GPU with TileLang ({e}); run `{command}` there"}
    from dsv4.kernels import bisect as kb
    from dsv4.kernels import tilelang_sparse_attn as sa
    log(f"handing over to the kernel bisector: {command}")
    settings = dict(sa.BWD_PASS_CONFIGS if kernel == "sparse_attn_bwd" else sa.FWD_PASS_CONFIGS)
    kr = kb.bisect(kernel, kb.Shape.parse(shape), settings, log=log)
    jpath, mpath = kb.write_report(kr, out)
    verdict = (f"culprit: {kb._fmt(kr.culprit)}; smallest failing shape: {kr.smallest_failing_shape}"
               if kr.culprit else kr.culprit_note)
    return {"ran": True, "kernel": kernel, "shape": shape, "command": command, "verdict": verdict,
            "report_md": str(mpath), "report_json": str(jpath)}


def write_report(report: Report, out: Path) -> tuple[Path, Path]:
    from dsv4.fileio import atomic_write
    out.mkdir(parents=True, exist_ok=True)
    jpath, mpath = out / "report.json", out / "report.md"
    atomic_write(jpath, json.dumps(asdict(report), indent=2, default=str))
    lines = [f"# NaN bisect of {report.run}, step {report.step}", "", f"**{report.verdict}**", "",
             f"exit code {report.exit_code}; {report.seconds:.0f} s; switches tried: "
             f"{', '.join(report.candidates) or 'none'}", ""]
    lines += [f"- `{k}` left out: {why}" for k, why in report.left_out.items()] + ([""] if report.left_out else [])
    if report.data_changed:
        rows = f"rows {report.data_changed_rows} of the step's global batch" if report.data_changed_rows else "rows"
        lines += ["## The data changed since the capture", "",
                  f"The replayed {rows} are not the ones the run trained on: their content hashes differ from "
                  "`nan_capture.json`'s. This bisect went on with `--allow-changed-data`: what it found, it found "
                  "on the data as it is now, not on the step that failed.", ""]
    for phase in ("forward", "backward"):
        ev = report.forensics.get(phase)
        if not ev:
            continue
        t = ev.get("output") or ev.get("gradient") or {}
        lines += [f"## First non-finite tensor, {phase}", "",
                  f"- module `{ev['module']}`, {ev['kind']}, rank {ev['rank']} (data-parallel {ev['dp_rank']}), "
                  f"micro-batch {ev['micro_batch']}" + (f", rows {ev['rows']}" if ev.get("rows") else ""),
                  f"- {t.get('shape')} {t.get('dtype')}: {t.get('nan', 0)} NaN, {t.get('posinf', 0)} +Inf, "
                  f"{t.get('neginf', 0)} -Inf of {t.get('numel')}"]
        for i, d in enumerate(ev.get("inputs", [])):
            lines.append(f"- input {i}: {d['shape']} {d['dtype']}, {d['bad']} non-finite, largest |x| "
                         f"{', '.join(f'{v:.4g}' for v in d.get('top_abs', []))}")
        for d in ev.get("params", []):
            lines.append(f"- parameter `{d['name']}`: {d['bad']} non-finite, max |w| {d.get('absmax', float('nan')):.4g}")
        lines.append("")
    lines += ["## Rungs", "", "| rung | switches | sample | result | seconds |", "|---|---|---|---|---|"]
    for r in report.rungs:
        res = "finite" if r.finite else "non-finite" if r.finite is False else f"failed ({r.error})"
        sample = f"{r.sample['op']} row {r.sample['global_row']}" if r.sample else ""
        lines.append(f"| {r.name} | {', '.join(r.switches) or '-'} | {sample} | {res} | {r.seconds:.1f} |")
    if report.kernel:
        k = report.kernel
        lines += ["", "## Kernel", "", f"`{k['command']}`: " + (k.get("verdict", "") if k["ran"] else k["note"])]
        if k.get("report_md"):
            lines.append(f"(report: {k['report_md']})")
    atomic_write(mpath, "\n".join(lines) + "\n")
    return jpath, mpath


def _gpu_count() -> int:
    try:
        import torch
        return torch.cuda.device_count()
    except ImportError:
        return 0
