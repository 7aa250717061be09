"""launcher/recovery.py's parts that need no cluster: the smaller world a run goes on with (its configuration
re-derived, or a refusal naming what no longer fits), standbys in the cluster file, the run's and the cluster's
records, the metrics rows a restarted job supersedes, the saves a killed job cut short, and `runs show`.
The netns tests (tests/cluster/test_recovery_netns.py) run all of it on real hosts."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from launcher import recovery, registry
from launcher.config import Selection, resolve
from launcher.config.checks import InvalidConfig

ROOT = Path(__file__).resolve().parents[2]
NODES = ("10.9.0.2", "10.9.0.3", "10.9.0.4")


def cluster_file(tmp_path: Path, **extra) -> str:
    """Three SSH nodes that nothing here connects to, one gloo process each (hw=cpu): only the configuration."""
    values = {"V4_CLUSTER_NAME": "three", "V4_TRANSPORT": "ssh", "V4_MASTER_IP": NODES[0],
              "V4_WORKER_IPS": " ".join(NODES[1:]), "V4_NUM_NODES": "3", "V4_NUM_GPUS_PER_NODE": "1",
              "V4_WORK": str(tmp_path / "work"), "V4_LOCAL_DIR": "/tmp/v4r-{node_ip}", **extra}
    p = tmp_path / "three.env"
    p.write_text("".join(f'{k}="{v}"\n' for k, v in values.items()))
    return str(p)


def config(tmp_path, *sets, **extra):
    return resolve(Selection(cluster=cluster_file(tmp_path, **extra), hw="cpu", preset="smoke",
                             sets=("PRESET_NUM_NODES=0", "PRESET_GLOBAL_BATCH_SIZE=6", *sets)))


def test_a_node_left_out_re_derives_the_world_and_says_where_from(tmp_path):
    base = config(tmp_path)
    assert base["WORLD_SIZE"] == 3 and base["DP"] == 3
    new = recovery.derive(base, [NODES[1]], [], f"run R: {NODES[1]} left out (preflight: disk)")
    assert new.nodes == [NODES[0], NODES[2]] and new["V4_NUM_NODES"] == 2
    assert new["WORLD_SIZE"] == 2 and new["DP"] == 2 and new["GRAD_ACCUM_STEPS"] == 3
    assert new.origin("V4_WORKER_IPS").where == f"run R: {NODES[1]} left out (preflight: disk)"
    assert new.origin("PRESET_NUM_STEPS").where == base.origin("PRESET_NUM_STEPS").where
    # what a person reruns is their selection: the launcher's values never reach a printed command
    assert new.selection == base.selection and recovery.derive(base, [], [], "") is base


def test_a_layout_that_no_longer_divides_is_refused_naming_it(tmp_path):
    base = config(tmp_path, "PRESET_GLOBAL_BATCH_SIZE=9")              # DP 3 divides 9; DP 2 does not
    with pytest.raises(recovery.Refused) as e:
        recovery.derive(base, [NODES[2]], [], "run R")
    assert f"with {NODES[2]} left out the run does not fit the 2 node(s) left" in e.value.message
    assert "PRESET_GLOBAL_BATCH_SIZE=9" in e.value.message and "MICRO_BATCH_SIZE*DP = 1*2" in e.value.message
    assert "PRESET_GLOBAL_BATCH_SIZE" in e.value.fix


def test_the_floor_and_the_head(tmp_path):
    base = config(tmp_path, V4_MIN_NODES="3")
    with pytest.raises(recovery.Refused, match=r"2 node\(s\) would be left .*fewer than V4_MIN_NODES=3 \(.*three.env:"):
        recovery.derive(base, [NODES[1]], [], "run R")
    with pytest.raises(recovery.Refused, match=f"the head {NODES[0]} cannot be left out"):
        recovery.derive(config(tmp_path), [NODES[0]], [], "run R")


def test_a_standby_takes_the_place_of_a_node(tmp_path):
    base = config(tmp_path, V4_STANDBY_IPS="10.9.0.9 10.9.0.10")
    assert base.nodes == list(NODES) and base["WORLD_SIZE"] == 3      # standbys are not nodes until needed
    new = recovery.derive(base, [NODES[1]], ["10.9.0.9"], "run R")
    assert new.nodes == [NODES[0], NODES[2], "10.9.0.9"] and new["WORLD_SIZE"] == 3
    assert new["V4_STANDBY_IPS"] == ["10.9.0.10"]


@pytest.mark.parametrize("extra,message", [
    ({"V4_STANDBY_IPS": NODES[2]}, "names 10.9.0.4 twice, or as a node of the cluster"),
    ({"V4_STANDBY_IPS": "10.9.0.9 10.9.0.9"}, "names 10.9.0.9 twice"),
    ({"V4_STANDBY_IPS": "bad;host"}, "V4_STANDBY_IPS entry 'bad;host'"),
    ({"V4_MIN_NODES": "5"}, "V4_MIN_NODES=5 .* is more than the cluster's 3 node\\(s\\) and 0 standby"),
    ({"V4_NODE_DEAD_TIMEOUT": "0"}, "V4_NODE_DEAD_TIMEOUT=0.0 .* must be > 0 seconds"),
])
def test_cluster_file_checks_of_standbys_and_floor(tmp_path, extra, message):
    with pytest.raises(InvalidConfig, match=message):
        config(tmp_path, **extra)


def test_max_restarts_is_an_operational_count(tmp_path):
    with pytest.raises(InvalidConfig, match="PRESET_MAX_RESTARTS=-1 .* must be >= 0"):
        config(tmp_path, "PRESET_MAX_RESTARTS=-1")


def test_the_run_record_is_applied_again_on_resume(tmp_path):
    base = config(tmp_path, V4_STANDBY_IPS="10.9.0.9")
    run = registry.create_run(base)
    rec = recovery.RunRecovery(left_out=[recovery.LeftOut(ip=NODES[2], why="DEAD in the Ray GCS", by="lost", at=1.0,
                                                          run=run.id, step="train", replaced_by="10.9.0.9")],
                               standby_in=["10.9.0.9"])
    run.update(recovery=rec.model_dump())
    cur = recovery.Recovery(base, run).current()
    assert cur.nodes == [NODES[0], NODES[1], "10.9.0.9"]
    assert "left out (lost: train)" in cur.origin("V4_NUM_NODES").where and run.id in cur.origin("V4_NUM_NODES").where
    # a record this launcher did not write is an error naming the file, not a traceback
    run.update(recovery={"left_out": [{"ip": 3}]})
    with pytest.raises(recovery.JobError, match="run.json: its \"recovery\" record"):
        recovery.run_record(run)


def test_the_quarantine_record_and_readmission(tmp_path):
    cfg = config(tmp_path)
    assert recovery.quarantined(cfg) == {}
    recovery.quarantine(cfg, [recovery.LeftOut(ip=NODES[1], why="disk: 0.1 GB free", by="preflight", at=2.0,
                                                run="R", checks=["disk"])])
    assert recovery.quarantine_path(cfg) == tmp_path / "work" / ".v4-quarantine" / "three.json"
    assert recovery.quarantined(cfg)[NODES[1]].checks == ["disk"]
    said = []
    recovery.readmit(cfg, [NODES[0], NODES[1]], said.append)
    assert recovery.quarantined(cfg) == {} and said == [
        f"[preflight] {NODES[1]} passes again: no longer left out (run R left it out: disk: 0.1 GB free)"]


def test_a_restarted_job_supersedes_the_rows_past_its_checkpoint(tmp_path, monkeypatch):
    """A killed job logged steps 1-3 (the third cut off mid-write); its checkpoint is step 2. The next job's first row
    (step 3) moves step 3's row and the torn line to metrics.superseded.jsonl: each step is in metrics.jsonl once."""
    from jobs.common import RunContext
    from launcher import metrics
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"values": {"V4_SOCKET_IFNAME": "lo"}}))
    first = [{"step": s, "loss": 10.0 - s} for s in (1, 2, 3)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in first) + '{"step": 4, "lo')
    monkeypatch.setenv("V4_RESTARTS", "1")
    monkeypatch.setenv("V4_STEP_ATTEMPT", "1")
    ctx = RunContext.load(run)
    ctx._tb = None                              # TensorBoard is not what this test is about
    for s in (3, 4):
        ctx.write_metrics({"step": s, "loss": 5.0 - s})
    got = metrics.read(run)
    assert got.bad == [] and got.steps == [1, 2, 3, 4]
    assert [r["loss"] for r in got.rows] == [9.0, 8.0, 2.0, 1.0]
    assert [r.get("restarts") for r in got.rows] == [None, None, 1, 1]
    gone = [json.loads(x) for x in (run / "metrics.superseded.jsonl").read_text().splitlines()]
    assert [g.get("step") for g in gone] == [3, None] and gone[1]["line"] == '{"step": 4, "lo'
    assert all(g["by_attempt"] == 1 and g["resumed_at_step"] == 3 for g in gone)


