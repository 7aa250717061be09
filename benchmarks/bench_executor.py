"""The same job step under the Ray executor and the local one: what its processes see, and how long it takes.

    .venv/bin/python benchmarks/bench_executor.py [--ranks 2] [--mb 256] [--repeat 1] [--with-cap] [--hw cpu] [--json]

Starts a local Ray cluster of its own (free ports, its own V4_LOCAL_DIR and V4_WORK, `v4 cluster down` at the end),
then runs one job step under both executors, the way the pipeline does: a Ray job through the Jobs API
(launcher.jobs.submit_and_wait) and a local subprocess (launcher.pipeline.run_local), each with the environment the
plan gives every job (launcher.plan.job_env); with --with-cap also a Ray job that keeps the OMP_NUM_THREADS Ray sets
(V4_KEEP_RAY_THREAD_CAP=1: how every Ray job ran before dsv4/procenv.py). The step (this file with `--job`) starts
as every job does (jobs.common.RunContext.load), records the facts of its process (thread variables, CPU affinity,
torch's threads, nice level, cgroup CPU limit, Ray's variables, the compile cache), times a CPU workload shaped like
the dequantize and convert steps (FP8 block dequantization into bf16, a bf16 cast, a GEMM: torch's intra-op threads),
then starts `--ranks` ranks through dsv4.megatron.launch (Ray actors under Ray, spawned processes under local; on
`--hw h200` GPU ranks, one a GPU) that record their facts and time the same workload.

Prints the facts side by side (`*`: a variant's value differs from local's) and the seconds of each part, best of
--repeat, with their ratio to local's: job start (submit -> the entrypoint's first line), the first log line the
launcher sees, the entrypoint's workload, rank start (launch -> the last rank running), the ranks' workload (the
slowest rank), the whole job.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "TORCHINDUCTOR_COMPILE_THREADS",
               "CUDA_VISIBLE_DEVICES")
RESULT = "bench_executor.{variant}.json"


# --- inside the job ------------------------------------------------------------------------------

def process_facts() -> dict:
    """What decides how fast this process computes on the CPU (and where its kernels are cached)."""
    import torch
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:                  # not Linux
        affinity = os.cpu_count() or 0
    facts = {k: os.environ.get(k, "-") for k in THREAD_VARS}
    facts.update({
        "cpus (affinity)": affinity,
        "os.cpu_count": os.cpu_count(),
        "torch threads": torch.get_num_threads(),
        "torch interop threads": torch.get_num_interop_threads(),
        "nice": os.getpriority(os.PRIO_PROCESS, 0),
        "cgroup cpu.max": _cgroup_cpu_max(),
        "RAY_* vars": len([k for k in os.environ if k.startswith("RAY_")]),
    })
    for k in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "TILELANG_CACHE_DIR"):
        facts[k] = os.environ.get(k, "-")
    return facts


def _cgroup_cpu_max() -> str:
    try:
        rel = Path("/proc/self/cgroup").read_text().split("\n")[0].split(":", 2)[2]
        return Path("/sys/fs/cgroup", rel.lstrip("/"), "cpu.max").read_text().strip()
    except (OSError, IndexError):
        return "-"


def workload(mb: int) -> dict:
    """Seconds for a dequantize-like and a convert-like pass over `mb` MB of FP8 weights (best of 2)."""
    import torch

    from dsv4.quant import weight_dequant_fp8, weight_quant_fp8
    rows = max(128, (mb << 20) // 4096 // 128 * 128)
    w = torch.randn(rows, 4096)
    q, s = weight_quant_fp8(w)
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    best = {"dequantize_s": float("inf"), "convert_s": float("inf"), "gemm_s": float("inf")}
    for _ in range(2):
        t = time.perf_counter()
        out = weight_dequant_fp8(q, s)
        best["dequantize_s"] = min(best["dequantize_s"], time.perf_counter() - t)
        t = time.perf_counter()
        out.float().mul_(0.5).to(torch.bfloat16)
        best["convert_s"] = min(best["convert_s"], time.perf_counter() - t)
        t = time.perf_counter()
        for _ in range(4):
            a @ b
        best["gemm_s"] = min(best["gemm_s"], time.perf_counter() - t)
    return best


def rank_probe(rank: int, world: int, master_addr: str, master_port: int, payload: dict) -> int:
    """One rank (dsv4.megatron.launch's fn): its facts and the workload, to RUN/ranks/<rank>.json."""
    started = time.time()
    facts = process_facts()
    timings = workload(payload["mb"])
    out = Path(payload["dir"]) / f"{rank}.json"
    out.write_text(json.dumps({"started": started, "facts": facts, "timings": timings}))
    return 0


def job_main(run_dir: Path, variant: str, ranks: int, mb: int, device: str) -> int:
    started = time.time()
    print(f"bench_executor job started at {started:.3f}", flush=True)
    from jobs.common import RunContext
    RunContext.load(run_dir)                  # what every job does first (it sets the entrypoint's threads)
    facts = process_facts()
    timings = workload(mb)
    rank_dir = run_dir / f"ranks-{variant}"
    shutil.rmtree(rank_dir, ignore_errors=True)
    rank_dir.mkdir(parents=True)
    rank_rows = []
    launched = None
    if ranks:
        from dsv4.megatron.launch import launch
        launched = time.time()
        code = launch(rank_probe, ranks, {"dir": str(rank_dir), "mb": mb}, device, log=print,
                      local=not variant.startswith("ray"))
        if code:
            return code
        rank_rows = [json.loads((rank_dir / f"{r}.json").read_text()) for r in range(ranks)]
    (run_dir / RESULT.format(variant=variant)).write_text(json.dumps({
        "started": started, "facts": facts, "timings": timings, "launched": launched, "ranks": rank_rows}))
    return 0


# --- the launcher's side -------------------------------------------------------------------------

def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# name -> (executor, extra job environment)
VARIANTS = {"local": ("local", {}), "ray": ("ray", {}),
            "ray, Ray's cap kept": ("ray", {"V4_KEEP_RAY_THREAD_CAP": "1"})}


def run_once(cfg, variant: str, run_dir: Path, ranks: int, mb: int, tag: str) -> dict:
    """The job as `variant` runs it: the launcher-side timings and what the job recorded."""
    from launcher import jobs, pipeline, plan
    executor, extra = VARIANTS[variant]
    env = {**plan.job_env(cfg, str(run_dir)), "V4_JOB_DRIVER_CPUS": "1", **extra}
    job = plan.JobSpec(
        submission_id=f"bench-executor-{tag}-{os.getpid()}", runtime_env={
            "working_dir": str(ROOT), "excludes": plan.working_dir_excludes(ROOT), "env_vars": env},
        entrypoint=f"{plan.python_on_nodes(cfg)} -m benchmarks.bench_executor --job {run_dir} "
                   f"--variant {shlex.quote(variant)} --ranks {ranks} --mb {mb} --device {cfg['HW_DEVICE']}",
        entrypoint_num_cpus=1, entrypoint_num_gpus=0, timeout_s=600, submit="")
    first_line = []

    def progress(msg: str) -> None:
        if msg.startswith("  | ") and not first_line:
            first_line.append(time.time())

    (run_dir / "config.json").write_text(json.dumps({"values": {"V4_EXECUTOR": executor}}))
    log = run_dir / f"{tag}.log"
    t0 = time.time()
    if executor == "local":
        out = pipeline.run_local(cfg, job, log, progress=progress)
    else:
        out = jobs.submit_and_wait(cfg, job, log_path=log, progress=progress)
    t1 = time.time()
    if not out.ok:
        raise SystemExit(f"the {variant} job failed ({out.status}, exit {out.exit_code}):\n{out.log_tail}")
    rec = json.loads((run_dir / RESULT.format(variant=variant)).read_text())
    rec["submitted"], rec["ended"] = t0, t1
    rec["first_line"] = first_line[0] if first_line else None
    return rec


def summarize(rec: dict) -> dict:
    """Seconds of each part of one job's run (see the module docstring)."""
    ranks = rec["ranks"]
    row = {
        "job start (submit -> entrypoint)": rec["started"] - rec["submitted"],
        "first log line at the launcher": (rec["first_line"] or rec["ended"]) - rec["submitted"],
        "entrypoint dequantize": rec["timings"]["dequantize_s"],
        "entrypoint convert": rec["timings"]["convert_s"],
        "entrypoint gemm": rec["timings"]["gemm_s"],
    }
    if ranks:
        row["rank start (launch -> last rank running)"] = max(r["started"] for r in ranks) - rec["launched"]
        for part in ("dequantize", "convert", "gemm"):
            row[f"rank {part} (slowest)"] = max(r["timings"][f"{part}_s"] for r in ranks)
    row["whole job"] = rec["ended"] - rec["submitted"]
    return row


def facts_table(recs: dict[str, dict], work: Path) -> list[list[str]]:
    """[mark, fact, value under each variant]; mark `*` where a variant's value differs from local's."""
    def short(v) -> str:
        v = str(v).replace(str(work), "$V4_WORK")
        return re.sub(r"\$V4_WORK/compile-cache/[^/]+/", "$CACHE/", v)    # the key: one row of its own

    first = next(iter(recs.values()))
    procs = [("entrypoint", lambda r: r["facts"])]
    procs += [(f"rank {i}", lambda r, i=i: r["ranks"][i]["facts"]) for i in range(len(first["ranks"]))]
    rows = []
    for who, get in procs:
        for k in get(first):
            vals = [short(get(r)[k]) for r in recs.values()]
            rows.append(["*" if len(set(vals)) > 1 else " ", f"{who}: {k}", *vals])
    cache = first["ranks"][0]["facts"].get("TILELANG_CACHE_DIR", "-") if first["ranks"] else "-"
    if cache != "-":
        rows.append([" ", "$CACHE = $V4_COMPILE_CACHE/", *[Path(cache).parent.name] * len(recs)])
    return rows


def start_ray(tmp: Path, hw: str, cpus: int):
    from launcher import cluster
    from launcher.config import Selection, resolve
    local = Path(f"/tmp/v4bx-{os.getpid()}")      # short: Ray's AF_UNIX socket paths live below it
    sets = (f"V4_RAY_PORT={_free_port()}", f"V4_DASHBOARD_PORT={_free_port()}", f"V4_RAY_CLIENT_PORT={_free_port()}",
            f"V4_LOCAL_DIR={local}", f"V4_RAY_NUM_CPUS={cpus}", f"V4_WORK={tmp}")
    cfg = resolve(Selection(cluster="local", hw=hw, sets=sets))
    say = lambda m: print(m, file=sys.stderr, flush=True)
    st = cluster.up(cfg, progress=say)
    if not st.healthy:
        raise SystemExit(f"the local Ray cluster did not come up: {st}")
    return cfg, local


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2, help="ranks the step starts through dsv4.megatron.launch (0: none)")
    ap.add_argument("--mb", type=int, default=256, help="MB of FP8 weights the workload dequantizes")
    ap.add_argument("--repeat", type=int, default=1, help="runs of each variant, alternating (the best counts)")
    ap.add_argument("--hw", default="cpu", help="hardware layer (h200: GPU ranks, one a GPU, as a training step's)")
    ap.add_argument("--with-cap", action="store_true",
                    help="also run the Ray job with Ray's OMP_NUM_THREADS cap left in place (as before the fix)")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON on stdout")
    ap.add_argument("--job", type=Path, help=argparse.SUPPRESS)          # inside the job: its run directory
    ap.add_argument("--variant", default="local", help=argparse.SUPPRESS)
    ap.add_argument("--device", default="cpu", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.job:
        sys.exit(job_main(a.job, a.variant, a.ranks, a.mb, a.device))

    from launcher import cluster
    from launcher.pipeline import quiet_ray_sdk, signals_as_interrupt
    quiet_ray_sdk()
    variants = [v for v in VARIANTS if a.with_cap or "cap" not in v]
    tmp = Path(tempfile.mkdtemp(prefix="v4-bench-executor-"))
    # SIGTERM (`timeout`, a scheduler) as Ctrl-C, so the finally below stops the bench's own Ray cluster: killed
    # without it, its cluster stayed up after the bench was gone, beside whatever ran next
    with signals_as_interrupt():
        cfg, local = start_ray(tmp, a.hw, cpus=a.ranks + 1)
        try:
            runs: dict[str, list[dict]] = {v: [] for v in variants}
            for i in range(a.repeat):
                for n, v in enumerate(variants):
                    run_dir = tmp / "runs" / f"{n}-{i}"
                    run_dir.mkdir(parents=True)
                    runs[v].append(run_once(cfg, v, run_dir, a.ranks, a.mb, f"{n}-{i}"))
        finally:
            cluster.down(cfg)
            shutil.rmtree(local, ignore_errors=True)
            shutil.rmtree(tmp, ignore_errors=True)
    parts = {v: [summarize(r) for r in rs] for v, rs in runs.items()}
    best = {v: {k: min(p[k] for p in ps) for k in ps[0]} for v, ps in parts.items()}
    facts = facts_table({v: rs[-1] for v, rs in runs.items()}, tmp)
    head = {"cpus": os.cpu_count(), "physical_cores": _cores(), "ranks": a.ranks, "mb": a.mb, "hw": a.hw,
            "repeat": a.repeat}
    if a.json:
        print(json.dumps({**head, "seconds": best, "runs": parts, "facts": facts}, indent=2))
        return
    print(f"{head['cpus']} CPUs ({head['physical_cores']} physical cores) here, hw {a.hw}, {a.ranks} rank(s), "
          f"workload {a.mb} MB of FP8 weights; best of {a.repeat}")
    widths = [max(len(r[i]) for r in facts) for i in range(1, len(variants) + 2)]
    print("\n  " + "  ".join(f"{h:>{w}}" if i else f"{h:<{w}}"
                              for i, (h, w) in enumerate(zip(["fact (* differs)", *variants], widths))))
    for mark, *cells in facts:
        print(f"{mark} " + "  ".join(f"{c:>{w}}" if i else f"{c:<{w}}" for i, (c, w) in enumerate(zip(cells, widths))))
    w = max(len(k) for k in best["local"])
    others = [v for v in variants if v != "local"]
    print(f"\n{'seconds':<{w}}  {'local':>8}" + "".join(f"  {v:>{max(8, len(v))}}  {'/local':>6}" for v in others))
    for k in best["local"]:
        lv = best["local"][k]
        cells = "".join(f"  {best[v][k]:>{max(8, len(v))}.3f}  {best[v][k] / lv if lv > 0 else float('nan'):6.2f}"
                        for v in others)
        print(f"{k:<{w}}  {lv:8.3f}{cells}")


def _cores() -> int:
    from dsv4.procenv import physical_cores
    return physical_cores()


if __name__ == "__main__":
    main()
