"""`v4 bench rollout` on a CPU: one rank of an expert-parallel rollout (--rank-of), its decode rows and the records
it appends."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def test_bench_rollout_decodes_an_ep_rank_and_records_it(tmp_path):
    r = subprocess.run([sys.executable, "-m", "launcher", "bench", "rollout", "--rank-of", "EP=2", "--layers", "3",
                        "--batches", "1,4", "--steps", "1", "--warmup", "1", "--sync", "tensor", "--record", "dec",
                        "--records-dir", str(tmp_path), "--json"], cwd=ROOT, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads(r.stdout)
    assert (rep["experts"], rep["layers"]) == (4, 3) and rep["rank"]["layout"] == "TP1 PP1 EP2 (DP2, 2 GPUs)"
    assert rep["rank"]["layer_kinds"] == ["window/hash", "csa/score", "hca/score"] and not rep["rank"]["mtp"]
    assert [d["tokens_per_expert"] for d in rep["decode"]] == [0.5, 2.0]        # batch x top-2 / 4 local experts
    assert all(math.isfinite(d["step_ms"]) and d["weight_bytes"] > 0 for d in rep["decode"])
    records = [json.loads(line) for line in (tmp_path / "rollout.jsonl").read_text().splitlines()]
    assert [x["benchmark"] for x in records] == ["dec_b1_eager", "dec_b4_eager", "dec_sync_tensor"]
    assert all("communication absent" in x["note"] and x["command"].startswith("v4 bench rollout") for x in records)
    assert records[0]["rank"]["local_experts"] == 4 and records[0]["metrics"]["of_roofline"] > 0


def test_bench_rollout_profiles_the_decode_step():
    """--profile-top: the timed steps again under the profiler, their ops (kernels on a GPU) by time a step; the
    busy time is the sum of what is listed (CPU) and no more than the step's wall time under the profiler."""
    r = subprocess.run([sys.executable, "-m", "launcher", "bench", "rollout", "--batches", "2", "--steps", "2",
                        "--warmup", "1", "--sync", "", "--profile-top", "5", "--json"], cwd=ROOT, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    (p,) = json.loads(r.stdout)["profiles"]
    assert (p["mode"], p["batch"], p["steps"], p["unit"]) == ("eager", 2, 2, "ops")
    assert len(p["kernels"]) == 5
    times = [k["us_per_step"] for k in p["kernels"]]
    assert all(math.isfinite(t) and t > 0 for t in times) and times == sorted(times, reverse=True)
    assert any(k["name"] == "aten::mm" for k in p["kernels"])
    assert 0 < p["busy_ms"] <= p["wall_ms"] and sum(times) / 1e3 <= p["busy_ms"] + 1e-9
    text = subprocess.run([sys.executable, "-m", "launcher", "bench", "rollout", "--batches", "1", "--steps", "1",
                           "--warmup", "0", "--sync", "", "--profile-top", "3"], cwd=ROOT, capture_output=True,
                          text=True, timeout=600).stdout
    assert "batch 1 eager:" in text and "between them" in text and "us/step" in text
