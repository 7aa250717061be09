"""PRESET_RUN_ID_PREFIX begins every run id, which names the run's directory and its Ray jobs and lands in shell
commands: a value that cannot make a run id is a configuration error that names the key and where it was set,
found before a run is planned (not a complaint about `--resume`, which the command line did not use)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def v4(work: Path, *args):
    return subprocess.run([sys.executable, "-m", "launcher", *args, "--hw", "cpu", "--set", f"V4_WORK={work}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("prefix, says", [
    ("../up", "is not valid"), ("a/b", "is not valid"), ("a b", "is not valid"), ("x$(id)", "is not valid"),
    ("x--y", "is not valid"), ("-x", "is not valid"), ("", "is empty"),
])
def test_a_prefix_that_cannot_make_a_run_id_is_a_config_error(tmp_path, prefix, says):
    for args in (("run", "--preset", "smoke", "--dry-run"), ("config", "validate", "--preset", "smoke")):
        r = v4(tmp_path, *args, "--set", f"PRESET_RUN_ID_PREFIX={prefix}")
        assert r.returncode == 2, r.stderr
        assert f"PRESET_RUN_ID_PREFIX={prefix} (cli --set PRESET_RUN_ID_PREFIX) {says}" in r.stderr, r.stderr
        assert "PREFIX-YYYYmmdd-HHMMSS-xxxx" in r.stderr and "--resume" not in r.stderr
    assert not (tmp_path / "runs").exists()


def test_a_prefix_of_parts_joined_by_dashes_plans(tmp_path):
    r = v4(tmp_path, "run", "--preset", "smoke", "--dry-run", "--json", "--set", "PRESET_RUN_ID_PREFIX=exp-7.b_2")
    assert r.returncode == 0, r.stderr
    assert '"run_id": "exp-7.b_2-' in r.stdout
