"""What a job's processes compute with on the CPU and where they keep compiled kernels: the same under either executor.

CPU threads. Ray gives every worker process OMP_NUM_THREADS = the CPUs it reserved when the variable is unset: 1 for a
job's entrypoint (the job supervisor reserves its one CPU) and for each rank actor (one CPU a rank). torch, MKL and
OpenMP then compute on one thread, where the same step under the local executor uses every core (torch's default: one
thread a physical core). On the 16-core H200 host that made the weights, dequantize and convert steps 1.6-2.8x slower
under Ray. `undo_ray_thread_cap` (every job's process, jobs/common.py; every rank, dsv4/megatron/launch.py; the
dequantize step's task a node, jobs/dequantize.py) removes a value Ray put there and only that one: it is in this
process's environment but not in the one its Ray worker process (this one, or the job supervisor that started it) was
started with. An OMP_NUM_THREADS that the job's environment sets (the launcher's shell under the local executor, the
runtime env or the raylet's under Ray) is kept. `rank_threads` then shares a node's physical cores among the GPU ranks
on it (cores // ranks there), under both executors: 8 ranks each with every core's worth of OpenMP threads
oversubscribe the host 8 times in what they do on the CPU (checkpoint copies, data). CPU ranks keep
dsv4/megatron/train.py's rule (cores // (2 x world)).

Compile cache. The first training step compiles the TileLang kernels and the torch.compile regions (inductor, Triton):
100-146 s on a fresh H200 host. `activate_compile_cache` points TileLang (TILELANG_CACHE_DIR), inductor
(TORCHINDUCTOR_CACHE_DIR: its FX-graph and AOT-autograd caches) and Triton (TRITON_CACHE_DIR) at one directory below
V4_COMPILE_CACHE, which lies under V4_WORK (shared by every node), so a later run on any node of the cluster loads the
kernels instead of compiling them. One subdirectory per GPU model and torch / Triton / TileLang version (`cache_key`):
a host with another GPU or other wheels neither reads nor counts entries it cannot use. The directory is created
0700, and one that other users may write is not used (a warning says so): what is in it is loaded as code into every
rank. `CacheCount` counts its entries (TileLang kernels, inductor graphs, Triton kernels) so that the train step can
say whether its first step found the cache cold or warm.
"""
from __future__ import annotations

import os
import re
import stat
import sys
from dataclasses import dataclass, field
from pathlib import Path

THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
# set beside OMP_NUM_THREADS where this module set it: a value of ours is never taken for Ray's
OURS = "V4_CPU_THREADS_SET"
# =1: leave Ray's cap as it is (benchmarks/bench_executor.py --with-cap measures what it costs)
KEEP_CAP = "V4_KEEP_RAY_THREAD_CAP"
CACHE_ROOT = "V4_COMPILE_CACHE"            # the root (config key V4_COMPILE_CACHE, in every job's environment)
CACHE_DIR = "V4_COMPILE_CACHE_DIR"         # the subdirectory this process uses, once activated
CACHE_VARS = {"tilelang": "TILELANG_CACHE_DIR", "inductor": "TORCHINDUCTOR_CACHE_DIR", "triton": "TRITON_CACHE_DIR"}


# --- CPU threads -----------------------------------------------------------------------------------

