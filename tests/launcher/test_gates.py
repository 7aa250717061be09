"""Gates pass on good evidence, fail on bad or missing evidence (NaN included)."""
from __future__ import annotations

import json

import pytest

from launcher.config import Selection, resolve
from launcher.gates import evaluate, left_out, passed_stages, record_pass


def write_run(tmp_path, losses, grad=1.0, reload=None, step_time=1.0, peak=1.0):
    run = tmp_path / "run"
    (run / "steps/train").mkdir(parents=True)
    with open(run / "metrics.jsonl", "w") as f:
        for i, loss in enumerate(losses):
            f.write(json.dumps({"step": i + 1, "loss": loss, "grad_norm": grad, "step_time_s": step_time,
                                "peak_mem_gb": peak}) + "\n")
    if reload is not None:
        (run / "steps/train/reload_check.json").write_text(json.dumps(reload))
    return run


def cfg(tmp_path, **sets):
    return resolve(Selection(preset="smoke", hw="cpu",
                             sets=(f"V4_WORK={tmp_path}", *(f"{k}={v}" for k, v in sets.items()))))


def by_name(results):
    return {r.name: r for r in results}


def test_good_run_passes(tmp_path):
    run = write_run(tmp_path, [5.0, 4.0, 3.0], reload={"loss_continued": 2.5, "loss_reloaded": 2.5})
    res = by_name(evaluate(["finite_loss", "loss_decreasing", "reload_equal", "peak_memory", "step_time"], run,
                           cfg(tmp_path)))
    assert all(r.passed for r in res.values()), res


def test_nan_fails_finite_and_decreasing(tmp_path):
    run = write_run(tmp_path, [5.0, float("nan")])
    res = by_name(evaluate(["finite_loss", "loss_decreasing"], run, cfg(tmp_path)))
    assert not res["finite_loss"].passed and "step(s) [2]" in res["finite_loss"].detail
    assert not res["loss_decreasing"].passed


def test_reload_mismatch_or_missing_fails(tmp_path):
    run = write_run(tmp_path, [5.0, 4.0], reload={"loss_continued": 2.5, "loss_reloaded": 2.5000001})
    assert not evaluate(["reload_equal"], run, cfg(tmp_path))[0].passed
    run2 = write_run(tmp_path / "b", [5.0, 4.0])
    r = evaluate(["reload_equal"], run2, cfg(tmp_path))[0]
    assert not r.passed and "missing" in r.detail


def test_budgets(tmp_path):
    run = write_run(tmp_path, [5.0, 4.0, 3.0], step_time=2.0, peak=10.0)
    c = cfg(tmp_path, HW_PEAK_MEM_BUDGET_GB=8, HW_STEP_TIME_BUDGET_S=1)
    res = by_name(evaluate(["peak_memory", "step_time"], run, c))
    assert not res["peak_memory"].passed and not res["step_time"].passed


def test_budget_gates_fail_on_a_nan_anywhere(tmp_path):
    """max()/median() would skip a NaN that is not the first value; the gates must not."""
    run = write_run(tmp_path, [5.0, 4.0, 3.0])
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    rows[2]["peak_mem_gb"] = rows[1]["step_time_s"] = float("nan")
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for budgets in ({}, {"HW_PEAK_MEM_BUDGET_GB": 8, "HW_STEP_TIME_BUDGET_S": 10}):
        res = by_name(evaluate(["peak_memory", "step_time"], run, cfg(tmp_path, **budgets)))
        assert not res["peak_memory"].passed and "step(s) [3]" in res["peak_memory"].detail, res
        assert not res["step_time"].passed and "step(s) [2]" in res["step_time"].detail, res


def test_no_metrics_fails(tmp_path):
    (tmp_path / "empty").mkdir()
    assert not evaluate(["finite_loss"], tmp_path / "empty", cfg(tmp_path))[0].passed


def test_stage_passes_are_per_cluster_and_hw(tmp_path):
    c = cfg(tmp_path)
    assert passed_stages(c) == {}
    record_pass(c, "smoke", "stageA-x", [])
    assert passed_stages(c)["smoke"]["run_id"] == "stageA-x"
    other = resolve(Selection(preset="smoke", hw="cpu", sets=(f"V4_WORK={tmp_path}", "V4_CLUSTER_NAME=other")))
    assert passed_stages(other) == {}


def test_malformed_metrics_lines_are_skipped_and_said(tmp_path):
    """A job killed mid-write leaves a truncated line: the gates judge the rest and say what they skipped."""
    run = write_run(tmp_path, [5.0, 4.0, 3.0], reload={"loss_continued": 2.5, "loss_reloaded": 2.5})
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "loss": 2.\n')                   # truncated
    res = by_name(evaluate(["finite_loss", "loss_decreasing"], run, cfg(tmp_path)))
    assert all(r.passed for r in res.values()), res
    assert all("skipped 1 malformed line(s) of metrics.jsonl (line 4)" in r.detail for r in res.values()), res


