"""The training-side jobs end to end on CPU: convert -> load round trip, SFT with metrics and the
save -> reload check, resume after a kill, a planted NaN stopping with exit 16, and the Ray driver
for more than one rank. Jobs run as `python -m jobs.<name> --run-dir DIR` subprocesses on a
generated tiny checkpoint in the official layout (dequantized to BF16 first). The model runs in bf16
as on a GPU: bf16 weights with the reference's fp32 parameters, megatron's bf16 optimizer."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import mt_harness as H

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "data" / "sft_smoke.jsonl"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A generated tiny checkpoint, dequantized to BF16 (what the weights and dequantize steps make)."""
    from dsv4.checkpoint import dequantize_checkpoint, generate_checkpoint
    from dsv4.config import ModelConfig
    from jobs.common import mark_done
    d = tmp_path_factory.mktemp("models")
    cfg = ModelConfig.preset("tiny")
    generate_checkpoint(cfg, d / "official", seed=cfg.seed)
    dequantize_checkpoint(d / "official", d / "bf16")
    mark_done(d / "bf16", {"test": True})
    return d


def make_run(run_dir: Path, models: Path, **values) -> Path:
    """A run directory with the config.json the launcher would write (only the keys these jobs read)."""
    v = dict(PRESET_MODEL="tiny", PRESET_MODEL_OVERRIDES=["dtype=bf16"], ATTN_IMPL="torch", HW_DEVICE="cpu",
             HW_DIST_BACKEND="gloo", PRESET_TP=1, PRESET_PP=1, PRESET_EP=1, PRESET_ETP=1, PRESET_CP=1,
             PRESET_SEQ_LEN=32, PRESET_MICRO_BATCH_SIZE=1, PRESET_GLOBAL_BATCH_SIZE=2, PRESET_NUM_STEPS=3,
             PRESET_LR=1e-3, PRESET_MIN_LR=0.0, PRESET_LR_DECAY_STYLE="constant", PRESET_LR_WARMUP_ITERS=0,
             PRESET_WEIGHT_DECAY=0.1, PRESET_SEED=1234, PRESET_SAVE_INTERVAL=1, PRESET_SAVE_RETAIN_INTERVAL=0,
             HW_RECOMPUTE_GRANULARITY="none", WORLD_SIZE=1, V4_NUM_NODES=1, V4_NUM_GPUS_PER_NODE=1,
             CKPT_HF_DIR=str(models / "official"), CKPT_BF16_DIR=str(models / "bf16"),
             CKPT_TORCH_DIST=str(models / "torch_dist"), PRESET_DATA=str(DATA), V4_SFT_DATA=str(DATA),
             V4_SOCKET_IFNAME="lo", PRESET_WEIGHTS="generate", V4_DIST_PORT=0)
    v.update(values)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps({"values": v}))
    return run_dir


def job(name: str, run_dir: Path, timeout: float = 300, **env) -> subprocess.CompletedProcess:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    e = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", **env}
    for k in ("V4_PLANT_NAN", "V4_KILL_AT_STEP"):
        if k not in env:
            e.pop(k, None)
    return subprocess.run([sys.executable, "-m", f"jobs.{name}", "--run-dir", str(run_dir)], cwd=ROOT, env=e,
                          capture_output=True, text=True, timeout=timeout)


def metrics(run_dir: Path) -> dict[int, dict]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return {r["step"]: r for r in rows}


@pytest.fixture(scope="module")
def converted(models, tmp_path_factory):
    run = make_run(tmp_path_factory.mktemp("convert"), models)
    p = job("convert_ckpt", run)
    assert p.returncode == 0, p.stderr[-3000:]
    assert (models / "torch_dist" / ".v4-done.json").is_file()
    again = job("convert_ckpt", run)                     # the sentinel makes a re-run a no-op
    assert again.returncode == 0 and "skipped" in again.stderr
    return models


