"""The train step says what its first step found in the compile cache (dsv4/procenv.py): in its log and in its first
metrics row, declared in launcher/metrics.py. End to end on CPU with a cold cache (a real `jobs.train_sft` on the tiny
model: the rank activates V4_COMPILE_CACHE itself), and for a populated one through the same metrics sink."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dsv4 import procenv
from launcher.metrics import parse_line

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "data" / "sft_smoke.jsonl"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from dsv4.checkpoint import generate_checkpoint
    from dsv4.config import ModelConfig
    d = tmp_path_factory.mktemp("models") / "official"
    cfg = ModelConfig.preset("tiny")
    generate_checkpoint(cfg, d, seed=cfg.seed)
    return d


def make_run(run_dir: Path, hf: Path) -> Path:
    v = dict(PRESET_MODEL="tiny", PRESET_MODEL_OVERRIDES=["dtype=bf16"], ATTN_IMPL="torch", HW_DEVICE="cpu",
             HW_DIST_BACKEND="gloo", PRESET_TP=1, PRESET_PP=1, PRESET_EP=1, PRESET_ETP=1, PRESET_CP=1,
             PRESET_SEQ_LEN=32, PRESET_MICRO_BATCH_SIZE=1, PRESET_GLOBAL_BATCH_SIZE=2, PRESET_NUM_STEPS=2,
             PRESET_LR=1e-3, PRESET_MIN_LR=0.0, PRESET_LR_DECAY_STYLE="constant", PRESET_LR_WARMUP_ITERS=0,
             PRESET_WEIGHT_DECAY=0.1, PRESET_SEED=1234, PRESET_SAVE_INTERVAL=2, PRESET_SAVE_RETAIN_INTERVAL=0,
             HW_RECOMPUTE_GRANULARITY="none", WORLD_SIZE=1, V4_NUM_NODES=1, V4_NUM_GPUS_PER_NODE=1,
             CKPT_HF_DIR=str(hf), CKPT_BF16_DIR=str(hf), CKPT_TORCH_DIST=str(run_dir / "none"),
             PRESET_DATA=str(DATA), V4_SFT_DATA=str(DATA), V4_SOCKET_IFNAME="lo", PRESET_WEIGHTS="generate",
             V4_DIST_PORT=0, PRESET_HANG_TIMEOUT=0)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps({"values": v}))
    return run_dir


def rows(run_dir: Path) -> list[dict]:
    return [parse_line(x.encode()) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]


def test_a_cold_cache_is_said_at_the_first_step(checkpoint, tmp_path):
    run = make_run(tmp_path / "run", checkpoint)
    cache = tmp_path / "compile-cache"
    env = {k: v for k, v in os.environ.items() if k not in procenv.CACHE_VARS.values()}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", V4_COMPILE_CACHE=str(cache))
    p = subprocess.run([sys.executable, "-m", "jobs.train_sft", "--run-dir", str(run)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    sub = cache / procenv.cache_key("cpu")
    assert f"compile cache: cold (0 entries; the first step compiled nothing) at {sub}" in p.stderr
    first, second = rows(run)[:2]
    assert (first["compile_cache"], first["compile_cache_entries"], first["compile_cache_new"]) == ("cold", 0, 0)
    assert "compile_cache" not in second                   # the first step of the job only
    assert all((sub / kind).is_dir() for kind in procenv.CACHE_VARS)   # the rank made its directories


def test_a_populated_cache_is_warm(tmp_path, monkeypatch):
    from jobs.common import RunContext, with_compile_cache
    sub = tmp_path / "cc" / "key"
    for d in ("tilelang/0.1.15/linux-x86_64/kernels/k1", "tilelang/0.1.15/linux-x86_64/kernels/k2", "triton/t1"):
        (sub / d).mkdir(parents=True)
    (sub / "inductor" / "fxgraph" / "ab" / "fabc").mkdir(parents=True)
    (sub / "inductor" / "fxgraph" / "ab" / "fabc" / "entry").write_text("x")
    (sub / "inductor" / "ab").mkdir()
    (sub / "inductor" / "ab" / "cab.py").write_text("# generated code, not an entry")
    monkeypatch.setenv(procenv.CACHE_DIR, str(sub))
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"values": {"V4_SOCKET_IFNAME": "lo"}}))
    ctx = RunContext.load(run)
    said = []
    write = with_compile_cache(ctx.write_metrics, said.append)
    (sub / "triton" / "t2").mkdir()            # a kernel someone else's rank compiled before this first step ends
    write({"step": 1, "loss": 1.0})
    write({"step": 2, "loss": 0.5})
    assert said == [f"compile cache: partly warm (4 entries: 2 TileLang, 1 inductor, 1 Triton; the first step "
                    f"compiled 1 more) at {sub}"]
    said.clear()
    (run / "metrics.jsonl").unlink()
    write = with_compile_cache(ctx.write_metrics, said.append)
    write({"step": 3, "loss": 0.4})
    assert said[0].startswith("compile cache: warm (5 entries:")
    (row,) = rows(run)
    assert (row["compile_cache"], row["compile_cache_entries"], row["compile_cache_new"]) == ("warm", 5, 0)


def test_no_cache_no_report(tmp_path, monkeypatch):
    from jobs.common import with_compile_cache
    monkeypatch.delenv(procenv.CACHE_DIR, raising=False)
    sink = []
    write = with_compile_cache(sink.append)
    write({"step": 1})
    assert sink == [{"step": 1}]
