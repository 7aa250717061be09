"""A real SFT training job (`python -m jobs.train_sft`, the tiny model on CPU) with Weights & Biases failing under it:
no key at the start, and the W&B service process killed mid-run. Training finishes, every step's row reaches
metrics.jsonl, and the job says once that W&B stopped; never a traceback. Nothing leaves this machine: the server
is a loopback port where nothing listens."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from test_jobs import ROOT, make_run, metrics


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A generated tiny checkpoint, dequantized to BF16 (no converted one: training starts from the reference
    initialisation, which is all these tests need)."""
    from dsv4.checkpoint import dequantize_checkpoint, generate_checkpoint
    from dsv4.config import ModelConfig
    from jobs.common import mark_done
    d = tmp_path_factory.mktemp("models")
    cfg = ModelConfig.preset("tiny")
    generate_checkpoint(cfg, d / "official", seed=cfg.seed)
    dequantize_checkpoint(d / "official", d / "bf16")
    mark_done(d / "bf16", {"test": True})
    return d


def unused_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def start_job(run: Path, tmp_path: Path, **env) -> subprocess.Popen:
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    e = {k: v for k, v in os.environ.items() if not k.startswith("WANDB") and k not in ("NETRC", "V4_PLANT_NAN",
                                                                                         "V4_KILL_AT_STEP")}
    e.update(HOME=str(home), WANDB_ERROR_REPORTING="false", OMP_NUM_THREADS="1",
             PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p), **env)
    return subprocess.Popen([sys.executable, "-m", "jobs.train_sft", "--run-dir", str(run)], cwd=ROOT, env=e,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def w_and_b_warnings(stderr: str) -> list[str]:
    return [x for x in stderr.splitlines() if "warning:" in x and "W&B" in x]


def test_sft_trains_on_when_wandb_has_no_key(models, tmp_path):
    run = make_run(tmp_path / "run", models, PRESET_NUM_STEPS=2, V4_WANDB_PROJECT="v4-test", V4_WANDB_MODE="online",
                   V4_WANDB_BASE_URL=unused_url(), V4_WANDB_TIMEOUT=2)
    p = start_job(run, tmp_path)
    _, err = p.communicate(timeout=300)
    assert p.returncode == 0, err[-3000:]
    assert sorted(metrics(run)) == [1, 2] and "identical" in err
    (warning,) = w_and_b_warnings(err)
    assert "did not start (UsageError: No API key configured" in warning and "training goes on" in warning
    assert "Traceback" not in err, err[-3000:]


def test_sft_trains_on_when_wandb_dies_mid_run(models, tmp_path):
    """Offline W&B; once step 2's row is written (the W&B run started at step 1's) this test kills the job's
    wandb-core process (the job's child): wandb.log raises from then on, the job warns once and finishes its
    6 steps."""
    steps = 6
    run = make_run(tmp_path / "run", models, PRESET_NUM_STEPS=steps, PRESET_SAVE_INTERVAL=steps,
                   V4_WANDB_PROJECT="v4-test", V4_WANDB_MODE="offline", V4_WANDB_TIMEOUT=2)
    p = start_job(run, tmp_path)
    killed, deadline = None, time.time() + 240
    try:
        while killed is None and p.poll() is None and time.time() < deadline:
            rows = (run / "metrics.jsonl").read_text().count("\n") if (run / "metrics.jsonl").is_file() else 0
            core = [c for c in psutil.Process(p.pid).children(recursive=True) if c.name() == "wandb-core"]
            if rows >= 2 and core:
                core[0].kill()
                killed = rows
            time.sleep(0.02)
        _, err = p.communicate(timeout=300)
    finally:
        if p.poll() is None:
            p.kill()
    assert killed is not None and killed < steps, "the job ended before its W&B service could be killed"
    assert p.returncode == 0, err[-3000:]
    assert sorted(metrics(run)) == list(range(1, steps + 1))
    (warning,) = w_and_b_warnings(err)
    assert "W&B stopped taking this run's metrics at step" in warning and "training goes on" in warning
    assert int(warning.split("at step ")[1].split()[0]) >= killed      # its row is written before wandb.log
    assert "Traceback" not in err, err[-3000:]