@pytest.fixture(scope="module")
def trained(converted, tmp_path_factory):
    run = make_run(tmp_path_factory.mktemp("train"), converted)
    p = job("train_sft", run)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "loaded weights from" in p.stderr
    return run


def test_convert_then_load_round_trip_at_another_layout(converted, tmp_path):
    """Converted at world 1, loaded at TP=2: every shard equals the BF16 source slice."""
    for r in H.run_roundtrip(converted / "torch_dist", converted / "bf16", 2, tmp_path, dtype="bf16"):
        assert r["checked"] > 100 and r["mismatch"] == []


def test_sft_metrics_and_reload_check(trained):
    rows = metrics(trained)
    assert sorted(rows) == [1, 2, 3]
    for r in rows.values():
        for k in ("loss", "grad_norm", "lr", "tokens", "step_time_s", "tokens_per_s", "peak_mem_gb", "world"):
            assert isinstance(r[k], (int, float)) and math.isfinite(r[k]), (k, r)
    assert rows[3]["loss"] < rows[1]["loss"]
    check = json.loads((trained / "steps" / "train" / "reload_check.json").read_text())
    assert math.isfinite(check["loss_continued"])
    assert check["loss_continued"] == check["loss_reloaded"]
    assert check["grad_norm_continued"] == check["grad_norm_reloaded"]
    assert check["loss_after_update_continued"] == check["loss_after_update_reloaded"]
    assert check["identical"] is True and check["step"] == 4
    assert (trained / "checkpoints" / "latest_checkpointed_iteration.txt").read_text() == "3"
    assert [d.name for d in (trained / "checkpoints").glob("iter_*")] == ["iter_0000003"]


def test_resume_after_kill_midway_matches_uninterrupted(trained, converted, tmp_path):
    run = make_run(tmp_path / "run", converted)
    killed = job("train_sft", run, V4_KILL_AT_STEP="3")
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert sorted(metrics(run)) == [1, 2]
    resumed = job("train_sft", run)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr and "iter_0000002" in resumed.stderr
    a, b = metrics(trained), metrics(run)
    assert [b[s]["loss"] for s in (1, 2, 3)] == [a[s]["loss"] for s in (1, 2, 3)]
    ca = json.loads((trained / "steps/train/reload_check.json").read_text())
    cb = json.loads((run / "steps/train/reload_check.json").read_text())
    assert cb["loss_reloaded"] == ca["loss_reloaded"]


def test_planted_nan_stops_with_exit_16_naming_the_module(converted, tmp_path):
    run = make_run(tmp_path / "run", converted, PRESET_NUM_STEPS=2)
    p = job("train_sft", run, V4_PLANT_NAN="layers.1.attn:2")
    assert p.returncode == 16, p.stderr[-3000:]
    info = json.loads((run / "steps" / "train" / "nonfinite.json").read_text())
    assert (info["step"], info["module"], info["phase"], info["rank"]) == (2, "layers.1.attn", "forward", 0)
    assert info["located_by"] == "rerun"                # the hooks came on for the bad step's second run only
    assert sorted(metrics(run)) == [1]                  # step 2 never reached the metrics
    assert not (run / "steps" / "train" / ".v4-done.json").exists()


