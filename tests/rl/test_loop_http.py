"""The GRPO loop against a rollout engine in another process: `v4 rl serve` (the embedded engine behind SGLang's
HTTP API) on loopback, the trainer a megatron-core world-1 process driving it through HTTPEngine, with the
weights going over a gloo broadcast group or through a checkpoint on disk. This is the disaggregated layout
(engine on its own devices) in miniature; with SGLang servers the same client and payloads are used."""
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
from dsv4.megatron.parallel import Layout, init_parallel
from dsv4.megatron.train import Outputs, TrainConfig, init_distributed, quiet_libraries
from dsv4.rl.group import EngineGroup
from dsv4.rl.http import HTTPEngine
from dsv4.rl.loop import RLConfig, run_grpo
from dsv4.rl.tasks import EchoTask

urls, path, out = sys.argv[1].split(","), sys.argv[2], Path(sys.argv[3])
quiet_libraries()
init_distributed(0, 1, "gloo", "cpu", "127.0.0.1", int(sys.argv[4]))
tc = TrainConfig(model=ModelConfig.preset("tiny", seed=3), layout=Layout(), seq_len=4, micro_batch_size=32,
                 global_batch_size=64, num_steps=3, lr=1e-3, weight_decay=0.0, device="cpu", save_interval=100)
init_parallel(tc.layout, tc.seed)
task = EchoTask()
rl = RLConfig(prompts_per_step=8, group_size=8, max_new_tokens=1, sync_path=path, scratch=out,
              allowed_token_ids=task.allowed_token_ids)
rows = []
engine = HTTPEngine(urls[0]) if len(urls) == 1 else EngineGroup([HTTPEngine(u) for u in urls])
code = run_grpo(tc, rl, task, task.reward, engine, Outputs(checkpoints=out / "ckpt"), rows.append)
(out / "rows.json").write_text(json.dumps(rows))
sys.exit(code)
"""


def _serve(tmp_path_factory):
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    log = open(tmp_path_factory.mktemp("serve") / "serve.log", "w")       # a pipe nobody reads would fill up
    proc = subprocess.Popen([sys.executable, "-m", "launcher", "rl", "serve", "--model", "tiny", "--port", str(port)],
                            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    from dsv4.rl.http import HTTPEngine
    try:
        HTTPEngine(url).wait_healthy(120)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from _serve(tmp_path_factory)


@pytest.fixture(scope="module")
def second_server(tmp_path_factory):
    yield from _serve(tmp_path_factory)


def _run(urls: list[str], path: str, tmp_path) -> list[dict]:
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(TRAINER), ",".join(urls), path, str(tmp_path),
                        str(free_port())], cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads((tmp_path / "rows.json").read_text())


def _check(rows: list[dict]) -> None:
    assert [m["step"] for m in rows] == [1, 2, 3]
    for m in rows:
        # the served engine took each sync (read back over HTTP) and rolled out on it: the trainer scores the
        # same tokens the same way, with the same experts
        assert m["weights_synced"] is True and m["sync_max_err"] == 0.0
        assert m["weight_version"] == str(m["step"])
        assert m["logprob_diff_max"] <= 1e-4 and m["route_agree"] == 1.0
        assert m["loss"] == m["loss"] and m["grad_norm"] == m["grad_norm"]


@pytest.mark.parametrize("path", ["broadcast", "disk"])
def test_grpo_against_a_served_engine_in_another_process(server, path, tmp_path):
    _check(_run([server], path, tmp_path))


def test_grpo_against_two_servers_as_one_group(server, second_server, tmp_path):
    """Rollouts split over two `v4 rl serve` processes; one broadcast group of three (trainer + 2 engines) carries
    the weights to both, and the read-back finds both equal to the trainer (EngineGroup compares them)."""
    rows = _run([server, second_server], "broadcast", tmp_path)
    _check(rows)
    from dsv4.rl.http import HTTPEngine
    infos = [HTTPEngine(u).model_info() for u in (server, second_server)]
    assert [i["weight_version"] for i in infos] == ["3", "3"]
