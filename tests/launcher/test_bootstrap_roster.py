"""`v4 bootstrap --exclude-bad-nodes`'s decisions, without hosts (launcher/commands/bootstrap.py): a failing worker
left out with a standby in its place and the roster every later command carries; the head never left out; the
V4_MIN_NODES floor; a step that runs again judges its nodes again; the listing says what is left out. The walk on
real hosts: tests/cluster/test_bootstrap_exclude_netns.py."""
from __future__ import annotations

import json

import pytest

from launcher import recovery
from launcher.commands import bootstrap as bs
from launcher.config import Selection, resolve
from launcher.preflight import CheckResult

NODES = ("10.9.0.2", "10.9.0.3", "10.9.0.4")
STANDBY = "10.9.0.9"


def config(tmp_path, **extra):
    values = {"V4_CLUSTER_NAME": "three", "V4_TRANSPORT": "ssh", "V4_MASTER_IP": NODES[0],
              "V4_WORKER_IPS": " ".join(NODES[1:]), "V4_NUM_NODES": "3", "V4_NUM_GPUS_PER_NODE": "1",
              "V4_WORK": str(tmp_path / "work"), "V4_LOCAL_DIR": "/tmp/v4r-{node_ip}", **extra}
    p = tmp_path / "three.env"
    p.write_text("".join(f'{k}="{v}"\n' for k, v in values.items()))
    return resolve(Selection(cluster=str(p), hw="cpu"))


def fail(node: str, name: str = "disk") -> dict:
    return {node: [CheckResult(name, node, "FAIL", f"{name} is bad on {node}", "fix it")]}


def step(name: str):
    return next(s for s in bs.STEPS if s.name == name)


def test_a_failing_worker_is_left_out_a_standby_in_its_place(tmp_path):
    cfg = config(tmp_path, V4_STANDBY_IPS=STANDBY)
    state, said = {"steps": {}}, []
    why, taken = bs.leave_out(cfg, state, step("preflight"), fail(NODES[2]), said.append)
    assert (why, taken) == ("", [STANDBY])
    [e] = bs.left_out(state)
    assert (e.ip, e.step, e.checks, e.replaced_by, e.run) == (NODES[2], "preflight", ["disk"], STANDBY, "bootstrap")
    assert said == [f"  leaving out {NODES[2]}: disk: disk is bad on {NODES[2]}; standby {STANDBY} takes its place",
                    f"  going on with 3 node(s): {NODES[0]} {NODES[1]} {STANDBY}"]
    new, sets = bs.roster(cfg, bs.left_out(state))
    assert new.nodes == [NODES[0], NODES[1], STANDBY]
    assert sets == [f"--set 'V4_WORKER_IPS={NODES[1]} {STANDBY}'", "--set V4_NUM_NODES=3", "--set V4_STANDBY_IPS="]
    assert new.origin("V4_WORKER_IPS").where == f"bootstrap: {NODES[2]} left out (preflight: disk)"
    assert NODES[2] in recovery.quarantined(cfg)                        # `v4 cluster status` names it
    # the standby fails the step run again with it: out too, and no standby is left for it
    why, taken = bs.leave_out(cfg, state, step("preflight"), fail(STANDBY, "shared_work"), said.append)
    assert (why, taken) == ("", [])
    assert bs.roster(cfg, bs.left_out(state))[0].nodes == [NODES[0], NODES[1]]


def test_the_head_is_never_left_out_nor_the_cluster_below_its_floor(tmp_path):
    cfg = config(tmp_path)
    state = {"steps": {}}
    why, _ = bs.leave_out(cfg, state, step("ssh"), {**fail(NODES[0]), **fail(NODES[1])}, print)
    assert why.startswith(f"ssh failed on the head {NODES[0]}, which --exclude-bad-nodes never leaves out")
    assert f"disk: disk is bad on {NODES[0]}" in why and "V4_MASTER_IP" in why
    floor = config(tmp_path, V4_MIN_NODES="3")
    why, _ = bs.leave_out(floor, state, step("preflight"), fail(NODES[1]), print)
    assert why.startswith(f"preflight failed on {NODES[1]} (disk); leaving them out: 2 node(s) would be left")
    assert "fewer than V4_MIN_NODES=3" in why and "lower V4_MIN_NODES" in why
    assert bs.left_out(state) == [] and recovery.quarantined(cfg) == {}   # nothing recorded of a refusal


def test_the_listing_carries_the_roster_and_a_step_run_again_judges_again(tmp_path, capsys, monkeypatch):
    from launcher.cli import main
    cfg = config(tmp_path)
    state = bs.load_state(cfg)
    bs.leave_out(cfg, state, step("preflight"), fail(NODES[1]), lambda m: None)
    state["steps"] = {n: {"status": "passed", "at": 1e9} for n in ("validate", "ssh", "preflight")}
    bs.save_state(cfg, state)
    with pytest.raises(SystemExit) as e:
        main(["bootstrap", "--cluster", cfg.selection.cluster, "--hw", "cpu", "--dry-run", "--json"])
    assert e.value.code in (0, None)
    listed = json.loads(capsys.readouterr().out)
    assert [(x["ip"], x["step"], x["checks"]) for x in listed["left_out"]] == [(NODES[1], "preflight", ["disk"])]
    up = next(x for x in listed["steps"] if x["step"] == "up")
    assert up["command"].endswith(f"--set V4_WORKER_IPS={NODES[2]} --set V4_NUM_NODES=2")
    # preflight run again (`--from preflight`, or after it failed) judges every node again: passing now, the node it
    # had left out is back, in the checklist's roster and out of the cluster's quarantine record
    ran = []
    monkeypatch.setattr(bs, "run_preflight", lambda st, words: ran.append(" ".join(words)) or (0, [], False))
    with pytest.raises(SystemExit) as e:
        main(["bootstrap", "--cluster", cfg.selection.cluster, "--hw", "cpu", "--from", "preflight",
              "--until", "preflight"])
    assert e.value.code in (0, None)
    assert ran == [f"--cluster {cfg.selection.cluster} --hw cpu"]                 # all three nodes
    assert bs.load_state(cfg)["left_out"] == [] and recovery.quarantined(cfg) == {}