def test_saves_cut_short_are_removed_and_the_pointer_is_kept(tmp_path):
    from dsv4.megatron.train import LATEST, drop_unfinished_saves, latest_checkpoint
    ck = tmp_path / "checkpoints"
    for it in (2, 4, 6):
        (ck / f"iter_{it:07d}").mkdir(parents=True)
    (ck / "iter_0000004" / "shard").write_text("x")
    (ck / LATEST).write_text("4")
    gone = drop_unfinished_saves(ck)
    assert [p.name for p in gone] == ["iter_0000006"]
    assert sorted(p.name for p in ck.glob("iter_*")) == ["iter_0000002", "iter_0000004"]   # retained ones stay
    assert latest_checkpoint(ck) == ck / "iter_0000004"
    (ck / LATEST).unlink()                       # no pointer yet: no save ever finished
    assert len(drop_unfinished_saves(ck)) == 2 and not list(ck.glob("iter_*"))


def test_runs_show_tells_the_restarts_at_a_glance(tmp_path, capsys):
    from launcher.cli import main
    cfg = config(tmp_path)
    run = registry.create_run(cfg)
    run.write_json("config.json", {"values": cfg.job_values()})
    rec = recovery.RunRecovery(
        left_out=[recovery.LeftOut(ip=NODES[2], why="DEAD in the Ray GCS", by="lost", at=1e9, run=run.id,
                                   step="train")],
        restarts=[recovery.Restart(n=1, step="train", cause="node_lost", detail=f"node {NODES[2]} lost",
                                   nodes=[NODES[2]], at=1e9, job=f"{run.id}-train", job_elapsed_s=40.0,
                                   noticed_after_s=1.5, from_step=4, last_step=5, steps_lost=1, world_before=3,
                                   world_after=2, nodes_after=list(NODES[:2]), next_job=f"{run.id}-train-r1"),
                  recovery.Restart(n=2, step="train", cause="hung", detail="rank 1 did not arrive; no progress",
                                   at=1e9 + 60, job=f"{run.id}-train-r1", job_elapsed_s=30.0, noticed_after_s=12.0,
                                   from_step=6, last_step=6, steps_lost=0, world_before=2, world_after=2,
                                   nodes_after=list(NODES[:2]), stacks=str(run.dir / "restarts/2/hang"))])
    run.update(recovery=rec.model_dump())
    # the RL job's rollout engine lost in step 7's rollout, in the step's second job (its record, as the job writes it)
    from dsv4.rl.restart import Restarter
    run.set_step("train", "failed", submission_id=f"{run.id}-train")
    run.set_step("train", "running", submission_id=f"{run.id}-train-r1")
    record = run.dir / "steps" / "train" / "rollout_restarts.jsonl"
    Restarter(lambda: "engine", 5, record, log=lambda m: None, spent=2, attempt=1).restart(
        ConnectionError("cannot reach the engine"), 7, "rollout", lambda eng: None, samples=128)
    with pytest.raises(SystemExit) as e:
        main(["runs", "show", run.id, "--cluster", cfg.selection.cluster, "--hw", "cpu"])
    out = capsys.readouterr().out
    assert e.value.code in (0, None), out
    assert ("restarts: 3 of PRESET_MAX_RESTARTS=2 for the run (0 left), 1 step(s) trained twice, 1 of the rollout "
            "engine (128 sample(s) rolled out again)") in out
    assert "train step 7  rollout engine lost during rollout: ConnectionError: cannot reach the engine" in out
    assert f"with the current weights; 128 sample(s) rolled out again; job {run.id}-train-r1" in out
    assert out.index("#2 ") < out.index("  engine ")                      # in time order: the engine's is the latest
    assert f"#1 2001-09-09 " in out and f"train  node lost: {NODES[2]}, noticed 2 s after the GCS declared it" in out
    assert f"resumed from step 4 (1 step(s) lost); world 3 -> 2; job {run.id}-train -> {run.id}-train-r1" in out
    assert "#2 " in out and "hung: rank 1 did not arrive, after 12 s without a heartbeat" in out
    assert f"stacks {run.dir}/restarts/2/hang" in out
    assert f"left out: {NODES[2]} (lost in train, " in out
    with pytest.raises(SystemExit):
        main(["runs", "show", run.id, "--cluster", cfg.selection.cluster, "--hw", "cpu", "--json"])
    shown = json.loads(capsys.readouterr().out)["recovery"]
    assert [r["cause"] for r in shown["restarts"]] == ["node_lost", "hung"]
    [engine] = shown["engine_restarts"]
    assert (engine["step"], engine["phase"], engine["samples"], engine["job"]) == (7, "rollout", 128,
                                                                                 f"{run.id}-train-r1")
    assert (shown["max_restarts"], shown["restarts_spent"], shown["restarts_left"]) == (2, 3, 0)


