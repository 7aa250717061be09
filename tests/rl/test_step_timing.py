"""Every GRPO step's metrics row splits its time by part (dsv4/rl/loop.py StepClock): rollout, logprob scoring,
training, weight sync and waiting, which add up to the step's time."""
from __future__ import annotations

import math

import pytest
from grpo_harness import run_trainer

pytestmark = pytest.mark.slow

PARTS = ("rollout", "logprob", "train", "sync", "wait")


def test_each_step_is_timed_by_part(tmp_path):
    rows = run_trainer(tmp_path, kl_coef=0.1)          # the KL term: the reference policy scores every step
    assert len(rows) == 3
    for row in rows:
        t = {p: row[f"time_{p}_s"] for p in PARTS}
        assert all(math.isfinite(v) and v >= 0 for v in t.values()), t
        assert math.isclose(sum(t.values()), row["step_time_s"], rel_tol=1e-9), (t, row["step_time_s"])
        assert t["rollout"] >= row["rollout_s"] > 0           # generation, and the rewards and batch around it
        assert t["sync"] >= row["sync_s"] > 0                  # the push, and gathering the weights before it
        assert t["logprob"] > 0 and t["train"] > 0
