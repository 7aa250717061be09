"""A rollout temperature the engines would treat as greedy (below SGLang's 1e-6) while the trainer scores at it is a
configuration error; 0 (greedy) and ordinary temperatures plan. The floor is the engine's own constant."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def v4(work: Path, *args):
    return subprocess.run([sys.executable, "-m", "launcher", *args, "--hw", "cpu", "--set", f"V4_WORK={work}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_the_floor_is_the_engines():
    from dsv4.rl.api import SAMPLING_EPS
    from launcher.config.checks import RL_SAMPLING_EPS
    assert RL_SAMPLING_EPS == SAMPLING_EPS


@pytest.mark.parametrize("t, ok", [("1e-40", False), ("0.0000005", False), ("-1", False), ("0", True),
                                   ("0.000001", True), ("0.7", True)])
def test_rl_temperature_below_the_greedy_floor_is_refused(tmp_path, t, ok):
    r = v4(tmp_path, "config", "validate", "--preset", "rl_smoke", "--set", f"PRESET_RL_TEMPERATURE={t}")
    if ok:
        assert r.returncode == 0, r.stderr
    else:
        assert r.returncode == 2, r.stderr
        assert f"PRESET_RL_TEMPERATURE={float(t)} (cli --set PRESET_RL_TEMPERATURE) must be 0 (greedy) or >= 1e-06" in r.stderr
        assert "Traceback" not in r.stderr