@pytest.mark.parametrize("executor", ["ray", "local"])
def test_two_ranks_backward_nan(converted, tmp_path, executor):
    """World 2 (TP=2) through the Ray driver (one actor per rank) or the local executor (two spawned processes,
    no Ray): step 1 trains and saves, a NaN planted in a gradient at step 2 stops every rank with exit 16 and
    names the module."""
    run = make_run(tmp_path / "run", converted, PRESET_TP=2, WORLD_SIZE=2, V4_NUM_GPUS_PER_NODE=2,
                   PRESET_NUM_STEPS=2, PRESET_GLOBAL_BATCH_SIZE=1, V4_EXECUTOR=executor)
    env = {"RAY_ADDRESS": "local"} if executor == "ray" else {}
    p = job("train_sft", run, timeout=400, V4_PLANT_NAN="layers.2.ffn.shared_experts.w2:2:backward", **env)
    assert p.returncode == 16, p.stderr[-4000:]
    if executor == "ray":
        assert "placement group of 2" in p.stderr
    else:
        assert "2 ranks as local processes" in p.stderr and "placement group" not in p.stderr
    rows = metrics(run)
    assert sorted(rows) == [1] and rows[1]["world"] == 2 and math.isfinite(rows[1]["loss"])
    assert (run / "checkpoints" / "iter_0000001").is_dir()
    info = json.loads((run / "steps" / "train" / "nonfinite.json").read_text())
    assert (info["step"], info["module"], info["phase"]) == (2, "layers.2.ffn.shared_experts.w2", "backward")
    assert info["located_by"] == "rerun"
    assert len(info["per_rank"]) == 2


def test_local_executor_fails_fast_when_a_rank_dies(monkeypatch):
    """A rank that dies while the other waits in a collective: the job ends (exit 1) instead of hanging."""
    from dsv4.megatron import launch as L
    monkeypatch.setattr(L, "RANK_GRACE_S", 1.0)
    t0 = time.time()
    code = L.launch(_die_or_wait, 2, None, "cpu", 0, log=lambda m: None, local=True)
    assert code == 1 and time.time() - t0 < 60


def _gloo_rank(rank, world, addr, port, payload):
    import torch.distributed as dist
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://{addr}:{port}")
    dist.barrier()
    return 0


def test_a_rank_leaves_no_process_group_behind():
    """world 1 runs in this process: the group the rank made is gone when launch returns (a second job in the
    same process starts clean, and NCCL has nothing to warn about at exit)."""
    import torch.distributed as dist
    from dsv4.megatron import launch as L
    assert L.launch(_gloo_rank, 1, None, "cpu", 0, log=lambda m: None) == 0
    assert not dist.is_initialized()
    assert L.launch(_gloo_rank, 1, None, "cpu", 0, log=lambda m: None) == 0     # a fresh group
    assert not dist.is_initialized()


def test_evaluate_scores_held_out_rows(trained):
    p = job("evaluate", trained)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads((trained / "steps" / "evaluate" / "eval.json").read_text())
    assert r["rows"] > 0 and r["loss_tokens"] > 0 and r["step"] == 3
    assert math.isfinite(r["loss"]) and math.isfinite(r["loss_initial"])
    assert r["loss"] < r["loss_initial"]          # three steps of SFT lowered the held-out loss


def _die_or_wait(rank, world, addr, port, payload) -> int:
    """Rank 1 exits with 1 at once; rank 0 would wait for it forever (a barrier of a live group)."""
    if rank == 1:
        return 1
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR=addr, MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)   # blocks: rank 1 never joins
    return 0


def test_train_and_evaluate_refuse_data_another_run_prepared(models, tmp_path):
    """V4_SFT_DATA whose sentinel names another PRESET_DATA (another run prepared into the same file): no training
    on it, exit 1, the reason and the fix said."""
    from jobs.common import mark_done
    data = tmp_path / "sft.jsonl"
    data.write_text(DATA.read_text())
    mark_done(data, {"source": "/elsewhere/other.jsonl", "fingerprint": "0", "format_version": 1})
    run = make_run(tmp_path / "run", models, V4_SFT_DATA=str(data))
    for name in ("train_sft", "evaluate"):
        p = job(name, run)
        assert p.returncode == 1 and "another run prepared its source" in p.stderr, (name, p.stderr[-2000:])
    assert not (run / "metrics.jsonl").exists()


