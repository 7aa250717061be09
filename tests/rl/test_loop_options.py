"""The GRPO loop's optional terms on a real megatron-core world-1 trainer: the k3 KL to the starting policy (kept
beside the checkpoints for a resume) and truncated importance sampling, with the metrics they add."""
from __future__ import annotations

import pytest
from grpo_harness import run_trainer

pytestmark = pytest.mark.slow


def test_kl_to_the_starting_policy_and_tis(tmp_path):
    rows = run_trainer(tmp_path, kl_coef=0.1, tis_cap=2.0)
    assert (tmp_path / "ckpt" / "reference_policy.pt").is_file()
    # step 1 trains from the reference itself: KL 0; later steps have moved away from it
    assert rows[0]["kl"] == pytest.approx(0.0, abs=1e-7)
    assert all(m["kl"] > 0 and m["kl"] == m["kl"] for m in rows[1:])
    # the engine holds the trainer's weights: importance weights are 1 up to round-off
    assert all(abs(m["tis_mean"] - 1.0) < 1e-4 for m in rows)
    assert all(m["loss"] == m["loss"] and m["weights_synced"] for m in rows)
