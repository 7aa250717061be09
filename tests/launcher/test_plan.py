"""`v4 run --dry-run`: the whole plan, every node and step, as text or JSON, touching nothing; what a job's
working_dir leaves behind."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from launcher.cli import main
from launcher.plan import WORKING_DIR_EXCLUDES, working_dir_excludes

ROOT = Path(__file__).resolve().parents[2]
H20_NODES = ["10.0.8.17", *(f"10.0.8.{i}" for i in range(10, 17))]


def dry_run(capsys, *extra, as_json=False):
    args = ["run", "--preset", "smoke", "--hw", "h200", "--cluster", "h20_8node", "--dry-run", *extra]
    with pytest.raises(SystemExit) as e:
        main(args + (["--json"] if as_json else []))
    out, err = capsys.readouterr()
    assert e.value.code == 0, err
    return out


def test_text_plan_names_every_node_and_step(capsys):
    out = dry_run(capsys)
    for ip in H20_NODES:
        assert f"on {ip} (" in out
    assert out.count("ray.scripts.scripts start --head") == 1
    assert out.count("ray.scripts.scripts start --address=10.0.8.17:6379") == 7
    assert out.count("docker run -d --name \"$NAME\" --label v4.launcher=h20_8node") == 8
    for step in ("preflight", "cluster-up", "weights", "prepare_data", "verify_template", "dequantize",
                 "convert", "train", "gates"):
        assert f"] {step} -- " in out
    assert "ray job submit --address http://10.0.8.17:8201" in out
    assert "-m jobs.train_sft --run-dir /data_fast_v3/v4-sft/runs/stageA-" in out


def test_json_plan_parses_with_env_and_entrypoints(capsys):
    plan = json.loads(dry_run(capsys, as_json=True))
    steps = {s["name"]: s for s in plan["steps"]}
    assert list(steps) == ["preflight", "cluster-up", "weights", "prepare_data", "verify_template", "dequantize",
                           "convert", "train", "gates"]
    assert len(steps["cluster-up"]["nodes"]) == 8
    train = steps["train"]["job"]
    assert train["entrypoint"].endswith(f"--run-dir {plan['run_dir']}")
    assert train["runtime_env"]["excludes"] == working_dir_excludes(ROOT)
    env = train["runtime_env"]["env_vars"]
    assert env["MASTER_ADDR"] == "10.0.8.17" and env["NCCL_NVLS_ENABLE"] == "0"
    assert env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"


def test_dry_run_touches_nothing(tmp_path):
    """No files (the run directory is under V4_WORK), no SSH, no Ray: run it with an empty PATH."""
    work = tmp_path / "work"
    env = {**os.environ, "PATH": "/nonexistent"}   # no ssh, no ray, no docker reachable
    r = subprocess.run([sys.executable, "-m", "launcher", "run", "--preset", "smoke", "--cluster", "h20_8node",
                        "--hw", "h200", "--dry-run", "--set", f"V4_WORK={work}"],
                       cwd=ROOT, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert str(work) in r.stdout and not work.exists()


@pytest.mark.parametrize("cmd", [["run", "--preset", "smoke", "--dry-run"], ["bootstrap", "--dry-run"]])
def test_a_dry_run_on_the_local_default_records_no_ports(tmp_path, cmd):
    """The local default's `auto` ports: a dry run picks them for its plan but writes no ports.json (the first real
    command records its own pick); a record that exists is what it shows."""
    local = tmp_path / "local"
    args = [sys.executable, "-m", "launcher", *cmd, "--hw", "cpu", "--set", f"V4_WORK={tmp_path / 'work'}",
            "--set", f"V4_LOCAL_DIR={local}"]
    r = subprocess.run(args, cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert not local.exists() and not (tmp_path / "work").exists()
    from launcher.config.ports import RECORD_NAME, Record
    import msgspec
    local.mkdir()
    (local / RECORD_NAME).write_bytes(msgspec.json.encode(Record(local_dir=str(local), ports={
        "V4_RAY_PORT": 24440, "V4_DASHBOARD_PORT": 24441, "V4_RAY_CLIENT_PORT": 24442})))
    shown = subprocess.run([*args, "--json"] if cmd[0] == "run" else args, cwd=ROOT, capture_output=True, text=True)
    assert shown.returncode == 0, shown.stderr
    if cmd[0] == "run":
        assert "24440" in shown.stdout
    assert sorted(p.name for p in local.iterdir()) == [RECORD_NAME]


def test_dry_run_with_a_config_error_exits_2(capsys):
    with pytest.raises(SystemExit) as e:
        main(["run", "--preset", "long_context", "--cluster", "h20_8node", "--dry-run"])
    assert e.value.code == 2
    assert "TP*PP*CP = 128 does not divide the world size 64" in capsys.readouterr().err


def test_working_dir_upload_leaves_out_what_git_ignores(tmp_path):
    """Ray reads .gitignore files itself but not .git/info/exclude: the plan's excludes name those paths too.
    Checked with Ray's own packaging, the zip a job's working_dir becomes."""
    from ray._private.runtime_env.packaging import create_package

    root = tmp_path / "checkout"
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    (root / "code.py").write_text("x = 1\n")
    (root / ".gitignore").write_text("scratch/\n")
    for d, f in (("scratch", "a.txt"), ("bundles", "big.tar"), ("launcher/__pycache__", "m.pyc")):
        (root / d).mkdir(parents=True)
        (root / d / f).write_text("data")
    (root / ".git" / "info" / "exclude").write_text("bundles/\n")

    def packaged(excludes, name):
        create_package(str(root), tmp_path / name, include_gitignore=True, excludes=excludes)
        return set(zipfile.ZipFile(tmp_path / name).namelist())

    excludes = working_dir_excludes(root)
    assert excludes == WORKING_DIR_EXCLUDES + ["/bundles/", "/scratch/"]     # __pycache__ is in the list already
    assert "bundles/big.tar" in packaged(WORKING_DIR_EXCLUDES, "before.zip")     # what Ray alone would upload
    after = packaged(excludes, "after.zip")
    assert {"code.py", ".gitignore"} <= after
    assert not [n for n in after if n.startswith(("bundles", "scratch", ".git/", "launcher/__pycache__"))]


def test_working_dir_excludes_outside_git(tmp_path):
    assert working_dir_excludes(tmp_path) == WORKING_DIR_EXCLUDES