def test_a_resume_may_change_the_restart_budget(tmp_path):
    """PRESET_MAX_RESTARTS says how a run recovers, not what it computes: a resume with another is no conflict."""
    cfg = config(tmp_path)
    run = registry.create_run(cfg)
    run.write_json("config.json", {"values": cfg.job_values()})
    assert registry.resume_conflicts(run, config(tmp_path, "PRESET_MAX_RESTARTS=5")) == []
    assert registry.resume_conflicts(run, config(tmp_path, "PRESET_NUM_STEPS=3")) == ["PRESET_NUM_STEPS: 6 -> 3"]


def test_the_gcs_node_table_judged(monkeypatch):
    """What the node watch makes of the GCS's table: a node ALIVE again under a new id is not lost; one whose every
    entry is DEAD is, with the GCS's words and the time since its latest death; one absent is too."""
    import time as t
    now_ms = int(t.time() * 1000)
    node = lambda ip, state, ended=0, msg=None: recovery._GcsNode(node_id=f"{ip}-{ended}", node_ip=ip, state=state,
                                                                   end_time_ms=ended, state_message=msg)
    table = [node(NODES[0], "ALIVE"), node(NODES[1], "DEAD", now_ms - 60_000), node(NODES[1], "ALIVE"),
             node(NODES[2], "DEAD", now_ms - 2_000, "health check failed\nx"), node(NODES[2], "DEAD", now_ms - 90_000)]
    assert recovery.judge_table(list(NODES[:2]), table) is None
    lost = recovery.judge_table(list(NODES) + ["10.9.0.9"], table)
    assert lost.nodes == [NODES[2], "10.9.0.9"] and lost.how == "gcs"
    assert lost.why == {NODES[2]: "DEAD in the Ray GCS (health check failed)",
                        "10.9.0.9": "not in the Ray GCS's node table"}
    assert 1.5 <= lost.after_s < 10                                     # its latest death, not the one before


