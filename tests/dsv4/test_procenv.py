"""dsv4/procenv.py: a rank's CPU threads and its compile cache, in real processes. TileLang compiles on a GPU-less
machine (the Hopper target is spelled out, dsv4/kernels.tilelang_compile), so the cache is exercised for real here: a
first process compiles a kernel into V4_COMPILE_CACHE, a second one loads it from there and compiles nothing."""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from dsv4 import procenv
from dsv4.procenv import CacheCount, CacheRefused, CacheReport

ROOT = Path(__file__).resolve().parents[2]


def run(code: str, **env) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", procenv.OURS, *procenv.CACHE_VARS.values(),
                                                           procenv.CACHE_ROOT, procenv.CACHE_DIR)}
    e.update(PYTHONPATH=str(ROOT), **env)
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=e, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return p


@pytest.fixture
def clean_env(monkeypatch):
    import torch
    threads = torch.get_num_threads()
    for k in ("OMP_NUM_THREADS", procenv.OURS, procenv.CACHE_ROOT, procenv.CACHE_DIR, *procenv.CACHE_VARS.values()):
        monkeypatch.delenv(k, raising=False)
    yield monkeypatch
    torch.set_num_threads(threads)           # rank_threads sets this process's


def test_physical_cores_are_within_the_affinity():
    assert 1 <= procenv.physical_cores() <= len(os.sched_getaffinity(0))


def test_a_thread_count_the_environment_sets_is_kept():
    # not a Ray worker, nor started by one: whatever OMP_NUM_THREADS it was given is the job's own
    out = run("from dsv4 import procenv; import os; print(procenv.undo_ray_thread_cap(), os.environ['OMP_NUM_THREADS'],"
              " procenv.rank_threads('cuda', 2))", OMP_NUM_THREADS="3")
    assert out.stdout.split() == ["None", "3", "None"]


