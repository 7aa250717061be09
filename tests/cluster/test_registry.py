"""The run registry: ids, atomic files, manifest contents, steps, lookup, status."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from launcher import registry
from launcher.config import Selection, resolve
from launcher.errors import ConfigError


@pytest.fixture
def cfg(tmp_path, monkeypatch):
    monkeypatch.setenv("V4_REDIS_PASSWORD", "hunter2")
    monkeypatch.setenv("HTTP_PROXY", "http://bob:s3cret@proxy:3128")
    monkeypatch.setenv("HF_TOKEN", "hf_abc")
    return resolve(Selection(cluster="local", hw="cpu", sets=(f"V4_WORK={tmp_path}",)))


def test_run_id_format():
    rid = registry.new_run_id("smoke")
    assert re.fullmatch(r"smoke-\d{8}-\d{6}-[0-9a-f]{4}", rid)
    assert registry.RUN_ID_RE.match(rid).group("prefix") == "smoke"
    assert registry.RUN_ID_RE.match("my-run-20260101-000000-abcd").group("prefix") == "my-run"


def test_create_run_manifest(cfg):
    run = registry.create_run(cfg, prefix="t", argv=["v4", "run", "--preset", "smoke"])
    assert run.dir == Path(cfg["V4_OUT"]) / run.id and run.info()["status"] == "running"
    m = run.read_json("manifest.json")
    assert m["command_line"] == ["v4", "run", "--preset", "smoke"]
    assert m["config"]["values"]["V4_REDIS_PASSWORD"] == "***"
    assert m["config"]["provenance"]["V4_WORK"]["from"].startswith("cli")
    sha = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[2]).stdout.strip()
    assert m["code"]["sha"] == sha and isinstance(m["code"]["dirty"], bool)
    text = run.path("manifest.json").read_text()
    for secret in ("hunter2", "s3cret", "hf_abc"):
        assert secret not in text
    assert m["env"]["HTTP_PROXY"] == "http://***@proxy:3128" and m["env"]["HF_TOKEN"] == "***"
    assert not [p for p in run.dir.iterdir() if p.name.endswith(".tmp")]


def test_private_files_and_atomic_replace(cfg):
    run = registry.create_run(cfg, prefix="t")
    p = run.write_json("config.json", {"values": {"V4_REDIS_PASSWORD": "x"}}, private=True)
    assert (p.stat().st_mode & 0o777) == 0o600
    run.write_json("config.json", {"v": 2}, private=True)
    assert run.read_json("config.json") == {"v": 2}


def test_steps_and_finish(cfg):
    run = registry.create_run(cfg, prefix="t")
    run.set_step("train", "running", submission_id="j1")
    run.set_step("train", "failed", exit_code=1)
    run.set_step("train", "running", submission_id="j1-r1")
    s = run.step_status("train")
    assert s["status"] == "running" and s["submission_ids"] == ["j1", "j1-r1"] and s["exit_code"] == 1
    run.finish("stopped", error="by hand")
    run.finish("failed", error="job stopped")           # the stop explains the failure: kept
    assert run.info()["status"] == "stopped"
    with pytest.raises(AssertionError):
        run.finish("weird")


def test_find_and_list(cfg):
    a = registry.create_run(cfg, run_id="aa-20260101-000000-0001")
    b = registry.create_run(cfg, run_id="ab-20260102-000000-0002")
    assert registry.find_run(cfg, "aa").id == a.id
    assert registry.find_run(cfg, "latest").id == b.id
    with pytest.raises(ConfigError, match="ambiguous"):
        registry.find_run(cfg, "a")
    with pytest.raises(ConfigError, match="no run"):
        registry.find_run(cfg, "zz")
    # a run whose launcher process is gone shows as interrupted
    dead = subprocess.Popen([sys.executable, "-c", "pass"]); dead.wait()
    b.update(launcher={"host": os.uname().nodename, "pid": dead.pid})
    a.finish("passed")
    assert [(r["id"], r["status"]) for r in registry.list_runs(cfg)] == [(a.id, "passed"), (b.id, "interrupted")]


def test_secret_sets_are_redacted_in_the_manifest(cfg):
    argv = ["v4", "run", "--preset", "smoke", "--set", "V4_REDIS_PASSWORD=hunter2", "--set=V4_REDIS_PASSWORD=hunter3",
            "--set", "PRESET_NUM_STEPS=3"]
    run = registry.create_run(cfg, prefix="t", argv=argv)
    assert run.read_json("manifest.json")["command_line"] == [
        "v4", "run", "--preset", "smoke", "--set", "V4_REDIS_PASSWORD=***", "--set=V4_REDIS_PASSWORD=***",
        "--set", "PRESET_NUM_STEPS=3"]
    assert "hunter" not in run.path("manifest.json").read_text()


def test_a_stopped_run_stays_stopped(cfg):
    """`v4 runs stop` wins over a launcher that finishes its step afterwards; only --resume reopens the run."""
    run = registry.create_run(cfg, prefix="t")
    run.finish("stopped", error="stopped by `v4 runs stop`", code=1)
    run.finish("passed")
    assert run.info()["status"] == "stopped" and run.stopped
    reopened = registry.open_run(cfg, type("P", (), {"run_id": run.id})())
    assert reopened.info()["status"] == "running" and reopened.info()["error"] is None
    reopened.finish("passed")
    assert reopened.info()["status"] == "passed"


def test_resume_drops_the_earlier_verdict(cfg):
    """A resumed run that then fails must not show the gates and summary of an earlier attempt."""
    run = registry.create_run(cfg, prefix="t")
    run.write_json("gates.json", [{"name": "finite_loss", "passed": True, "detail": "old"}])
    run.write_json("summary.json", {"status": "passed"})
    run.finish("failed", error="train: job FAILED", code=1)
    registry.open_run(cfg, type("P", (), {"run_id": run.id})())
    assert not run.path("gates.json").exists() and not run.path("summary.json").exists()
    assert run.info()["exit_code"] is None and run.info()["finished_at"] is None


def test_resume_resolves_latest_and_prefixes_or_refuses(cfg):
    a = registry.create_run(cfg, run_id="stageA-20260101-000000-0001")
    b = registry.create_run(cfg, run_id="stageA-20260102-000000-0002")
    assert registry.resolve_resume(cfg, "latest") == b.id
    assert registry.resolve_resume(cfg, "stageA-20260101") == a.id
    for ref in ("nonexist", "x; rm -rf /", "", "stageA"):
        with pytest.raises(ConfigError) as e:
            registry.resolve_resume(cfg, ref)
        assert e.value.code == 2 and "v4 runs ls" in e.value.fix
