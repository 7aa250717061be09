"""The RL stage end to end on the embedded default, on the local Ray cluster the pipeline tests share (conftest.py):
`v4 run --preset rl_smoke` on CPU (generate -> dequantize -> convert -> GRPO with the embedded engine in the
trainer's process) learns the echo task and passes its gates; a killed RL run resumes from its last checkpoint with
the same prompts and sampling seeds."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def v4(work: tuple[Path, tuple[str, ...]], *args, env=None, timeout=900):
    """`v4 ARGS` in the module's work directory, on the local Ray the pipeline tests share (conftest.py)."""
    cmd = [sys.executable, "-m", "launcher", *args, "--hw", "cpu", *work[1], "--force"]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def metrics(run: Path) -> list[dict]:
    return [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines() if l.strip()]


@pytest.fixture(scope="module")
def work(ray_work):
    """(work directory, flags): its later runs reuse the checkpoint its first one generated and converted."""
    return ray_work


def test_rl_smoke_learns_and_passes_its_gates(work):
    r = v4(work, "run", "--preset", "rl_smoke", "--json")
    assert r.returncode == 0, r.stderr[-4000:]
    summary = json.loads(r.stdout)
    run = Path(summary["run_dir"])
    gates = {g["name"]: g for g in json.loads((run / "gates.json").read_text())}
    assert set(gates) == {"finite_loss", "reward_rising", "logprob_match", "weights_synced"}
    assert all(g["passed"] for g in gates.values()), gates
    rows = metrics(run)
    assert [m["step"] for m in rows] == list(range(1, 21))
    assert summary["reward_last"] >= summary["reward_first"] + 0.3
    assert "reward" in r.stderr and "PASSED" in r.stderr
    parts = summary["step_parts_s"]                      # the steady steps' time by part, as each row has it
    assert list(parts) == ["rollout", "logprob", "train", "sync", "wait"] and "a step: rollout" in r.stderr
    assert abs(sum(parts.values()) - summary["step_time_s"]) <= 1e-6 * summary["step_time_s"]
    assert rows[0]["compile_cache"] in ("cold", "warm", "partial") and "compile_cache" not in rows[1]
    assert "compile cache: " in (run / "steps" / "train" / "log").read_text()
    for m in rows:
        assert m["weight_version"] == str(m["step"]) and m["weights_synced"] is True
        assert m["route_agree"] == 1.0 and m["logprob_diff_max"] <= 1e-4
        assert all(m[k] == m[k] for k in ("loss", "grad_norm", "reward_mean", "sync_gb_s", "rollout_tokens_per_s"))


def test_a_killed_rl_run_resumes_with_the_same_prompts_and_seeds(work):
    """With two updates per rollout the checkpoints count updates (6 at step 3): the resume maps them back. One
    update per rollout is the same path with a map of 1."""
    minibatches = 2
    common = ("--set", "V4_EXECUTOR=local", "--set", "PRESET_NUM_STEPS=6", "--set", "PRESET_SAVE_INTERVAL=3",
              "--set", "PRESET_GATES=finite_loss", "--set", f"PRESET_RL_MINIBATCHES={minibatches}")
    whole = v4(work, "run", "--preset", "rl_smoke", "--json", *common)
    assert whole.returncode == 0, whole.stderr[-3000:]
    straight = metrics(Path(json.loads(whole.stdout)["run_dir"]))
    killed = v4(work, "run", "--preset", "rl_smoke", *common, env={"V4_KILL_AT_STEP": "5"})
    assert killed.returncode != 0 and "V4_KILL_AT_STEP=5" in killed.stderr, killed.stderr[-3000:]
    run = sorted((work[0] / "runs").glob("stageRL-*"), key=lambda p: p.stat().st_mtime)[-1]
    assert [m["step"] for m in metrics(run)] == [1, 2, 3, 4]
    resumed = v4(work, "run", "--preset", "rl_smoke", "--resume", run.name, *common)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    rows = {m["step"]: m for m in metrics(run)}          # step 4 again (from checkpoint 3), then 5, 6
    assert sorted(rows) == [1, 2, 3, 4, 5, 6]
    if minibatches > 1:
        assert all(m["pg_clipfrac"] == m["pg_clipfrac"] for m in straight) and any(m["pg_clipfrac"] > 0 for m in straight)
    for s in (4, 5, 6):
        for key in ("reward_mean", "loss", "grad_norm", "response_len"):
            assert rows[s][key] == straight[s - 1][key], (s, key, rows[s][key], straight[s - 1][key])


GLOO_COMMON = ("--set", "V4_EXECUTOR=local", "--set", "PRESET_NUM_STEPS=4", "--set", "PRESET_GATES=finite_loss")


@pytest.fixture(scope="module")
def one_rank(work) -> list[dict]:
    """The one-process run the layouts below are held to (the same for all of them: run once)."""
    one = v4(work, "run", "--preset", "rl_smoke", "--json", *GLOO_COMMON)
    assert one.returncode == 0, one.stderr[-3000:]
    return metrics(Path(json.loads(one.stdout)["run_dir"]))


@pytest.mark.parametrize("layout", [("PRESET_TP=2",), ("PRESET_EP=2",), ("PRESET_PP=2",)],
                         ids=["tp2", "ep2_dp2", "pp2"])
def test_rl_on_two_gloo_ranks_follows_one_rank(work, one_rank, layout):
    """The trainer on megatron-core's parallel layouts (rank 0 rolls out and syncs; each rank trains its share):
    the same rollouts, rewards and losses as one process, step for step."""
    two = v4(work, "run", "--preset", "rl_smoke", "--json", *GLOO_COMMON, "--set", "V4_NUM_GPUS_PER_NODE=2",
             *[a for kv in layout for a in ("--set", kv)])
    assert two.returncode == 0, two.stderr[-3000:]
    a, b = one_rank, metrics(Path(json.loads(two.stdout)["run_dir"]))
    assert "world 2" in (Path(json.loads(two.stdout)["run_dir"]) / "steps/train/log").read_text()
    for x, y in zip(a, b):
        assert x["reward_mean"] == y["reward_mean"] and x["response_len"] == y["response_len"]
        assert abs(x["grad_norm"] - y["grad_norm"]) <= 1e-4 * max(1.0, abs(x["grad_norm"]))
        assert y["weights_synced"] is True and y["logprob_diff_max"] <= 1e-4 and y["route_agree"] == 1.0
