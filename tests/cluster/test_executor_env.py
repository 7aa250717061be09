"""A step's processes compute alike under the Ray executor and the local one (issue 43): on a real local Ray, the same
job (benchmarks/bench_executor.py's, two ranks through dsv4.megatron.launch) runs as a Ray job (Ray actors for its
ranks) and as a local subprocess (spawned ranks), each with the environment the plan gives every job. Ray starts the
entrypoint and every actor with OMP_NUM_THREADS=1; v4 removes it (dsv4/procenv.py), so both executors' processes see
the same thread variables, torch threads, CPU affinity and nice level, and their ranks the same compile cache."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import free_port
from launcher import cluster
from launcher.config import Selection, resolve

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_executor as B  # noqa: E402

SAME = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "cpus (affinity)", "torch threads", "torch interop threads", "nice",
        "cgroup cpu.max", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "TILELANG_CACHE_DIR")


@pytest.fixture(scope="module")
def ray_cfg(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("executors")
    local = Path(f"/tmp/v4exe-{tmp.name[-6:]}")          # short: Ray's AF_UNIX socket paths live below it
    sets = (f"V4_RAY_PORT={free_port()}", f"V4_DASHBOARD_PORT={free_port()}", f"V4_RAY_CLIENT_PORT={free_port()}",
            f"V4_LOCAL_DIR={local}", "V4_RAY_NUM_CPUS=3", f"V4_WORK={tmp}")
    cfg = resolve(Selection(cluster="local", hw="cpu", sets=sets))
    assert cluster.up(cfg).healthy
    yield cfg
    cluster.down(cfg)
    subprocess.run(["rm", "-rf", str(local)])


@pytest.mark.slow       # a Ray cluster, two Ray jobs with two actors each, a local job with two ranks: ~60 s
def test_ray_and_local_processes_see_the_same_threads_affinity_and_cache(ray_cfg, tmp_path):
    from dsv4.procenv import cache_key, physical_cores
    got = {}
    for n, variant in enumerate(B.VARIANTS):          # local, ray, and ray with the cap Ray sets left in place
        run_dir = tmp_path / str(n)
        run_dir.mkdir()
        got[variant] = B.run_once(ray_cfg, variant, run_dir, ranks=2, mb=1, tag=str(n))
    local, ray, capped = got.values()
    # what Ray does by itself, and v4 undoes: one thread in the entrypoint and in every actor
    assert capped["facts"]["OMP_NUM_THREADS"] == "1" and capped["facts"]["torch threads"] == 1
    assert [r["facts"]["OMP_NUM_THREADS"] for r in capped["ranks"]] == ["1", "1"]
    assert len(local["ranks"]) == len(ray["ranks"]) == 2
    for who, a, b in [("entrypoint", local["facts"], ray["facts"]),
                      *((f"rank {i}", x["facts"], y["facts"]) for i, (x, y) in enumerate(zip(local["ranks"],
                                                                                                 ray["ranks"])))]:
        differ = {k: (a[k], b[k]) for k in SAME if a[k] != b[k]}
        assert not differ, f"{who}: local vs ray {differ}"
    # as the local executor gives it: no thread cap, torch's default of one thread a physical core
    assert ray["facts"]["OMP_NUM_THREADS"] == "-" and ray["facts"]["torch threads"] == physical_cores()
    sub = Path(ray_cfg["V4_COMPILE_CACHE"]) / cache_key("cpu")
    assert ray["ranks"][0]["facts"]["TILELANG_CACHE_DIR"] == str(sub / "tilelang")


@pytest.mark.slow       # a tiny checkpoint and a Ray job whose dequantize part runs as a Ray task: ~20 s
def test_a_dequantize_part_task_computes_on_every_core(ray_cfg, tmp_path):
    """On a cluster of several nodes the dequantize step converts shards in one Ray task a node (jobs/dequantize.py
    `_spread`); Ray starts those with OMP_NUM_THREADS=1 too. Here the one local node stands for them."""
    from dsv4.checkpoint import generate_checkpoint
    from dsv4.config import ModelConfig
    from dsv4.procenv import physical_cores
    from launcher import jobs, plan
    src, dst = tmp_path / "official", tmp_path / "bf16"
    generate_checkpoint(ModelConfig.preset("tiny"), src, shard_bytes=600_000)
    code = (f"from jobs.dequantize import _ray_nodes, _spread; _spread({str(src)!r}, {str(dst)!r}, _ray_nodes(), "
            "600_000)")
    job = plan.JobSpec(submission_id=f"spread-{tmp_path.name}", entrypoint=f"{sys.executable} -c {code!r}",
                       runtime_env={"working_dir": str(ROOT), "excludes": plan.working_dir_excludes(ROOT),
                                    "env_vars": plan.job_env(ray_cfg, str(tmp_path))},
                       entrypoint_num_cpus=1, entrypoint_num_gpus=0, timeout_s=300, submit="")
    out = jobs.submit_and_wait(ray_cfg, job, log_path=tmp_path / "log", progress=lambda m: None)
    assert out.ok, out.log_tail
    assert f"already complete ({physical_cores()} CPU threads)" in (tmp_path / "log").read_text(), out.log_tail


def _processes_under(path: str) -> dict[int, str]:
    """pid -> command line of the live processes that name `path` (Ray's GCS, raylet and workers name their session
    dir)."""
    found = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if path in cmd:
            found[int(proc.name)] = cmd[:160]
    return found


@pytest.mark.slow       # a Ray cluster started and stopped: ~20 s
def test_the_bench_stops_its_ray_cluster_when_terminated():
    """`timeout` or a scheduler ends the bench with SIGTERM, which Python's default handler obeys without running
    `finally`: the bench's own Ray cluster stayed up after it. It now stops the cluster on SIGTERM as on Ctrl-C."""
    import contextlib
    import os
    import signal
    import time
    p = subprocess.Popen([sys.executable, str(ROOT / "benchmarks" / "bench_executor.py"), "--ranks", "0", "--mb", "1",
                          "--repeat", "50"], cwd=ROOT, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    local, line = f"/tmp/v4bx-{p.pid}", ""
    try:
        deadline = time.monotonic() + 120
        for line in p.stderr:
            if "ready" in line or time.monotonic() > deadline:
                break
        assert "ready" in line, line
        assert _processes_under(local), "the bench's Ray cluster is not running"
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=90) != 0
        time.sleep(2)
        assert _processes_under(local) == {}
    finally:
        if p.poll() is None:
            p.kill()
        for pid in _processes_under(local):             # what a failed run of this test leaves: its own pids only
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