def test_gates_do_not_pass_on_what_skipping_left_out(tmp_path):
    run = write_run(tmp_path, [5.0])
    (run / "metrics.jsonl").write_text((run / "metrics.jsonl").read_text() + '{"step": 2, "lo\n[1, 2]\n')
    res = by_name(evaluate(["finite_loss", "loss_decreasing"], run, cfg(tmp_path)))
    assert not res["loss_decreasing"].passed and "needs >= 2 steps, got 1" in res["loss_decreasing"].detail
    assert "skipped 2 malformed line(s)" in res["loss_decreasing"].detail
    (run / "metrics.jsonl").write_text('{"step": 1, "loss"\n')      # nothing readable at all
    r = evaluate(["finite_loss"], run, cfg(tmp_path))[0]
    assert not r.passed and "no metrics" in r.detail and "skipped 1 malformed line(s)" in r.detail
    # a row without the metric a gate needs fails that gate; it does not raise
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n{"step": 2, "grad_norm": 1.0}\n')
    res = by_name(evaluate(["loss_decreasing", "step_time"], run, cfg(tmp_path)))
    assert not res["loss_decreasing"].passed and "None" in res["loss_decreasing"].detail
    assert not res["step_time"].passed


def test_concurrent_stage_passes_are_all_kept(tmp_path, monkeypatch):
    """Runs finishing together (other clusters, other stages) share stages.json: none may lose the others' pass."""
    import threading
    import time

    from launcher import gates

    slow = gates.atomic_write

    def slow_write(*a, **kw):               # widen the read-modify-write window the lock must close
        time.sleep(0.05)
        slow(*a, **kw)
    monkeypatch.setattr(gates, "atomic_write", slow_write)
    c = cfg(tmp_path)
    stages = [f"stage{i}" for i in range(8)]
    threads = [threading.Thread(target=record_pass, args=(c, s, f"run-{s}", [])) for s in stages]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(passed_stages(c)) == stages
    assert not [p.name for p in (tmp_path / "runs").iterdir() if p.name.endswith(".tmp")]


def test_a_cut_down_run_of_a_stage_is_not_a_pass_of_it(tmp_path):
    """All its gates pass, but it left out steps and gates the preset has: the next stage stays locked."""
    from launcher import pipeline
    from launcher.registry import Run

    run = Run("stageA-20261130-000000-abcd", write_run(tmp_path, [5.0, 4.0, 3.0]))
    plan = type("P", (), {"run_id": run.id})()
    cut = cfg(tmp_path, PRESET_GATES="finite_loss", PRESET_STEPS="weights train")
    assert left_out(cut) == ["step prepare_data", "step verify_template", "step dequantize", "step convert",
                             "gate loss_decreasing", "gate reload_equal"]
    pipeline._gates(cut, run, plan)
    assert passed_stages(cut) == {}
    full = cfg(tmp_path)
    assert left_out(full) == [] and left_out(cfg(tmp_path, PRESET_GATES="finite_loss loss_decreasing reload_equal "
                                                              "peak_memory")) == []
    (run.dir / "steps/train/reload_check.json").write_text(json.dumps({"loss_continued": 2.5, "loss_reloaded": 2.5}))
    pipeline._gates(full, run, plan)
    assert passed_stages(full)["smoke"]["run_id"] == run.id


def write_rl_run(tmp_path, rewards, diff=0.0, synced=True):
    run = tmp_path / "rlrun"
    run.mkdir(parents=True)
    with open(run / "metrics.jsonl", "w") as f:
        for i, r in enumerate(rewards):
            f.write(json.dumps({"step": i + 1, "loss": 0.0, "grad_norm": 1.0, "reward_mean": r,
                                "logprob_diff_max": diff if i == len(rewards) - 1 else 0.0,
                                "weights_synced": synced, "sync_max_err": 0.0}) + "\n")
    return run


def rl_cfg(tmp_path):
    return resolve(Selection(preset="rl_smoke", hw="cpu", sets=(f"V4_WORK={tmp_path}",)))


RL_GATES = ["reward_rising", "logprob_match", "weights_synced"]


def test_rl_gates_pass_on_a_rising_reward_and_matching_engine(tmp_path):
    res = by_name(evaluate(RL_GATES, write_rl_run(tmp_path, [0.1] * 5 + [0.9] * 5), rl_cfg(tmp_path)))
    assert all(r.passed for r in res.values()), res


