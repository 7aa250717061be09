"""The GRPO loop's optional terms on a real megatron-core world-1 trainer: the k3 KL to the starting policy (kept
beside the checkpoints for a resume) and truncated importance sampling, with the metrics they add."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dsv4.megatron.launch import free_port

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow

TRAINER = """
import json, sys
from pathlib import Path
from dsv4.config import ModelConfig
from dsv4.model import Transformer
from dsv4.megatron.parallel import Layout, init_parallel
from dsv4.megatron.train import Outputs, TrainConfig, init_distributed, quiet_libraries
from dsv4.rl.engine import EmbeddedEngine
from dsv4.rl.loop import RLConfig, run_grpo
from dsv4.rl.tasks import EchoTask

out = Path(sys.argv[1])
quiet_libraries()
init_distributed(0, 1, "gloo", "cpu", "127.0.0.1", int(sys.argv[2]))
tc = TrainConfig(model=ModelConfig.preset("tiny", seed=3), layout=Layout(), seq_len=4, micro_batch_size=32,
                 global_batch_size=64, num_steps=3, lr=1e-3, weight_decay=0.0, device="cpu", save_interval=100)
init_parallel(tc.layout, tc.seed)
task = EchoTask()
rl = RLConfig(prompts_per_step=8, group_size=8, max_new_tokens=1, kl_coef=0.1, tis_cap=2.0,
              allowed_token_ids=task.allowed_token_ids)
engine = EmbeddedEngine(Transformer(tc.model, init=False))
rows = []
code = run_grpo(tc, rl, task, task.reward, engine, Outputs(checkpoints=out / "ckpt"), rows.append)
(out / "rows.json").write_text(json.dumps(rows))
sys.exit(code)
"""


def test_kl_to_the_starting_policy_and_tis(tmp_path):
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(TRAINER), str(tmp_path), str(free_port())], cwd=ROOT,
                       capture_output=True, text=True, timeout=600,
                       env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert (tmp_path / "ckpt" / "reference_policy.pt").is_file()
    # step 1 trains from the reference itself: KL 0; later steps have moved away from it
    assert rows[0]["kl"] == pytest.approx(0.0, abs=1e-7)
    assert all(m["kl"] > 0 and m["kl"] == m["kl"] for m in rows[1:])
    # the engine holds the trainer's weights: importance weights are 1 up to round-off
    assert all(abs(m["tis_mean"] - 1.0) < 1e-4 for m in rows)
    assert all(m["loss"] == m["loss"] and m["weights_synced"] for m in rows)