def physical_cores() -> int:
    """Physical cores among the CPUs this process may run on (its affinity; SMT siblings count once), as torch's own
    default counts them, but within the affinity, which torch's default ignores."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except AttributeError:                     # not Linux
        return os.cpu_count() or 1
    cores = set()
    for cpu in cpus:
        top = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            cores.add(tuple(top.joinpath(f).read_text().strip() for f in ("physical_package_id", "core_id")))
        except OSError:
            cores.add(("cpu", str(cpu)))       # no topology (some containers): every CPU a core
    return max(1, len(cores))


def _exec_env_has(pid: int, name: str) -> bool | None:
    """Whether process `pid` was started with `name` in its environment (/proc/PID/environ is the environment at
    exec, not what its own code set later); None where that cannot be read."""
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    key = name.encode() + b"="
    return any(e.startswith(key) for e in env)


def _parent(pid: int) -> int | None:
    try:
        s = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(s[s.rindex(")") + 2:].split()[1])


def _ray_worker_ancestor(pid: int, depth: int = 8) -> int | None:
    """This process or the nearest ancestor that is a Ray worker (Ray titles them `ray::<Actor>.<method>`): a rank
    actor itself, or the job supervisor above a job's entrypoint (through the shell that runs it)."""
    for _ in range(depth):
        try:
            if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"ray::"):
                return pid
        except OSError:
            return None
        pid = _parent(pid)
        if not pid or pid <= 1:
            return None
    return None


def ray_thread_cap() -> str | None:
    """OMP_NUM_THREADS where Ray set it (the Python of this Ray worker process, or of the job supervisor that
    started this entrypoint), else None: unset, set by the job's environment, or set by this module."""
    value = os.environ.get("OMP_NUM_THREADS")
    if value is None or os.environ.get(OURS) == value or os.environ.get(KEEP_CAP) == "1":
        return None
    worker = _ray_worker_ancestor(os.getpid())
    if worker is None:
        return None
    return value if _exec_env_has(worker, "OMP_NUM_THREADS") is False else None


def undo_ray_thread_cap() -> str | None:
    """Remove the OMP_NUM_THREADS Ray set (see the module docstring) and give torch, if loaded, its default thread
    count back: the process then computes as it would under the local executor. Returns the value removed."""
    value = ray_thread_cap()
    if value is None:
        return None
    os.environ.pop("OMP_NUM_THREADS")
    torch = sys.modules.get("torch")
    if torch is not None:                     # it may have read the cap already (its thread count is lazy)
        torch.set_num_threads(physical_cores())
    return value