def test_a_corrupted_checkpoint_is_named_not_a_traceback(converted, tmp_path):
    """A checkpoint truncated on disk (a full disk during the save): the resume names the directory and what to
    do, exit 1, no EOFError traceback."""
    run = make_run(tmp_path / "run", converted, PRESET_NUM_STEPS=3)
    killed = job("train_sft", run, V4_KILL_AT_STEP="3")
    assert killed.returncode == -9, killed.stderr[-2000:]
    ckpt = run / "checkpoints" / "iter_0000002"
    for f in ckpt.glob("*.distcp"):
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 3])
    p = job("train_sft", run)
    assert p.returncode == 1, p.stderr[-3000:]
    assert f"{ckpt}: cannot be read (EOFError)" in p.stderr and "truncated or corrupted" in p.stderr
    assert "Traceback" not in p.stderr


def test_ranks_ray_can_never_place_fail_at_once_with_the_numbers():
    """Three ranks on a two-CPU Ray: said at once, with what they need and what the cluster has (not a silent
    wait for the placement timeout)."""
    script = ("import ray, time; ray.init(num_cpus=2, include_dashboard=False); from dsv4.megatron.launch import "
              "_launch_ray; t0 = time.time(); code = _launch_ray(lambda *a: 0, 3, None, 'cpu', 0, print); "
              "print('code', code, 'after', round(time.time() - t0, 1))")
    p = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=180,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH")))), "RAY_ADDRESS": ""})
    assert "code 1 after" in p.stdout, p.stdout + p.stderr[-2000:]
    assert "3 ranks of {'CPU': 1} can never be placed: they need 3 CPU, the whole Ray cluster has 2 CPU" in p.stdout
    assert float(p.stdout.split("after")[1]) < 10


def test_the_drivers_own_cpu_counts_against_the_ranks():
    """Two ranks on a two-CPU Ray from a pipeline step, whose driver holds one CPU: infeasible, said at once."""
    script = ("import ray; ray.init(num_cpus=2, include_dashboard=False); from dsv4.megatron.launch import "
              "_launch_ray; print('code', _launch_ray(lambda *a: 0, 2, None, 'cpu', 0, print))")
    p = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=180,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH")))), "RAY_ADDRESS": "", "V4_JOB_DRIVER_CPUS": "1"})
    assert "code 1" in p.stdout and "has 2 CPU (1 held by this job's driver)" in p.stdout, p.stdout + p.stderr[-2000:]


RENDEZVOUS = """
import socket
import torch
import torch.distributed as dist
from dsv4.megatron import launch as L
from dsv4.megatron.train import init_distributed

def rank_fn(rank, world, addr, port, payload):
    init_distributed(rank, world, "gloo", "cpu", addr, port)
    t = torch.ones(1)
    dist.all_reduce(t)
    return 0 if t.item() == world else 1

if __name__ == "__main__":
    with socket.socket() as taken:           # a port another process listens on
        taken.bind(("", 0)); taken.listen()
        port = taken.getsockname()[1]
        print("world1", L.launch(rank_fn, 1, None, "cpu", port, log=print))
        print("world2 taken", L.launch(rank_fn, 2, None, "cpu", port, log=print, local=True))
    print("world2", L.launch(rank_fn, 2, None, "cpu", 0, log=print, local=True))
    print("port", port)
"""


def test_ranks_meet_at_a_store_the_launcher_serves(tmp_path):
    """The rendezvous store's port is bound by the launcher before any rank starts, so nothing can take it between
    its pick and its listen (a CI run lost a rung so, to an outgoing connection's port): world 1 needs no port at
    all (a port another process holds does not matter), two local ranks meet at their parent's store, and a given
    port that is taken is refused with the key to change."""
    script = tmp_path / "rendezvous.py"
    script.write_text(RENDEZVOUS)
    p = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))})
    out = p.stdout
    port = out.split("port ")[-1].strip()
    assert "world1 0" in out, out + p.stderr[-3000:]
    assert "world2 taken 1" in out and (f"error: cannot serve the rendezvous store on port {port}: " in out
                                        and "set V4_DIST_PORT to a free port" in out), out
    assert "world2 0" in out and "2 ranks as local processes" in out, out + p.stderr[-3000:]
