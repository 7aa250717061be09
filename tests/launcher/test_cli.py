"""The `v4` command line: every command loads and documents itself; completion answers."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.cli import COMMANDS, main

ROOT = Path(__file__).resolve().parents[2]


def test_help_lists_every_command_and_the_exit_codes(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0
    for name in COMMANDS:
        assert f"  {name}" in out
    assert "  16   non-finite loss/gradient detected" in out


@pytest.mark.parametrize("name", list(COMMANDS))
def test_each_command_has_help(capsys, name):
    with pytest.raises(SystemExit) as e:
        main([name, "--help"])
    assert e.value.code == 0 and "Usage: v4 " + name in capsys.readouterr().out


def test_shell_completion_completes_presets_and_commands():
    env = {**os.environ, "_V4_COMPLETE": "bash_complete", "COMP_WORDS": "v4 run --preset cp_", "COMP_CWORD": "3"}
    r = subprocess.run([sys.executable, "-m", "launcher"], env=env, cwd=ROOT, capture_output=True, text=True)
    assert "cp_smoke" in r.stdout
    env.update(COMP_WORDS="v4 clu", COMP_CWORD="1")
    r = subprocess.run([sys.executable, "-m", "launcher"], env=env, cwd=ROOT, capture_output=True, text=True)
    assert "cluster" in r.stdout
