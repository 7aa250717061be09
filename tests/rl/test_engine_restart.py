"""The GRPO loop losing its rollout server mid-run (dsv4/rl/restart.py): a megatron-core world-1 trainer in a
subprocess drives the embedded engine behind a real RolloutHTTPServer over HTTP; after step 2's row the server is
shut down (its port then refuses connections, as a killed process's does). With a restart left, a new server on the
same port gets the current weights and step 3 is rolled out again: every row equals the uninterrupted run's, the
restart counted in step 3's row and recorded. Without one the job stops naming the lost engine.
The same kill of a real `v4 rl serve` process under the Ray executor: tests/pipeline/test_rl_engine_restart.py."""
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
import json, sys, threading
from pathlib import Path
from dsv4.config import ModelConfig
from dsv4.megatron.parallel import Layout, init_parallel
from dsv4.megatron.train import Outputs, TrainConfig, init_distributed, quiet_libraries
from dsv4.model import Transformer
from dsv4.rl.engine import EmbeddedEngine
from dsv4.rl.http import HTTPEngine, RolloutHTTPServer
from dsv4.rl.loop import RLConfig, run_grpo
from dsv4.rl.restart import EngineGone, Restarter
from dsv4.rl.tasks import EchoTask

out, port, server_port, kill_after, budget = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), \\
    json.loads(sys.argv[5])
quiet_libraries()
init_distributed(0, 1, "gloo", "cpu", "127.0.0.1", port)
tc = TrainConfig(model=ModelConfig.preset("tiny", seed=3), layout=Layout(), seq_len=4, micro_batch_size=32,
                 global_batch_size=64, num_steps=4, lr=1e-3, weight_decay=0.0, device="cpu", save_interval=100)
init_parallel(tc.layout, tc.seed)
task = EchoTask()
rl = RLConfig(prompts_per_step=8, group_size=8, max_new_tokens=1, scratch=out, sync_path="disk",
              allowed_token_ids=task.allowed_token_ids)
servers = []

def start_server():
    server = RolloutHTTPServer(EmbeddedEngine(Transformer(tc.model, init=False)), "127.0.0.1", server_port)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    servers.append(server)
    engine = HTTPEngine(server.url)
    engine.wait_healthy(60)
    return engine

rows = []

def on_metrics(row):
    rows.append(row)
    if row["step"] == kill_after:
        servers[-1].shutdown()
        servers[-1].server_close()

restarter = None if budget is None else Restarter(start_server, budget, out / "restarts.jsonl")
try:
    code = run_grpo(tc, rl, task, task.reward, start_server(), Outputs(checkpoints=out / "ckpt"), on_metrics,
                    restarter=restarter)
except EngineGone as e:
    print(f"EngineGone: {e}")
    code = 1
(out / "rows.json").write_text(json.dumps(rows))
sys.exit(code)
"""


def trainer(out: Path, kill_after: int, budget: int | None) -> tuple[subprocess.CompletedProcess, list[dict]]:
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(TRAINER), str(out), str(free_port()), str(free_port()),
                        str(kill_after), json.dumps(budget)], cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH")))), "OMP_NUM_THREADS": "1"})
    rows = json.loads((out / "rows.json").read_text()) if (out / "rows.json").is_file() else []
    return r, rows


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> list[dict]:
    r, rows = trainer(tmp_path_factory.mktemp("straight"), kill_after=0, budget=1)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return rows


def test_a_lost_server_is_restarted_and_the_step_regenerated_as_it_was(straight, tmp_path):
    r, rows = trainer(tmp_path, kill_after=2, budget=1)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert [m["step"] for m in rows] == [1, 2, 3, 4]
    (rec,) = [json.loads(line) for line in (tmp_path / "restarts.jsonl").read_text().splitlines()]
    assert rec["step"] == 3 and rec["phase"] == "rollout" and "cannot reach the engine" in rec["cause"]
    assert rec["samples"] == 64                                   # the step's batch, rolled out again
    assert [(m["rollout_restarts"], m["rollout_regenerated_samples"]) for m in rows] == [(0, 0), (0, 0), (1, 64), (0, 0)]
    assert all(m["rollout_restarts"] == 0 for m in straight)
    for got, want in zip(rows, straight):
        # the same prompts, seeds and weights: the regenerated step is the step the uninterrupted run took
        for key in ("reward_mean", "loss", "grad_norm", "response_len", "logprob_diff_max"):
            assert got[key] == want[key], (got["step"], key, got[key], want[key])
        assert got["weights_synced"] is True and got["weight_version"] == str(got["step"])
        assert got["logprob_diff_max"] == got["logprob_diff_max"] and got["logprob_diff_max"] <= 1e-4


def test_without_a_restart_left_a_lost_server_stops_the_job(tmp_path):
    r, rows = trainer(tmp_path, kill_after=2, budget=0)
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    assert "step 3: the rollout engine was lost during rollout" in r.stdout, r.stdout[-3000:]
    assert "no restart is left (PRESET_MAX_RESTARTS=0" in r.stdout
    assert [m["step"] for m in rows] == [1, 2]
