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