def rank_threads(device: str, ranks_here: int) -> int | None:
    """Share this node's physical cores among its `ranks_here` GPU ranks (at least one thread each), under either
    executor: OMP_NUM_THREADS for what the rank starts, torch's threads for itself. None (nothing set) where the
    job's environment sets OMP_NUM_THREADS, and for CPU ranks, which dsv4/megatron/train.py sets itself."""
    if device != "cuda" or ("OMP_NUM_THREADS" in os.environ and os.environ.get(OURS) != os.environ["OMP_NUM_THREADS"]):
        return None
    n = max(1, physical_cores() // max(1, ranks_here))
    os.environ["OMP_NUM_THREADS"] = os.environ[OURS] = str(n)
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(n)
    return n


# --- the compile cache -----------------------------------------------------------------------------

def _version(dist: str) -> str:
    from importlib import metadata
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "none"


def cache_key(device: str) -> str:
    """The subdirectory of this host's entries: GPU model and architecture (or `cpu`), then the torch, Triton and
    TileLang versions (torch's carries its CUDA: 2.11.0+cu130). Kernels compiled for one are no use to another."""
    where = "cpu"
    if device == "cuda":
        import torch
        if torch.cuda.is_available():
            index = int(os.environ.get("LOCAL_RANK", 0)) % max(torch.cuda.device_count(), 1)
            torch.cuda.set_device(index)       # the rank's own GPU (as init_distributed sets it), not GPU 0
            major, minor = torch.cuda.get_device_capability(index)
            where = f"sm{major}{minor}-{torch.cuda.get_device_name(index)}"
    key = f"{where}-torch{_version('torch')}-triton{_version('triton')}-tilelang{_version('tilelang')}"
    return re.sub(r"[^A-Za-z0-9._+-]+", "_", key)


class CacheRefused(Exception):
    """The compile cache directory cannot be used (the message says why and how to fix it)."""


def _private_dir(path: Path) -> None:
    """Create `path` 0700 (and its parent, the cache root, where missing); refuse either where it belongs to another
    user or others may write it: they could put code there that every rank loads."""
    for p in (path.parent, path):
        p.mkdir(parents=True, exist_ok=True, mode=0o700)
        st = p.stat()
        if st.st_uid != os.getuid():
            raise CacheRefused(f"{p} belongs to uid {st.st_uid}, not to this process's uid {os.getuid()}: its owner "
                               "could put code into every rank; point V4_COMPILE_CACHE at a directory of your own")
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise CacheRefused(f"{p} may be written by other users (mode {stat.filemode(st.st_mode)}): what is in it "
                               f"is loaded as code into every rank; `chmod go-w {p}`, or point V4_COMPILE_CACHE at a "
                               "directory of your own")


def activate_compile_cache(device: str) -> Path | None:
    """Point TileLang, inductor and Triton at V4_COMPILE_CACHE/<cache_key>/{tilelang,inductor,triton} (created
    0700) in this process and what it starts; returns that directory. None where V4_COMPILE_CACHE is not set (a
    process not started by v4: the libraries keep their own defaults). Raises CacheRefused for a directory other users
    may write. Must run before anything compiles: the libraries read their variables when they first cache."""
    root = os.environ.get(CACHE_ROOT)
    if not root:
        return None
    sub = Path(root) / cache_key(device)
    _private_dir(sub)
    for kind, var in CACHE_VARS.items():
        (sub / kind).mkdir(exist_ok=True, mode=0o700)
        os.environ[var] = str(sub / kind)
    os.environ[CACHE_DIR] = str(sub)
    return sub


@dataclass(frozen=True)
class CacheCount:
    """Entries of a compile cache directory, by kind."""
    tilelang: int = 0
    inductor: int = 0
    triton: int = 0
    where: str = ""

    @classmethod
    def of(cls, sub: Path | str | None) -> "CacheCount":
        if not sub:
            return cls()
        sub = Path(sub)
        # a TileLang kernel is a directory under <version>/<platform>/kernels/ (its cubins under cuda-binaries/);
        # an inductor graph is a file under fxgraph/ or aotautograd/ (its code files are not entries); a Triton
        # kernel is a directory of the Triton cache
        tl = sum(1 for p in (sub / "tilelang").glob("*/*/kernels/*") if p.is_dir())
        ind = sum(1 for d in ("fxgraph", "aotautograd") for p in (sub / "inductor" / d).rglob("*") if p.is_file())
        tr = sum(1 for p in (sub / "triton").glob("*") if p.is_dir()) if (sub / "triton").is_dir() else 0
        return cls(tl, ind, tr, str(sub))

    @property
    def total(self) -> int:
        return self.tilelang + self.inductor + self.triton

    def parts(self) -> str:
        return f"{self.tilelang} TileLang, {self.inductor} inductor, {self.triton} Triton"


@dataclass(frozen=True)
class CacheReport:
    """What the first step found in the compile cache (`before`) and left there (`after`)."""
    before: CacheCount
    after: CacheCount = field(default_factory=CacheCount)

    @property
    def state(self) -> str:
        """cold: nothing there for this host; warm: entries there, and the first step compiled nothing new;
        partial: entries there, and it compiled more (other shapes or kernels than an earlier run's)."""
        if self.before.total == 0:
            return "cold"
        return "warm" if self.after.total <= self.before.total else "partial"

    @property
    def new(self) -> int:
        return max(0, self.after.total - self.before.total)

    def line(self) -> str:
        word = {"cold": "cold", "warm": "warm", "partial": "partly warm"}[self.state]
        found = f"{self.before.total} entries" + (f": {self.before.parts()}" if self.before.total else "")
        compiled = f"the first step compiled {self.new} more" if self.new else "the first step compiled nothing"
        return f"compile cache: {word} ({found}; {compiled}) at {self.before.where or self.after.where}"

    def metrics(self) -> dict:
        return {"compile_cache": self.state, "compile_cache_entries": self.before.total,
                "compile_cache_new": self.new}
