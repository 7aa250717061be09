"""Bad input a new user meets first: each a short error (what, where, how to fix) with the right exit code and no
traceback, through the real `v4` entry point in a subprocess."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def v4(*args, **kw):
    return subprocess.run([sys.executable, "-m", "launcher", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={**os.environ, **kw.pop("env", {})}, **kw)


def test_a_non_utf8_env_file_names_its_line(tmp_path):
    bad = tmp_path / "bad.env"
    bad.write_bytes(b"V4_WORK=/tmp/x\nV4_REDIS_PASSWORD=s\xffcret\n")
    r = v4("config", "show", "--preset", "smoke", "--env-file", str(bad))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert f"{bad}:2: not UTF-8 (byte 0xff at column 20)" in r.stderr and "iconv" in r.stderr
    assert "cret" not in r.stderr                                  # the line may hold a secret: not echoed


def test_a_closed_pipe_is_not_an_error():
    p = subprocess.Popen([sys.executable, "-m", "launcher", "config", "keys"], cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    first = p.stdout.readline()
    p.stdout.close()                                               # `| head -1`
    err = p.stderr.read().decode()
    assert p.wait(timeout=60) == 0 and first.startswith(b"V4_") and "Traceback" not in err


def test_a_mistyped_command_gets_a_suggestion():
    r = v4("confg", "show")
    assert r.returncode == 2 and "No such command 'confg'. Did you mean 'config'?" in r.stderr
    r = v4("runs", "shwo")
    assert r.returncode == 2 and "Did you mean 'show'?" in r.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_bisect_kernel_refuses_without_a_gpu(tmp_path):
    r = v4("nan", "bisect-kernel", "--shape", "1,64,64,512,128", "--out", str(tmp_path / "k"))
    assert r.returncode == 2 and "needs" not in r.stdout and "this machine has none" in r.stderr
    assert not (tmp_path / "k").exists()


def test_run_json_answers_on_stdout_when_the_run_is_refused(tmp_path):
    r = v4("run", "--preset", "rl_smoke", "--json", "--hw", "cpu", "--set", f"V4_WORK={tmp_path}")
    assert r.returncode == 4, r.stderr
    out = json.loads(r.stdout)
    assert out["status"] == "refused" and out["exit_code"] == 4 and "needs stage smoke" in out["error"]
    assert "v4 run --preset smoke" in out["fix"]
    r = v4("run", "--preset", "smoke", "--json", "--set", "PRESET_TP=banana", "--set", f"V4_WORK={tmp_path}")
    assert r.returncode == 2 and json.loads(r.stdout)["exit_code"] == 2


def test_an_unreachable_ssh_host_is_one_line_not_a_traceback():
    """A port that accepts and hangs up (no SSH banner): paramiko's transport thread would log a traceback per
    attempt; the user gets our one ConnectionError instead. In a subprocess: pytest's log capture would hide
    what a user's terminal shows."""
    script = """
import socket, threading
from launcher.nodes import SSHNode
srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen()
def hang_up():
    for _ in range(2):
        c, _ = srv.accept(); c.close()
threading.Thread(target=hang_up, daemon=True).start()
try:
    SSHNode("127.0.0.1", port=srv.getsockname()[1], connect_timeout=2, retries=2, backoff=0.01).connect()
except ConnectionError as e:
    print("ConnectionError:", e)
"""
    r = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert "unreachable after 2 attempt" in r.stdout, r.stdout + r.stderr
    assert "Traceback" not in r.stderr and "SSHException" not in r.stderr, r.stderr


def test_keys_exported_in_the_shell_show_in_the_plan_and_the_rerun_commands(tmp_path):
    env = {"PRESET_LR": "3e-4", "V4_REDIS_PASSWORD": "hunter2"}
    r = v4("run", "--preset", "smoke", "--hw", "cpu", "--dry-run", "--set", f"V4_WORK={tmp_path}", env=env)
    assert r.returncode == 0, r.stderr
    assert "from the shell's environment (as a --set would): V4_REDIS_PASSWORD=*** PRESET_LR=3e-4" in r.stdout
    assert "hunter2" not in r.stdout + r.stderr
    r = v4("run", "--preset", "rl_smoke", "--hw", "cpu", "--set", f"V4_WORK={tmp_path}", env=env)
    assert r.returncode == 4
    assert "--set PRESET_LR=3e-4 --set V4_WORK=" in r.stderr and "hunter2" not in r.stderr
