"""Weights & Biases, with the real wandb package and nothing outside this machine: preflight's `wandb` check fails
with a fix when there is no key or the server does not answer (a loopback port where nothing listens, a socket that
accepts and never answers), and the metrics writer keeps training going, with one warning, when W&B cannot start
or fails mid-run."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FAKE_KEY = "k" * 40                  # well-formed; never sent anywhere but loopback


def unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def env(tmp_path):
    """No key anywhere wandb looks (an empty HOME, no WANDB_* from outside), no error reports sent out, and
    wandb's 'logged in as' lookup off: it waits 2 x 5 s for a server that does not answer, before init_timeout."""
    home = tmp_path / "home"
    home.mkdir()
    e = {k: v for k, v in os.environ.items() if not k.startswith("WANDB") and k != "NETRC"}
    e.update(HOME=str(home), WANDB_ERROR_REPORTING="false", WANDB__DISABLE_VIEWER="true",
             PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p))
    return e


@pytest.fixture
def silent_server():
    """A loopback socket that accepts connections and never answers them."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    held, stop = [], threading.Event()

    def accept():
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(srv.accept()[0])
            except OSError:
                pass
    t = threading.Thread(target=accept, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.getsockname()[1]}"
    stop.set()
    t.join()
    for c in held:
        c.close()
    srv.close()


@pytest.fixture
def answering_server():
    """A loopback HTTP server that answers every GET (a W&B server's /healthz answers 200)."""
    class Ok(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, *a):
            pass
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Ok)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def preflight(tmp_path, env, *sets):
    args = [a for kv in ("V4_WANDB_PROJECT=v4-test", "V4_WANDB_TIMEOUT=1", *sets) for a in ("--set", kv)]
    r = subprocess.run([sys.executable, "-m", "launcher", "preflight", "--only", "wandb", "--json", "--hw", "cpu",
                        "--set", f"V4_WORK={tmp_path / 'work'}", *args], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=120)
    assert "Traceback" not in r.stderr, r.stderr
    (row,) = json.loads(r.stdout)["results"]
    return r.returncode, row


def test_preflight_fails_with_a_fix_without_a_key(tmp_path, env):
    code, row = preflight(tmp_path, env, f"V4_WANDB_BASE_URL=http://127.0.0.1:{unused_port()}")
    assert code == 3 and row["status"] == "FAIL", row
    assert "no W&B API key" in row["detail"] and "WANDB_API_KEY" in row["detail"] and ".netrc" in row["detail"]
    assert "did not answer" in row["detail"] and "refused" in row["detail"]
    assert "export WANDB_API_KEY" in row["fix"] and "wandb login --host" in row["fix"]
    assert "V4_WANDB_MODE=offline" in row["fix"]


def test_preflight_fails_when_the_server_never_answers(tmp_path, env, silent_server):
    env["WANDB_API_KEY"] = FAKE_KEY
    code, row = preflight(tmp_path, env, f"V4_WANDB_BASE_URL={silent_server}")
    assert code == 3 and row["status"] == "FAIL", row
    assert f"{silent_server} (V4_WANDB_BASE_URL) did not answer within 1 s" in row["detail"], row
    assert "no W&B API key" not in row["detail"] and "V4_WANDB_TIMEOUT=1" in row["fix"]


def test_preflight_passes_with_a_key_from_the_environment_or_netrc(tmp_path, env, answering_server):
    env["WANDB_BASE_URL"] = answering_server                  # the node's own setting, when the config has none
    code, row = preflight(tmp_path, env)
    assert code == 3 and "no W&B API key" in row["detail"] and "did not answer" not in row["detail"], row
    netrc = Path(env["HOME"]) / ".netrc"
    netrc.write_text(f"machine {answering_server.split('//')[1]}\n  login user\n  password {FAKE_KEY}\n")
    netrc.chmod(0o600)
    code, row = preflight(tmp_path, env)
    assert code == 0 and row["status"] == "PASS", row
    assert f"key from {netrc}" in row["detail"] and f"{answering_server} answered" in row["detail"]
    assert "HTTP 200" in row["detail"] and FAKE_KEY not in json.dumps(row)
    env["WANDB_API_KEY"] = FAKE_KEY
    code, row = preflight(tmp_path, env)
    assert code == 0 and "key from WANDB_API_KEY" in row["detail"], row


def test_preflight_skips_with_a_reason(tmp_path, env):
    assert preflight(tmp_path, env, "V4_WANDB_PROJECT=")[1]["status"] == "SKIP"
    code, row = preflight(tmp_path, env, "V4_WANDB_MODE=offline")
    assert code == 0 and row["status"] == "SKIP" and "offline" in row["detail"]
    code, row = preflight(tmp_path, env, "PRESET_STEPS=prepare_data")
    assert code == 0 and row["status"] == "SKIP" and "no train step" in row["detail"]