def test_rl_gates_fail_on_a_flat_reward_a_mismatch_nan_or_no_read_back(tmp_path):
    c = rl_cfg(tmp_path)
    assert not by_name(evaluate(RL_GATES, write_rl_run(tmp_path / "a", [0.5] * 10), c))["reward_rising"].passed
    assert not by_name(evaluate(RL_GATES, write_rl_run(tmp_path / "b", [0.1] * 4), c))["reward_rising"].passed
    nan = by_name(evaluate(RL_GATES, write_rl_run(tmp_path / "c", [0.1] * 5 + [float("nan")] * 5, diff=float("nan")), c))
    assert not nan["reward_rising"].passed and not nan["logprob_match"].passed
    assert not by_name(evaluate(RL_GATES, write_rl_run(tmp_path / "d", [0.1] * 10, diff=0.5), c))["logprob_match"].passed
    unread = by_name(evaluate(RL_GATES, write_rl_run(tmp_path / "e", [0.1] * 10, synced=None), c))
    assert not unread["weights_synced"].passed and "no read-back" in unread["weights_synced"].detail
    off = by_name(evaluate(RL_GATES, write_rl_run(tmp_path / "f", [0.1] * 10, synced=False), c))
    assert not off["weights_synced"].passed


def test_a_stage_passed_with_other_settings_does_not_count(tmp_path):
    """The pass records the cluster and hardware values it relied on: another image (or GPU count, or interpreter)
    is another configuration, and the refusal names what changed; the executor or a port is not."""
    c = cfg(tmp_path)
    record_pass(c, "smoke", "stageA-x", [])
    same = resolve(Selection(preset="smoke", hw="cpu", sets=(f"V4_WORK={tmp_path}", "V4_EXECUTOR=local",
                                                              "V4_RAY_PORT=7001")))
    assert passed_stages(same)["smoke"]["differences"] == []
    other = resolve(Selection(preset="smoke", hw="cpu", sets=(f"V4_WORK={tmp_path}", "V4_PYTHON=/opt/py/bin/python")))
    diff = passed_stages(other)["smoke"]["differences"]
    assert len(diff) == 1 and diff[0].startswith("V4_PYTHON: ") and diff[0].endswith("-> '/opt/py/bin/python'")
    from launcher.errors import GateError
    from launcher.pipeline import check_stage_order
    rl = resolve(Selection(preset="rl_smoke", hw="cpu", sets=(f"V4_WORK={tmp_path}", "V4_PYTHON=/opt/py/bin/python")))
    with pytest.raises(GateError, match=r"passed in run stageA-x, but with other cluster or hardware settings: V4_PYTHON"):
        check_stage_order(rl, force=False)
    check_stage_order(resolve(Selection(preset="rl_smoke", hw="cpu", sets=(f"V4_WORK={tmp_path}",))), force=False)


def test_the_baseline_gate_follows_a_named_run(tmp_path):
    """"This change must not move the loss": the run's metrics against a baseline run's, step by step."""
    c = cfg(tmp_path)
    base = tmp_path / "runs" / "stageA-base"
    base.mkdir(parents=True)
    write_run(tmp_path, [5.0, 4.0, 3.0]).rename(base / "r")
    (base / "r" / "metrics.jsonl").rename(base / "metrics.jsonl")
    same = write_run(tmp_path, [5.0, 4.0, 3.0])
    gate = lambda run, **s: by_name(evaluate(["baseline"], run, cfg(tmp_path, **s)))["baseline"]
    r = gate(same, PRESET_BASELINE_RUN="stageA-base")
    assert r.passed and "follow stageA-base over 3 steps" in r.detail
    (same / "metrics.jsonl").write_text((same / "metrics.jsonl").read_text().replace('"loss": 3.0', '"loss": 3.01'))
    r = gate(same, PRESET_BASELINE_RUN="stageA-base")
    assert not r.passed and "loss diverged from baseline stageA-base from step 3 (3.0 vs 3.01)" in r.detail
    assert gate(same, PRESET_BASELINE_RUN="stageA-base", PRESET_BASELINE_TOL=0.01).passed
    assert not gate(same, PRESET_BASELINE_RUN="stageA-none").passed
    assert not gate(same).passed
    good = (base / "metrics.jsonl").read_text()
    (base / "metrics.jsonl").write_text("\n".join(good.splitlines()[:2]) + "\n")      # the baseline stopped at step 2
    r = gate(same, PRESET_BASELINE_RUN="stageA-base", PRESET_BASELINE_TOL=0.01)
    assert not r.passed and "stageA-base has no row for step 3" in r.detail, r.detail
    (base / "metrics.jsonl").write_text(good + "{not json\n")                          # a line nobody can read
    r = gate(same, PRESET_BASELINE_RUN="stageA-base", PRESET_BASELINE_TOL=0.01)
    assert not r.passed and "1 malformed line in stageA-base's metrics.jsonl" in r.detail, r.detail
    (base / "metrics.jsonl").write_text('{"step": 1, "tokens_per_s": 5.0}\n')        # nothing to compare
    r = gate(same, PRESET_BASELINE_RUN="stageA-base")
    assert not r.passed and "no metric in common" in r.detail
