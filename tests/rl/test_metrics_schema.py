"""The metrics.jsonl schema (launcher/metrics.py) against what the RL loop really writes: three GRPO steps on the
tiny model, each row through the jobs' own writer (RunContext.write_metrics), read back with none of its lines
malformed and every value of its declared type; the run reads as an RL run, which `v4 runs compare` holds apart
from SFT runs."""
from __future__ import annotations

import json

from grpo_harness import run_trainer

from jobs.common import RunContext
from launcher import compare, metrics


def test_rl_rows_are_rows_of_the_schema(tmp_path):
    rows = run_trainer(tmp_path / "trainer")
    run = tmp_path / "rl-run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"values": {"V4_SOCKET_IFNAME": ""}}))
    ctx = RunContext.load(run)
    for row in rows:
        ctx.write_metrics(row)
    got = metrics.read(run)
    assert not got.bad and got.steps == [1, 2, 3]
    declared = set(metrics.MetricsRow.model_fields)
    # every key the loop writes is declared, with its type
    assert set(rows[0]) <= declared, f"declare {set(rows[0]) - declared} in launcher/metrics.py MetricsRow"
    assert got.rows == rows
    assert compare.run_mode(run, got.rows) == "rl"
    # a row of the right keys but a wrong type is a malformed line, with its file:line
    with open(run / "metrics.jsonl", "a") as f:
        f.write(json.dumps({**rows[0], "step": 4, "weights_synced": "yes"}) + "\n")
    (bad,) = metrics.read(run).bad
    assert (bad.line, bad.why) == (4, "weights_synced: input should be a valid boolean (got 'yes')")