def test_preflight_names_a_bad_url_and_a_missing_package(tmp_path, env):
    env["WANDB_API_KEY"] = FAKE_KEY
    code, row = preflight(tmp_path, env, "V4_WANDB_BASE_URL=api.wandb.ai")          # no scheme: nothing is asked
    assert code == 3 and "'api.wandb.ai' is not an http(s) URL (V4_WANDB_BASE_URL)" in row["detail"], row
    assert "set V4_WANDB_BASE_URL to the W&B server's http(s) address" in row["fix"]
    # a node whose Python lacks wandb (facts as the probe reports them there)
    from launcher.config import Selection, resolve
    from launcher.preflight import CHECKS
    from launcher.preflight.registry import Context
    cfg = resolve(Selection(cluster="local", hw="cpu", sets=("V4_WANDB_PROJECT=v4-test", f"V4_WORK={tmp_path}")))
    facts = {"wandb": {"version": None, "base_url": "https://api.wandb.ai", "key_from": "", "answered": True}}
    r = CHECKS["wandb"].judge("10.0.0.1", Context(cfg=cfg, order=["10.0.0.1"], facts={"10.0.0.1": facts}))
    assert r.status == "FAIL" and "wandb is not installed" in r.detail and "pip install 'v4-launcher[wandb]'" in r.fix

# --- the metrics writer in a job's process --------------------------------------------------------------------

WRITER = r"""
import json, os, signal, sys
from pathlib import Path
import psutil
from jobs.common import RunContext
run, kill_at = Path(sys.argv[1]), int(sys.argv[2])
ctx = RunContext.load(run)
for step in range(1, 6):
    if step == kill_at:                       # the W&B service process this one started dies under it
        for p in psutil.Process().children(recursive=True):
            if p.name() == "wandb-core":
                os.kill(p.pid, signal.SIGKILL)
                p.wait(10)
    ctx.write_metrics({"step": step, "loss": 1.0 / step})
print("trained", file=sys.stderr)
"""


def write_rows(tmp_path, env, kill_at=0, **values):
    run = tmp_path / "stageA-wb"
    run.mkdir()
    cfg = {"V4_SOCKET_IFNAME": "", "V4_WANDB_PROJECT": "v4-test", "V4_WANDB_TIMEOUT": 2, **values}
    (run / "config.json").write_text(json.dumps({"values": cfg}))
    r = subprocess.run([sys.executable, "-c", WRITER, str(run), str(kill_at)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    warnings = [x for x in r.stderr.splitlines() if "warning:" in x]
    return r, rows, warnings


@pytest.mark.parametrize("server", ["no key", "silent"])
def test_training_goes_on_when_wandb_does_not_start(tmp_path, env, silent_server, server):
    """Online with no key (wandb raises UsageError), or with a key and a server that never answers (CommError once
    V4_WANDB_TIMEOUT passes): every row still reaches metrics.jsonl, with one warning and no traceback."""
    if server == "silent":
        env["WANDB_API_KEY"] = FAKE_KEY
    url = silent_server if server == "silent" else f"http://127.0.0.1:{unused_port()}"
    r, rows, warnings = write_rows(tmp_path, env, V4_WANDB_MODE="online", V4_WANDB_BASE_URL=url)
    assert r.returncode == 0 and "trained" in r.stderr, r.stderr
    assert [x["step"] for x in rows] == [1, 2, 3, 4, 5]
    assert len(warnings) == 1, r.stderr
    assert "did not start" in warnings[0] and ("UsageError" if server == "no key" else "CommError") in warnings[0]
    assert "training goes on" in warnings[0] and "v4 preflight --only wandb" in warnings[0]
    assert "Traceback" not in r.stderr, r.stderr


def test_training_goes_on_when_wandb_fails_mid_run(tmp_path, env):
    """The W&B service dies after step 2: wandb.log raises from step 3 on; one warning, the rest of the rows
    in metrics.jsonl, nothing at exit (wandb's own exit hook would print the broken service's traceback)."""
    r, rows, warnings = write_rows(tmp_path, env, kill_at=3, V4_WANDB_MODE="offline")
    assert r.returncode == 0 and "trained" in r.stderr, r.stderr
    assert [x["step"] for x in rows] == [1, 2, 3, 4, 5]
    assert len(warnings) == 1 and "W&B stopped taking this run's metrics at step 3" in warnings[0], r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert list((tmp_path / "stageA-wb" / "wandb").glob("offline-run-*/run-stageA-wb.wandb"))   # steps 1-2 kept