def test_the_restart_budget_is_the_runs_over_its_launches(tmp_path):
    """A resume finds what the run's earlier launches spent -- a step's restarts in run.json and the rollout engines
    its RL job restarted -- and restarts nothing more once PRESET_MAX_RESTARTS is spent, saying how to raise it; a
    resume with a higher budget has the difference. Each job learns the spent count (the RL job's engine budget)."""
    from types import SimpleNamespace

    from dsv4.rl.restart import EngineGone, Restarter
    from launcher.plan import JobSpec
    cfg = config(tmp_path)
    run = registry.create_run(cfg)
    rec = recovery.RunRecovery(restarts=[recovery.Restart(
        n=1, step="train", cause="hung", detail="rank 1 did not arrive", at=1e9, job=f"{run.id}-train",
        job_elapsed_s=30.0, from_step=2, last_step=2, steps_lost=0, world_before=3, world_after=3,
        nodes_after=list(NODES))])
    run.update(recovery=rec.model_dump())
    record = run.dir / "steps" / "train" / "rollout_restarts.jsonl"
    Restarter(lambda: "engine", 2, record, log=lambda m: None, spent=1).restart(
        ConnectionError("refused"), 3, "sync", lambda eng: None)
    assert recovery.spent(run) == 2
    with pytest.raises(EngineGone, match=r"no restart is left \(PRESET_MAX_RESTARTS=2: the run has restarted 2 "):
        Restarter(lambda: "engine", 2, record, log=lambda m: None, spent=2).restart(
            ConnectionError("refused"), 4, "rollout", lambda eng: None)

    again = recovery.Recovery(cfg, run, progress=lambda m: None)             # a later launch: --resume
    hung = SimpleNamespace(hang={"message": "rank 0 did not arrive", "stalled_s": 12.0}, lost=None, status="HUNG",
                           message="", submission_id=f"{run.id}-train-r1", elapsed_s=20.0)
    assert again.restart(cfg, SimpleNamespace(name="train"), hung) is None
    assert again.note.startswith("no restart left: PRESET_MAX_RESTARTS=2 (default) is spent: run "
                                 f"{run.id} has restarted 2 time(s) (1 hung, 1 rollout engine; all before this "
                                 "launch); to allow more, resume it with --set PRESET_MAX_RESTARTS=3"), again.note
    assert again.budget_line().startswith("resume: PRESET_MAX_RESTARTS=2 (default) is spent, so a lost node")
    assert len(recovery.run_record(run).restarts) == 1
    more = recovery.Recovery(config(tmp_path, "PRESET_MAX_RESTARTS=3"), run)
    assert more.budget_line() == f"resume: run {run.id} has restarted 2 time(s); 1 of PRESET_MAX_RESTARTS=3 left"
    job = JobSpec(submission_id="j", entrypoint="true", runtime_env={}, entrypoint_num_cpus=0, entrypoint_num_gpus=0,
                  timeout_s=1, submit="")
    recovery.mark_restart(job, 1, 2, recovery.spent(run))
    assert job.runtime_env["env_vars"] == {"V4_STEP_ATTEMPT": "2", "V4_RESTARTS_SPENT": "2", "V4_RESTARTS": "1"}