def test_gpu_ranks_share_the_node_cores(clean_env):
    cores = procenv.physical_cores()
    assert procenv.rank_threads("cuda", 4) == max(1, cores // 4)
    assert os.environ["OMP_NUM_THREADS"] == os.environ[procenv.OURS] == str(max(1, cores // 4))
    assert procenv.ray_thread_cap() is None            # ours, never taken for Ray's
    assert procenv.rank_threads("cuda", 1) == cores     # and ours may be set again
    clean_env.delenv("OMP_NUM_THREADS")
    assert procenv.rank_threads("cpu", 1) is None       # dsv4/megatron/train.py decides for CPU ranks


def test_activate_points_every_compiler_at_one_private_subdirectory(clean_env, tmp_path):
    assert procenv.activate_compile_cache("cpu") is None          # not started by v4: the libraries' defaults
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ
    clean_env.setenv(procenv.CACHE_ROOT, str(tmp_path / "cc"))
    sub = procenv.activate_compile_cache("cpu")
    assert sub == tmp_path / "cc" / procenv.cache_key("cpu")
    assert sub.name.startswith("cpu-torch") and "-triton" in sub.name and "-tilelang" in sub.name
    for kind, var in procenv.CACHE_VARS.items():
        assert os.environ[var] == str(sub / kind) and (sub / kind).is_dir()
    assert os.environ[procenv.CACHE_DIR] == str(sub)
    for d in (sub.parent, sub):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700


def test_a_cache_others_may_write_is_refused(clean_env, tmp_path):
    root = tmp_path / "cc"
    (root / procenv.cache_key("cpu")).mkdir(parents=True)
    root.chmod(0o777)
    clean_env.setenv(procenv.CACHE_ROOT, str(root))
    with pytest.raises(CacheRefused, match=r"may be written by other users .*chmod go-w"):
        procenv.activate_compile_cache("cpu")
    assert "TILELANG_CACHE_DIR" not in os.environ
    root.chmod(0o700)
    if os.getuid() == 0:                                   # root can hand it to someone else
        os.chown(root, 65534, 65534)
        with pytest.raises(CacheRefused, match="belongs to uid 65534"):
            procenv.activate_compile_cache("cpu")


def test_the_report_of_an_empty_and_a_populated_cache(tmp_path):
    empty = CacheReport(CacheCount.of(tmp_path), CacheCount.of(tmp_path))
    assert empty.state == "cold" and empty.metrics() == {"compile_cache": "cold", "compile_cache_entries": 0,
                                                         "compile_cache_new": 0}
    assert empty.line().startswith("compile cache: cold (0 entries; the first step compiled nothing) at ")
    compiled = CacheReport(CacheCount(where="x"), CacheCount(tilelang=3, inductor=2, where="x"))
    assert compiled.state == "cold" and compiled.new == 5 and "the first step compiled 5 more" in compiled.line()
    warm = CacheReport(CacheCount(tilelang=3, inductor=2, triton=4, where="x"),
                       CacheCount(tilelang=3, inductor=2, triton=4, where="x"))
    assert warm.state == "warm"
    assert warm.line() == ("compile cache: warm (9 entries: 3 TileLang, 2 inductor, 4 Triton; the first step compiled "
                           "nothing) at x")
    part = CacheReport(CacheCount(tilelang=3, where="x"), CacheCount(tilelang=5, where="x"))
    assert part.state == "partial" and part.line().startswith("compile cache: partly warm (3 entries")


COMPILE = """
import json, os, time
from dsv4 import procenv
sub = procenv.activate_compile_cache("cpu")
before = procenv.CacheCount.of(sub)
t = time.perf_counter()
from dsv4.kernels import tilelang_compile
from dsv4.kernels.tilelang_act_quant import act_quant_program
tilelang_compile(act_quant_program(256, 128, True, "bfloat16"), [1, 2])
print(json.dumps({"before": before.total, "after": procenv.CacheCount.of(sub).tilelang, "s": time.perf_counter() - t,
                  "dir": os.environ["TILELANG_CACHE_DIR"]}))
"""


@pytest.mark.skipif(importlib.util.find_spec("tilelang") is None or shutil.which("nvcc") is None,
                    reason="needs tilelang and nvcc (TileLang compiles for sm_90a without a GPU)")
def test_a_second_process_loads_the_tilelang_kernel_the_first_compiled(tmp_path):
    root = tmp_path / "cc"
    first = run(COMPILE, V4_COMPILE_CACHE=str(root))
    a = json.loads(first.stdout.splitlines()[-1])
    assert a["before"] == 0 and a["after"] == 1 and a["dir"].startswith(str(root))
    assert "begins to compile kernel `act_quant`" in first.stderr
    second = run(COMPILE, V4_COMPILE_CACHE=str(root))
    b = json.loads(second.stdout.splitlines()[-1])
    assert b["before"] == 1 and b["after"] == 1                  # nothing compiled: the kernel came from the cache
    assert "begins to compile" not in second.stderr
    print(f"TileLang act_quant: {a['s']:.1f} s compiled, {b['s']:.1f} s from the cache")


# A graph of one matmul: inductor keeps it an extern call, so it generates no C++ kernel, and a process takes ~4 s,
# not the ~25 s (miss) and ~17 s (hit) of a pointwise graph's C++ build; its FX graph is cached (and found) the same
INDUCTOR = """
import json, torch
from dsv4 import procenv
sub = procenv.activate_compile_cache("cpu")
f = torch.compile(lambda x: x @ x, dynamic=False)
f(torch.randn(8, 8))
from torch._dynamo.utils import counters
print(json.dumps({**dict(counters["inductor"]), "inductor": procenv.CacheCount.of(sub).inductor}))
"""


def test_a_second_process_hits_the_inductor_graph_the_first_compiled(tmp_path):
    env = dict(V4_COMPILE_CACHE=str(tmp_path / "cc"))
    a = json.loads(run(INDUCTOR, **env).stdout.splitlines()[-1])
    assert a.get("fxgraph_cache_miss") == 1 and a["inductor"] >= 1
    b = json.loads(run(INDUCTOR, **env).stdout.splitlines()[-1])
    assert b.get("fxgraph_cache_hit") == 1 and not b.get("fxgraph_cache_miss") and b["inductor"] == a["inductor"]


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")
def test_a_gpu_rank_keys_its_cache_by_its_gpu(tmp_path):
    code = ("import os, torch; from dsv4 import procenv; sub = procenv.activate_compile_cache('cuda'); "
            "print(sub.name, torch.cuda.current_device(), torch.cuda.get_device_capability())")
    out = run(code, V4_COMPILE_CACHE=str(tmp_path), LOCAL_RANK="0").stdout.split()
    import torch
    major, minor = torch.cuda.get_device_capability(0)
    assert out[0].startswith(f"sm{major}{minor}-") and "-torch" in out[0] and out[1] == "0"
