"""The GRPO loop against a rollout engine in another process: `v4 rl serve` (the embedded engine behind SGLang's
HTTP API) on loopback, the trainer a megatron-core world-1 process driving it through HTTPEngine, with the
weights going over a gloo broadcast group or through a checkpoint on disk. This is the disaggregated layout
(engine on its own devices) in miniature; with SGLang servers the same client and payloads are used."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
from grpo_harness import ROOT, run_trainer

from dsv4.megatron.launch import free_port

pytestmark = pytest.mark.slow


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
    _check(run_trainer(tmp_path, urls=[server], sync_path=path))


def test_grpo_against_two_servers_as_one_group(server, second_server, tmp_path):
    """Rollouts split over two `v4 rl serve` processes; one broadcast group of three (trainer + 2 engines) carries
    the weights to both, and the read-back finds both equal to the trainer (EngineGroup compares them)."""
    rows = run_trainer(tmp_path, urls=[server, second_server], sync_path="broadcast")
    _check(rows)
    from dsv4.rl.http import HTTPEngine
    infos = [HTTPEngine(u).model_info() for u in (server, second_server)]
    assert [i["weight_version"] for i in infos] == ["3", "3"]
