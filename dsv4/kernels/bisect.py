"""Kernel NaN bisector: which TileLang pass-config setting makes a kernel non-finite or wrong, and at
which smallest shape.

A *setting* is one pass-config assignment (`tl.enable_aggressive_shared_memory_merge=True`). A kernel is
compiled with a set C of them; the empty set means TileLang's defaults. A *trial* compiles the kernel
under a subset of C, runs it on seeded inputs of one shape and compares every output with the
pure-torch reference: non-finite anywhere, or a relative 2-norm error above `tol`, fails the trial.

1. C must fail (else: "not reproduced") and the empty set must pass (else the fault is not a setting);
   both must build (a compile error is no evidence, and is reported as such).
2. Delta debugging (Zeller's ddmin) shrinks C to a 1-minimal failing subset: removing any one of its
   settings makes the failure disappear. That subset is the culprit.
3. A shape sweep runs the culprit at smaller shapes and names the smallest failing one.

Trials run in a worker subprocess (one CUDA context reused across trials); a crash or hang kills only
the worker, counts as a failure of that trial, and a fresh worker takes the next one.

Kernels: built-in `sparse_attn_fwd` / `sparse_attn_bwd` (dsv4.kernels.tilelang_sparse_attn, reference
dsv4.kernels.reference), or any source file with a reference file:
    source:    PASS_CONFIGS = {...}                 # the settings it normally compiles with
               def run(shape: dict, pass_configs: dict) -> dict[str, torch.Tensor]
    reference: def run(shape: dict) -> dict[str, torch.Tensor]      # same keys
`shape` is {"B", "S", "H", "D", "topk", "N"}; both sides must seed their inputs identically.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field

KNOWN_ISSUES = {
    "tl.enable_aggressive_shared_memory_merge": (
        "tile-ai/tilelang#2199: MergeSharedMemoryAllocations ends the lifetime of a buffer loaded before a "
        "pipelined loop at another buffer's first use inside it, so the two share memory (tilelang "
        "0.1.9-0.1.10; fixed by PR #2204 in 0.1.11). Workaround: set it False, or upgrade."),
}
BUILTIN = ("sparse_attn_bwd", "sparse_attn_fwd")


@dataclass(frozen=True)
class Shape:
    B: int
    S: int
    H: int
    D: int
    topk: int

    @property
    def N(self) -> int:
        # V4 layout: S window rows + S/4 compressed rows; always more rows than slots, and one spare row
        return max(self.S + self.S // 4, self.topk + 1)

    @property
    def size(self) -> int:
        return self.B * self.S * self.H * self.topk * self.D

    def as_dict(self) -> dict:
        return {**asdict(self), "N": self.N}

    def __str__(self) -> str:
        return f"B{self.B} S{self.S} H{self.H} D{self.D} topk{self.topk} (N{self.N})"

    @classmethod
    def parse(cls, text: str) -> "Shape":
        parts = text.split(",")
        if len(parts) != 5 or not all(p.strip().isdigit() for p in parts):
            raise ValueError(f"--shape {text!r}: expected B,S,H,D,topk as five positive integers, e.g. 1,256,64,512,640")
        return cls(*(int(p) for p in parts))


@dataclass
class Trial:
    settings: dict
    shape: str
    failed: bool
    verdict: str                  # pass | nonfinite | wrong | crash | error
    metrics: dict = field(default_factory=dict)   # per output: nonfinite fraction, relative error
    detail: str = ""
    seconds: float = 0.0


def parse_setting(text: str) -> tuple[str, object]:
    """KEY=VALUE with KEY a pass-config name (tl.xxx) or PassConfigKey attribute (TL_XXX)."""
    if "=" not in text:
        raise ValueError(f"--set {text!r}: expected KEY=VALUE, e.g. tl.enable_aggressive_shared_memory_merge=true")
    key, raw = (s.strip() for s in text.split("=", 1))
    if key.isupper():
        key = ("tir." if key.startswith("TIR_") else "tl.") + key.split("_", 1)[1].lower()
    low = raw.lower()
    value: object = True if low in ("true", "1", "on") else False if low in ("false", "0", "off") else raw
    if isinstance(value, str) and raw.lstrip("-").isdigit():
        value = int(raw)
    return key, value


# ------------------------------------------------------------------------------------------------ trials
def _compare(outs: dict, refs: dict, tol: float) -> tuple[str, dict]:
    import torch
    metrics, verdict = {}, "pass"
    for name, ref in refs.items():
        got = outs[name].double()
        ref = ref.double()
        nonfinite = (~torch.isfinite(got)).float().mean().item()
        if nonfinite > 0 or not torch.isfinite(ref).all():
            rel = float("nan")
        else:
            rel = ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item()
        metrics[name] = {"nonfinite": nonfinite, "rel_err": rel}
        if nonfinite > 0:
            verdict = "nonfinite"
        elif not rel <= tol and verdict == "pass":       # `not <=` also catches a NaN error
            verdict = "wrong"
    return verdict, metrics


def _builtin_inputs(shape: Shape, seed: int = 0):
    import torch
    g = torch.Generator(device="cpu").manual_seed(seed)
    B, S, H, D, K, N = shape.B, shape.S, shape.H, shape.D, shape.topk, shape.N
    q = torch.randn(B, S, H, D, generator=g).cuda().bfloat16()
    kv = torch.randn(B, N, D, generator=g).cuda().bfloat16()
    sink = torch.randn(H, generator=g).cuda()
    idx = torch.rand(B * S, N, generator=g).argsort(-1)[:, :K].view(B, S, K)
    idx = torch.where(torch.rand(B, S, K, generator=g) < 0.1, -1, idx).cuda().int()
    do = torch.randn(B, S, H, D, generator=g).cuda().bfloat16()
    return q, kv, sink, idx, do


def _run_builtin(kernel: str, shape: Shape, configs: dict) -> tuple[dict, dict]:
    """(kernel outputs, reference outputs). The backward is fed the reference forward (o, lse), so a
    trial isolates the backward kernel."""
    import math
    import torch
    from dsv4.kernels import reference as ref
    from dsv4.kernels import tilelang_sparse_attn as sa
    q, kv, sink, idx, do = _builtin_inputs(shape)
    scale = shape.D ** -0.5
    qp, kvb, sinkp, idxp = sa._pad_inputs(q, kv, sink, idx)
    H = shape.H
    if kernel == "sparse_attn_fwd":
        o, lse2 = sa._fwd(qp, kvb, sinkp, idxp, scale, configs)
        o_ref, lse_ref = ref.sparse_attn_gather_lse(q.float(), kv.float(), sink, idx, scale)
        return {"o": o[:, :, :H], "lse": lse2[:, :, :H] * math.log(2)}, {"o": o_ref, "lse": lse_ref}
    leaves = [t.detach().float().requires_grad_(True) for t in (q, kv, sink)]
    o_ref, lse_ref = ref.sparse_attn_gather_lse(*leaves, idx, scale)
    o_ref.backward(do.float())
    pad = qp.shape[2] - H
    o_p = torch.nn.functional.pad(o_ref.detach().bfloat16(), (0, 0, 0, pad)).contiguous()
    lse2 = torch.nn.functional.pad(lse_ref.detach() / math.log(2), (0, pad)).contiguous()
    dop = torch.nn.functional.pad(do, (0, 0, 0, pad)).contiguous()
    dq, dkv, dsink = sa._bwd(qp, kvb, sinkp, idxp, o_p, lse2, dop, scale, configs)
    return ({"dq": dq[:, :, :H], "dkv": dkv, "dsink": dsink[:H]},
            {"dq": leaves[0].grad, "dkv": leaves[1].grad, "dsink": leaves[2].grad})


def _load(path: str, name: str):
    import importlib.util
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None:
        raise ValueError(f"cannot import {path}: not a Python file")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run_trial(job: dict) -> dict:
    """One trial in this process: {"kernel"|"source"+"reference", "shape": [...], "configs": {...}, "tol"}."""
    import torch
    shape, configs, t0 = Shape(*job["shape"]), job["configs"], time.time()
    try:
        if job.get("source"):
            outs = _load(job["source"], "bisect_source").run(shape.as_dict(), dict(configs))
            refs = _load(job["reference"], "bisect_reference").run(shape.as_dict())
        else:
            outs, refs = _run_builtin(job["kernel"], shape, configs)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        verdict, metrics = _compare(outs, refs, job["tol"])
        return asdict(Trial(configs, str(shape), verdict != "pass", verdict, metrics, seconds=time.time() - t0))
    except Exception as e:                               # a compile error says nothing about the data
        msg = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
        crashed = "CUDA" in msg or "illegal" in msg.lower()
        return asdict(Trial(configs, str(shape), crashed, "crash" if crashed else "error", detail=msg[:500],
                            seconds=time.time() - t0))


def _worker_main() -> None:
    for line in sys.stdin:
        result = run_trial(json.loads(line))
        sys.stdout.write("@@TRIAL " + json.dumps(result) + "\n")
        sys.stdout.flush()
        if result["verdict"] == "crash":                 # the CUDA context is gone; let the parent restart us
            return


class Worker:
    """A subprocess that runs trials; restarted after a crash or a hang."""

    def __init__(self, timeout: float):
        self.timeout, self.proc = timeout, None

    def _start(self):
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen([sys.executable, "-m", "dsv4.kernels.bisect", "--worker"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)

    def run(self, job: dict) -> Trial:
        import select
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        deadline = time.time() + self.timeout
        while time.time() < deadline:
            ready, _, _ = select.select([self.proc.stdout], [], [], max(0.0, deadline - time.time()))
            if not ready:
                break
            line = self.proc.stdout.readline()
            if not line:                                 # the worker died (segfault, abort)
                self.close()
                return Trial(job["configs"], str(Shape(*job["shape"])), True, "crash", detail="worker died")
            if line.startswith("@@TRIAL "):
                return Trial(**json.loads(line[8:]))
        self.close()
        return Trial(job["configs"], str(Shape(*job["shape"])), True, "crash",
                     detail=f"no result within {self.timeout:.0f} s (hang)")

    def close(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None


# ------------------------------------------------------------------------------------------------ search
def ddmin(items: list, fails) -> list:
    """Zeller's ddmin: a 1-minimal subset of `items` for which `fails(subset)` holds (fails(items) must)."""
    n = 2
    while len(items) >= 2:
        chunks = [items[i * len(items) // n:(i + 1) * len(items) // n] for i in range(n)]
        for chunk in chunks:
            if fails(chunk):
                items, n = chunk, 2
                break
        else:
            for chunk in chunks:
                rest = [x for x in items if x not in chunk]
                if fails(rest):
                    items, n = rest, max(n - 1, 2)
                    break
            else:
                if n >= len(items):
                    break
                n = min(len(items), 2 * n)
    return items


def sweep_shapes(shape: Shape) -> list[Shape]:
    """Smaller shapes to try, smallest first: fewer queries, fewer heads, a smaller top-k."""
    out = set()
    for S in sorted({1, 4, 16, 64, shape.S}):
        for H in sorted({min(64, shape.H), shape.H}):
            for K in sorted({min(64, shape.topk), shape.topk}):
                if S <= shape.S:
                    out.add(Shape(1 if S < shape.S else shape.B, S, H, shape.D, K))
    return sorted(out, key=lambda s: (s.size, s.S))


@dataclass
class Report:
    kernel: str
    shape: str
    versions: dict
    settings: dict                 # the set C under test
    reproduced: bool
    baseline: dict                 # the empty set (TileLang defaults)
    culprit: dict | None
    culprit_note: str
    smallest_failing_shape: str | None
    trials: list = field(default_factory=list)
    sweep: list = field(default_factory=list)


def bisect(kernel: str, shape: Shape, settings: dict, *, source: str | None = None, reference: str | None = None,
           tol: float = 5e-2, timeout: float = 600.0, log=print) -> Report:
    worker = Worker(timeout)
    memo: dict[tuple, Trial] = {}
    trials: list[Trial] = []

    def trial(subset: dict, sh: Shape) -> Trial:
        key = (tuple(sorted(subset.items(), key=str)), sh)
        if key not in memo:
            job = {"kernel": kernel, "source": source, "reference": reference, "shape": list(asdict(sh).values()),
                   "configs": subset, "tol": tol}
            memo[key] = t = worker.run(job)
            trials.append(t)
            log(f"  {_fmt(subset):<70} {str(sh):<36} {t.verdict:<9} {_metric_text(t)} ({t.seconds:.1f}s)")
        return memo[key]

    try:
        log(f"bisect {kernel} at {shape}: {len(settings)} settings")
        full, base = trial(settings, shape), trial({}, shape)
        culprit, note, sweep, smallest = None, "", [], None
        broken = next((t for t in (base, full) if t.verdict == "error"), None)
        if broken is not None:          # a build error is no evidence either way: say so, do not bisect
            note = (f"the kernel does not build under {_fmt(broken.settings)} with this TileLang ({broken.detail}): "
                    "nothing to bisect. This package supports tilelang>=0.1.11; to chase a bug of an "
                    "older TileLang, bisect a kernel that builds there (--source/--reference)")
        elif full.failed and not base.failed:
            keys = ddmin(list(settings), lambda ks: trial({k: settings[k] for k in ks}, shape).failed)
            culprit = {k: settings[k] for k in keys}
            note = " ".join(KNOWN_ISSUES.get(k, "") for k in culprit).strip()
            failing = []
            for sh in sweep_shapes(shape):
                t = trial(culprit, sh)
                sweep.append(t)
                if t.failed:
                    failing.append(sh)
            smallest = str(min(failing, key=lambda s: (s.size, s.S))) if failing else str(shape)
        elif not full.failed:
            note = "no failure with these settings at this shape: nothing to bisect"
        else:
            note = "fails under TileLang's defaults too: the fault is not a pass-config setting"
        return Report(kernel if not source else source, str(shape), _versions(), settings, full.failed,
                      asdict(base), culprit, note, smallest, [asdict(t) for t in trials], [asdict(t) for t in sweep])
    finally:
        worker.close()


def _versions() -> dict:
    import importlib.metadata as md
    out = {}
    for pkg in ("tilelang", "apache-tvm-ffi", "torch"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = None
    try:
        import torch
        out["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    except ImportError:
        pass
    return out


def _fmt(subset: dict) -> str:
    return "{" + ", ".join(f"{k}={v}" for k, v in subset.items()) + "}" if subset else "{} (TileLang defaults)"


def _metric_text(t: Trial) -> str:
    if t.detail:
        return t.detail[:80]
    return " ".join(f"{k}: non-finite {m['nonfinite']:.0%} err {m['rel_err']:.1e}" for k, m in t.metrics.items())


def write_report(report: Report, out_dir: str) -> tuple[str, str]:
    os.makedirs(out_dir, exist_ok=True)
    jpath, mpath = os.path.join(out_dir, "report.json"), os.path.join(out_dir, "report.md")
    with open(jpath, "w") as f:
        json.dump(asdict(report), f, indent=2)
    lines = [f"# Kernel NaN bisect: {report.kernel}", "",
             f"- shape: {report.shape}",
             "- versions: " + ", ".join(f"{k} {v}" for k, v in report.versions.items()),
             f"- settings under test: {_fmt(report.settings)}",
             f"- reproduced with all of them: {'yes' if report.reproduced else 'no'}",
             f"- TileLang defaults: {report.baseline['verdict']}", ""]
    if report.culprit:
        lines += [f"## Culprit: {_fmt(report.culprit)}", "", report.culprit_note or "", "",
                  f"Smallest failing shape: **{report.smallest_failing_shape}**", ""]
    else:
        lines += [f"## No culprit setting: {report.culprit_note}", ""]
    lines += ["## Trials", "", "| settings | shape | verdict | per output (non-finite share, relative error) | s |",
              "|---|---|---|---|---|"]
    for t in report.trials:
        lines.append(f"| {_fmt(t['settings'])} | {t['shape']} | {t['verdict']} | {_metric_text(Trial(**t))} | "
                     f"{t['seconds']:.1f} |")
    with open(mpath, "w") as f:
        f.write("\n".join(lines) + "\n")
    return jpath, mpath


if __name__ == "__main__" and sys.argv[1:] == ["--worker"]:
    _worker_main()
