"""SGLang rollout servers (launcher/rollout.py): the rendered server command and environment, the plan's
rollout-up/rollout-down steps on every rollout node, the config checks that refuse layouts SGLang would refuse, the
health wait's deadline against real local ports, the process record's scoped stop with real processes, and (only
where SGLang is installed) the rendered command line parsed by SGLang's own argparse.

SGLang itself cannot run here: it serves only on a GPU (../shared/reference/rl-reference.md §1.3). Nothing in these
tests stands in for it; the one HTTP server below answers the health endpoint and nothing else."""
from __future__ import annotations

import http.server
import importlib.util
import json
import os
import shlex
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from launcher import rollout
from launcher.cli import main
from launcher.config import Selection, resolve
from launcher.config.checks import InvalidConfig
from launcher.errors import CLUSTER_FAILED, ClusterError, JobError
from launcher.nodes import LocalNode

ROOT = Path(__file__).resolve().parents[2]
BF16 = "/data_fast_v3/v4-sft/models/generated/4layer-3f7cb46f-s1234/bf16"     # rl_smoke's (8 experts) generated checkpoint on h20_8node


def h20(**sets) -> object:
    """rl_smoke on the 8 x 8 H20 cluster's file with the H200 hardware layer (8 GPUs a node), SGLang rollouts."""
    sets = {"V4_ROLLOUT_ENGINE": "sglang", **sets}
    return resolve(Selection(cluster="h20_8node", hw="h200", preset="rl_smoke",
                             sets=tuple(f"{k}={v}" for k, v in sets.items())))


def refused(**sets) -> list[str]:
    with pytest.raises(InvalidConfig) as e:
        h20(**sets)
    return e.value.errors


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- the rendered command ------------------------------------------------------------------------------

GOLDEN_ARGV = [
    "python3", "-m", "sglang.launch_server",
    "--model-path", BF16, "--host", "10.0.8.10", "--port", "30000",
    "--tp-size", "4", "--ep-size", "4", "--dp-size", "2", "--mem-fraction-static", "0.6",
    "--trust-remote-code", "--skip-tokenizer-init", "--enable-return-routed-experts", "--enable-memory-saver",
    "--dsv4-attn-backend", "flashmla", "--no-enable-decoder-swa-bounded-replay", "--enable-deterministic-inference",
    "--max-running-requests", "64", "--json-model-override-args", '{"a": 1}',
]
GOLDEN_COMMAND = f"""python3 -m sglang.launch_server \\
    --model-path {BF16} \\
    --host 10.0.8.10 \\
    --port 30000 \\
    --tp-size 4 \\
    --ep-size 4 \\
    --dp-size 2 \\
    --mem-fraction-static 0.6 \\
    --trust-remote-code \\
    --skip-tokenizer-init \\
    --enable-return-routed-experts \\
    --enable-memory-saver \\
    --dsv4-attn-backend flashmla \\
    --no-enable-decoder-swa-bounded-replay \\
    --enable-deterministic-inference \\
    --max-running-requests 64 \\
    --json-model-override-args '{{"a": 1}}'"""
LAYOUT = dict(V4_ROLLOUT_NODES='"10.0.8.10 10.0.8.11"', V4_ROLLOUT_TP=4, V4_ROLLOUT_DP=2, V4_ROLLOUT_EP=4,
              V4_ROLLOUT_MEM_FRACTION=0.6,
              # as an env file (or --set) writes it: double quotes, the JSON's own quotes escaped
              V4_ROLLOUT_EXTRA_ARGS=r'''"--max-running-requests 64 --json-model-override-args '{\"a\": 1}'"''')


@pytest.fixture(scope="module")
def layout_cfg():
    return h20(**LAYOUT)


def test_extra_args_layout_resolves(layout_cfg):
    assert layout_cfg["V4_ROLLOUT_EXTRA_ARGS"] == """--max-running-requests 64 --json-model-override-args '{"a": 1}'"""


def test_server_argv_golden(layout_cfg):
    cfg = layout_cfg
    assert rollout.model_path(cfg) == BF16 == cfg["CKPT_BF16_DIR"]
    assert rollout.server_argv(cfg, "10.0.8.10") == GOLDEN_ARGV
    assert rollout.server_argv(cfg, "10.0.8.11")[6] == "10.0.8.11"              # --host: each node its own address
    assert rollout.shell_command(GOLDEN_ARGV) == GOLDEN_COMMAND
    # the quoting round-trips: the shell runs exactly the argv
    assert shlex.split(GOLDEN_COMMAND.replace("\\\n", " ")) == GOLDEN_ARGV


def test_server_env_golden(layout_cfg):
    nodes = ",".join(["localhost", "127.0.0.1", "10.0.8.17", *(f"10.0.8.{i}" for i in range(10, 17))])
    proxy = "http://172.26.0.3:8081"
    assert rollout.server_env(layout_cfg) == {
        "SGLANG_DSV4_FP4_EXPERTS": "0",               # FP8 experts: what the trainer pushes
        "HF_HOME": "/data_fast_v3/v4-sft/.cache/huggingface",
        "http_proxy": proxy, "https_proxy": proxy, "HTTP_PROXY": proxy, "HTTPS_PROXY": proxy,
        "no_proxy": nodes, "NO_PROXY": nodes,
        "NCCL_NVLS_ENABLE": "0",
    }


def test_start_and_stop_scripts(layout_cfg):
    cmds = rollout.server_commands(layout_cfg)
    assert [c.ip for c in cmds] == ["10.0.8.10", "10.0.8.11"]
    c = cmds[0]
    assert c.url == "http://10.0.8.10:30000" and c.state_dir == "/data0/v4-local/sglang30000"
    assert layout_cfg["ROLLOUT_URLS"] == ["http://10.0.8.10:30000", "http://10.0.8.11:30000"]
    assert "setsid " + GOLDEN_COMMAND + " \\\n  </dev/null >\"$STATE/sglang.log\" 2>&1 &" in c.start
    assert "export SGLANG_DSV4_FP4_EXPERTS=0\n" in c.start
    assert 'export NCCL_SOCKET_IFNAME="$IFNAME"' in c.start          # V4_SOCKET_IFNAME=auto: the default route's
    assert "export V4_ROLLOUT_SESSION=v4-h20_8node-10.0.8.10-30000-" in c.start
    assert f"SPEC={rollout.spec_digest(c.argv, c.env)}\n" in c.start
    assert 'rollout_procs.py" record "$STATE" "$PID"' in c.start
    assert 'rollout_procs.py" stop "$STATE"' in c.stop and "launch_server" not in c.stop
    assert "pkill" not in c.start + c.stop and "killall" not in c.start + c.stop   # never by name
    for script in (c.start, c.stop):
        r = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr


def test_spec_changes_with_the_command_line(layout_cfg):
    """`up` keeps a running server of ours only when it was started with the same command line and environment."""
    a = rollout.server_commands(layout_cfg)[0]
    b = rollout.server_commands(h20(**{**LAYOUT, "V4_ROLLOUT_MEM_FRACTION": 0.5}))[0]
    assert rollout.spec_digest(a.argv, a.env) != rollout.spec_digest(b.argv, b.env)
    assert rollout.spec_digest(a.argv, a.env) == rollout.spec_digest(list(a.argv), dict(a.env))


def test_colocated_by_default():
    cfg = h20()
    assert cfg["ROLLOUT_NODES"] == ["10.0.8.17"]                   # rl_smoke trains on one node: the head
    assert rollout.server_argv(cfg, "10.0.8.17")[:13] == [
        "python3", "-m", "sglang.launch_server", "--model-path", BF16, "--host", "10.0.8.17", "--port", "30000",
        "--tp-size", "1", "--ep-size", "1"]
    assert "--dsv4-attn-backend" in rollout.server_argv(cfg, "10.0.8.17")
    full = h20(PRESET_NUM_NODES=0, PRESET_GLOBAL_BATCH_SIZE=64)
    assert full["ROLLOUT_NODES"] == full.nodes


def test_the_embedded_engine_renders_nothing():
    cfg = resolve(Selection(cluster="h20_8node", hw="h200", preset="rl_smoke"))
    assert not rollout.enabled(cfg) and rollout.server_commands(cfg) == [] and "ROLLOUT_NODES" not in cfg
    sft = h20().selection
    cfg = resolve(Selection(cluster=sft.cluster, hw=sft.hw, preset="smoke", sets=sft.sets))
    assert not rollout.enabled(cfg)                                 # SFT: no rollouts at all


# --- the plan ---------------------------------------------------------------------------------------------

def _dry_run(capsys, monkeypatch, *sets, as_json=False):
    args = ["run", "--preset", "rl_smoke", "--cluster", "h20_8node", "--hw", "h200", "--dry-run",
            "--set", "V4_ROLLOUT_ENGINE=sglang", *(x for s in sets for x in ("--set", s))]
    with pytest.raises(SystemExit) as e:
        main(args + (["--json"] if as_json else []))
    out, err = capsys.readouterr()
    assert e.value.code == 0, err
    return out


def test_dry_run_shows_every_server_command(capsys, monkeypatch):
    nodes = ["10.0.8.10", "10.0.8.11", "10.0.8.12"]
    out = _dry_run(capsys, monkeypatch, f"V4_ROLLOUT_NODES={' '.join(nodes)}")
    assert out.index("] convert -- ") < out.index("] rollout-up -- ") < out.index("] train -- ") \
        < out.index("] rollout-down -- ") < out.index("] gates -- ")
    up = out[out.index("] rollout-up -- "):out.index("] train -- ")]
    down = out[out.index("] rollout-down -- "):out.index("] gates -- ")]
    for ip in nodes:
        assert f"on {ip} (rollout server):" in up and f"on {ip} (rollout server):" in down
        assert f"--host {ip} \\" in up
    assert up.count("setsid python3 -m sglang.launch_server") == 3
    assert up.count("<launcher/node_scripts/rollout_procs.py>") == 3          # the node script abbreviated
    assert "deadline 900 s" in up and "GET /health_generate" in up
    assert down.count('rollout_procs.py" stop "$STATE"') == 3
    assert "10.0.8.17 (rollout server)" not in out
    assert "GRPO against the SGLang rollout servers" in out


def test_dry_run_json_lists_the_rollout_steps(capsys, monkeypatch):
    plan = json.loads(_dry_run(capsys, monkeypatch, as_json=True))
    names = [s["name"] for s in plan["steps"]]
    assert names[-5:] == ["convert", "rollout-up", "train", "rollout-down", "gates"]
    up = next(s for s in plan["steps"] if s["name"] == "rollout-up")
    assert up["kind"] == "rollout" and list(up["nodes"]) == ["10.0.8.17 (rollout server)"]
    (script,) = up["nodes"]["10.0.8.17 (rollout server)"]
    assert "--host 10.0.8.17 \\" in script and "--model-path " + BF16 in script
    train = next(s for s in plan["steps"] if s["name"] == "train")
    assert train["module"] == "jobs.train_rl" and BF16 in train["inputs"]


def test_no_rollout_steps_with_the_embedded_engine(capsys, monkeypatch):
    plan = json.loads(_dry_run(capsys, monkeypatch, "V4_ROLLOUT_ENGINE=embedded", as_json=True))
    assert not [s for s in plan["steps"] if s["kind"] == "rollout"]


# --- config checks -----------------------------------------------------------------------------------------

def test_sglang_needs_a_gpu():
    with pytest.raises(InvalidConfig) as e:
        resolve(Selection(cluster="local", hw="cpu", preset="rl_smoke", sets=("V4_ROLLOUT_ENGINE=sglang",)))
    (msg,) = e.value.errors
    assert msg == ("V4_ROLLOUT_ENGINE=sglang (cli --set V4_ROLLOUT_ENGINE) but HW_DEVICE=cpu (hw/cpu.env:2): SGLang "
                   "cannot serve without a GPU; use V4_ROLLOUT_ENGINE=embedded")


def test_tp_times_dp_must_divide_a_nodes_gpus():
    (msg,) = refused(V4_ROLLOUT_TP=3)
    assert msg.startswith("V4_ROLLOUT_TP*V4_ROLLOUT_DP = 3*1 = 3 GPUs per server does not divide the 8 GPUs")
    assert "V4_NUM_GPUS_PER_NODE=8 (envs/cluster/h20_8node.env:" in msg
    (msg,) = refused(V4_ROLLOUT_TP=4, V4_ROLLOUT_DP=4)               # 16 GPUs a server, 8 a node
    assert "4*4 = 16" in msg and "V4_ROLLOUT_DP=4 (cli --set V4_ROLLOUT_DP)" in msg
    h20(V4_ROLLOUT_TP=2, V4_ROLLOUT_DP=2)                          # 4 of 8: divides


def test_ep_must_divide_tp():
    (msg,) = refused(V4_ROLLOUT_TP=4, V4_ROLLOUT_DP=2, V4_ROLLOUT_EP=8)
    assert msg.startswith("V4_ROLLOUT_EP=8 (cli --set V4_ROLLOUT_EP) must divide V4_ROLLOUT_TP=4 (cli --set "
                          "V4_ROLLOUT_TP)") and "TP*DP = 8 is not enough" in msg
    h20(V4_ROLLOUT_TP=8, V4_ROLLOUT_EP=8)


def test_ep_must_divide_the_experts():
    errors = refused(V4_ROLLOUT_TP=8, V4_ROLLOUT_EP=8, PRESET_MODEL_OVERRIDES="n_routed_experts=12")
    assert any(e.startswith("V4_ROLLOUT_EP=8 (cli --set V4_ROLLOUT_EP) does not divide the model's 12 routed experts")
               for e in errors), errors


def test_rollout_port_joins_the_port_checks():
    (msg,) = refused(V4_ROLLOUT_PORT=8201)
    assert msg == ("V4_ROLLOUT_PORT=8201 (cli --set V4_ROLLOUT_PORT) collides with V4_DASHBOARD_PORT=8201 "
                   "(envs/cluster/h20_8node.env:25)")
    assert any("V4_ROLLOUT_PORT=0 (cli --set V4_ROLLOUT_PORT) is not a valid port" in e
               for e in refused(V4_ROLLOUT_PORT=0))
    # the embedded engine listens on nothing: its port may be anything
    resolve(Selection(cluster="h20_8node", hw="h200", preset="rl_smoke", sets=("V4_ROLLOUT_PORT=8201",)))


def test_rollout_nodes_must_be_cluster_nodes():
    (msg,) = refused(V4_ROLLOUT_NODES="10.0.8.10 10.9.9.9")
    assert msg.startswith("V4_ROLLOUT_NODES entries 10.9.9.9 (cli --set V4_ROLLOUT_NODES) are not nodes of the cluster")
    (msg,) = refused(V4_ROLLOUT_NODES="10.0.8.10 10.0.8.10")
    assert "names a node twice" in msg


def test_extra_args_are_shell_words_without_the_launchers_flags():
    (msg,) = refused(V4_ROLLOUT_EXTRA_ARGS="--tp-size=2")
    assert msg == ("V4_ROLLOUT_EXTRA_ARGS=--tp-size=2 (cli --set V4_ROLLOUT_EXTRA_ARGS) sets --tp-size, which the "
                   "launcher sets from V4_ROLLOUT_TP: set that instead and drop --tp-size from the extra args")
    (msg,) = refused(V4_ROLLOUT_EXTRA_ARGS="--chunked-prefill-size 'x")
    assert "is not a list of shell words (No closing quotation)" in msg


def test_ranges():
    errors = refused(V4_ROLLOUT_TP=0, V4_ROLLOUT_HEALTH_TIMEOUT=0)
    assert "V4_ROLLOUT_TP=0 (cli --set V4_ROLLOUT_TP) must be >= 1" in errors
    assert "V4_ROLLOUT_HEALTH_TIMEOUT=0.0 (cli --set V4_ROLLOUT_HEALTH_TIMEOUT) must be > 0 seconds" in errors
    (msg,) = refused(V4_ROLLOUT_MEM_FRACTION=1.2)
    assert msg.startswith("V4_ROLLOUT_MEM_FRACTION=1.2 (cli --set V4_ROLLOUT_MEM_FRACTION) must be in (0, 1]")


def test_config_validate_exits_2_naming_the_keys(capsys):
    with pytest.raises(SystemExit) as e:
        main(["config", "validate", "--preset", "rl_smoke", "--hw", "cpu", "--set", "V4_ROLLOUT_ENGINE=sglang"])
    assert e.value.code == 2
    assert "SGLang cannot serve without a GPU; use V4_ROLLOUT_ENGINE=embedded" in capsys.readouterr().err


# --- the health wait, against real local ports ---------------------------------------------------------------

class HealthOnly(http.server.BaseHTTPRequestHandler):
    """Answers GET /health_generate: 503 for the first `busy` requests (as a server still loading does), then 200;
    404 for any other path. A stand-in for the health endpoint only, never for SGLang."""
    busy = 0
    seen: list[str] = []

    def do_GET(self):
        type(self).seen.append(self.path)
        if self.path != "/health_generate":
            self.send_error(404)
            return
        if type(self).busy > 0:
            type(self).busy -= 1
            self.send_error(503)
            return
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def health_server():
    handler = type("Handler", (HealthOnly,), {"busy": 0, "seen": []})
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv, handler
    srv.shutdown()
    srv.server_close()


def test_nothing_listening_fails_fast_naming_the_node():
    """A real local port where nothing listens: exit 5 (cluster bring-up failed) naming the node, once the
    deadline has passed, not later."""
    port, lines = free_port(), []
    t0 = time.monotonic()
    with pytest.raises(ClusterError) as e:
        rollout.wait_healthy({"127.0.0.1": f"http://127.0.0.1:{port}"}, timeout=1.5, progress=lines.append)
    assert 1.4 < time.monotonic() - t0 < 6
    assert e.value.code == CLUSTER_FAILED == 5
    assert e.value.message.startswith("rollout server(s) not healthy after 1.5 s (V4_ROLLOUT_HEALTH_TIMEOUT): "
                                      f"127.0.0.1 (http://127.0.0.1:{port}/health_generate: ")
    assert "Refused" in e.value.message and "V4_ROLLOUT_HEALTH_TIMEOUT" in e.value.fix


def test_a_health_endpoint_that_answers_200(health_server):
    """The stdlib server stands in for the health endpoint only: SGLang cannot serve without a GPU."""
    srv, handler = health_server
    handler.busy = 2                          # two 503s first, as while the weights load
    lines = []
    rollout.wait_healthy({"node-a": f"http://127.0.0.1:{srv.server_port}"}, timeout=30, progress=lines.append,
                         poll=0.05)
    assert handler.seen == ["/health_generate"] * 3
    assert lines[-1].startswith("node-a: SGLang healthy (http://127.0.0.1:")


def test_only_the_node_that_did_not_come_up_is_named(health_server):
    """The stdlib server stands in for one node's health endpoint only; the other node's port has no listener."""
    srv, _ = health_server
    dead = free_port()
    with pytest.raises(ClusterError) as e:
        rollout.wait_healthy({"node-a": f"http://127.0.0.1:{srv.server_port}",
                              "node-b": f"http://127.0.0.1:{dead}"}, timeout=1.0, progress=lambda m: None, poll=0.1)
    assert "node-b (http://127.0.0.1:" in e.value.message and "node-a" not in e.value.message


def test_a_server_that_exited_is_reported_at_once():
    port = free_port()
    t0 = time.monotonic()
    with pytest.raises(ClusterError) as e:
        rollout.wait_healthy({"n1": f"http://127.0.0.1:{port}"}, timeout=60, progress=lambda m: None,
                             exited=lambda node: "the SGLang server exited; last lines of its log:\n    boom",
                             logs={"n1": "/x/sglang.log"})
    assert time.monotonic() - t0 < 5
    assert e.value.code == 5 and e.value.message.startswith("rollout server on n1 is not coming up") and \
        "boom" in e.value.message and "/x/sglang.log" in e.value.fix


# --- bring-up and teardown through a LocalNode, on this machine ----------------------------------------------

@pytest.fixture
def local_cfg(tmp_path):
    """rl_smoke on the local cluster with the H200 hardware layer (config only: no GPU is used) and SGLang rollouts,
    the interpreter being this one, which has no SGLang."""
    sets = ("V4_ROLLOUT_ENGINE=sglang", f"V4_ROLLOUT_PORT={free_port()}", f"V4_WORK={tmp_path / 'work'}",
            f"V4_LOCAL_DIR={tmp_path / 'local'}", f"V4_PYTHON={sys.executable}", "V4_ROLLOUT_HEALTH_TIMEOUT=20")
    return resolve(Selection(cluster="local", hw="h200", preset="rl_smoke", sets=sets))


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="this interpreter has SGLang")
def test_up_without_sglang_fails_naming_the_node(local_cfg):
    """The real start script on this machine: the server command fails (no SGLang in this interpreter), and `up`
    says so with exit 5, the node and the log's last lines, well before the health deadline."""
    node = LocalNode(name="127.0.0.1")
    t0 = time.monotonic()
    with pytest.raises(ClusterError) as e:
        rollout.rollout_up(local_cfg, [node], progress=lambda m: None)
    assert time.monotonic() - t0 < 15
    assert e.value.code == 5 and "127.0.0.1" in e.value.message
    assert "No module named 'sglang'" in e.value.message, e.value.message
    state = Path(rollout.state_dir(local_cfg, "127.0.0.1"))
    assert "No module named 'sglang'" in (state / "sglang.log").read_text()
    reps = rollout.rollout_down(local_cfg, [node], progress=lambda m: None)
    assert [r["ok"] for r in reps] == [True]


STANDIN = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], env={})
open(sys.argv[1], "w").write(str(child.pid))
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_down_stops_only_the_recorded_processes(local_cfg, tmp_path):
    """The process record and the scoped stop (node_scripts/rollout_procs.py), with real processes that are not
    SGLang: a tagged "server" whose child cleared its environment (reached through the process tree), and an
    untagged neighbour on the same host, which must survive."""
    state = Path(rollout.state_dir(local_cfg, "127.0.0.1"))
    state.mkdir(parents=True)
    token = f"v4-test-{os.getpid()}-{time.monotonic_ns()}"
    child_file = tmp_path / "child.pid"
    tagged = subprocess.Popen([sys.executable, "-c", STANDIN, str(child_file)],
                              env={**os.environ, "V4_ROLLOUT_SESSION": token})
    neighbour = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    pids = [tagged.pid, neighbour.pid]
    procs = [sys.executable, rollout.__file__.replace("rollout.py", "node_scripts/rollout_procs.py")]
    try:
        deadline = time.time() + 30
        while not child_file.exists() or not child_file.read_text():
            assert time.time() < deadline and tagged.poll() is None
            time.sleep(0.05)
        pids.append(int(child_file.read_text()))
        subprocess.run([*procs, "record", str(state), str(tagged.pid), token, "spec1"], check=True,
                       capture_output=True)
        st = json.loads(subprocess.run([*procs, "status", str(state)], capture_output=True, text=True).stdout)
        assert st["alive"] and st["pid"] == tagged.pid and st["tagged"] == [tagged.pid]
        assert subprocess.run([*procs, "running", str(state), "spec1"], capture_output=True).returncode == 0
        assert subprocess.run([*procs, "running", str(state), "spec2"], capture_output=True).returncode == 1

        r = subprocess.run([sys.executable, "-m", "launcher", "cluster", "down", "--json", "--hw", "h200",
                            *(x for s in local_cfg.selection.sets for x in ("--set", s))],
                           cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        (rep,) = json.loads(r.stdout)["rollout"]
        assert rep["ok"] and rep["recorded"] and rep["pid"] == tagged.pid and rep["remaining"] == []
        tagged.wait(timeout=10)
        assert not _alive(pids[2]), "the tagged server's child outlived `down`"
        assert neighbour.poll() is None, "an untagged process was stopped"
        assert (state / "sglang_procs.json.stopped").exists() and not (state / "sglang_procs.json").exists()
        again = rollout.rollout_down(local_cfg, [LocalNode(name="127.0.0.1")], progress=lambda m: None)
        assert again == [{"recorded": False, "stopped": [], "killed": [], "remaining": [], "node": "127.0.0.1",
                          "ok": True}]
    finally:
        for pid in pids:
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        tagged.wait(timeout=10)
        neighbour.wait(timeout=10)


def test_the_pipeline_stops_servers_when_a_run_fails(monkeypatch):
    """`_rollout_scope`: servers this run may have started are stopped when it ends by an error; not otherwise."""
    from launcher import pipeline
    calls = []
    monkeypatch.setattr(rollout, "rollout_down", lambda cfg, progress=None: calls.append(cfg) or [{"ok": True}])
    cfg = {"V4_EXECUTOR": "ray"}
    with pytest.raises(JobError):
        with pipeline._rollout_scope(cfg) as live:
            live["up"] = True
            raise JobError("train: job FAILED")
    assert calls == [cfg]
    with pytest.raises(RuntimeError):
        with pipeline._rollout_scope({"V4_EXECUTOR": "local"}) as live:
            raise RuntimeError("a bug")                   # nothing started yet: nothing to stop
    with pipeline._rollout_scope({"V4_EXECUTOR": "local"}) as live:
        live["up"] = True
    assert calls == [cfg]                               # a run that ends normally stopped them in rollout-down


def test_an_interrupted_ray_run_leaves_the_servers_to_its_job(monkeypatch):
    """Ctrl-C leaves a Ray job running (`--resume` follows it), and the servers it generates with stay with it; with
    V4_EXECUTOR=local the job's processes end with the launcher, and so do the servers."""
    from launcher import pipeline
    calls = []
    monkeypatch.setattr(rollout, "rollout_down", lambda cfg, progress=None: calls.append(cfg) or [{"ok": True}])
    for executor in ("ray", "local"):
        with pytest.raises(KeyboardInterrupt):
            with pipeline._rollout_scope({"V4_EXECUTOR": executor}) as live:
                live["up"] = True
                raise KeyboardInterrupt
    assert calls == [{"V4_EXECUTOR": "local"}]


# --- preflight facts ------------------------------------------------------------------------------------------

LISTENER = """
import socket, sys, time
s = socket.socket()
s.bind(("0.0.0.0", int(sys.argv[1])))
s.listen()
print("listening", flush=True)
time.sleep(600)
"""


def test_node_facts_know_sglang_and_our_servers_port(tmp_path):
    """node_facts.py, run for real: SGLang's version (None: not installed here), and a port held by a process of the
    recorded rollout session counts as ours, one held by any other process does not."""
    from launcher.node_scripts import source
    token = f"v4-test-{os.getpid()}-{time.monotonic_ns()}"
    state = tmp_path / "sglang30000"
    state.mkdir()
    (state / "sglang_procs.json").write_text(json.dumps({"session": token, "pid": 1, "start": 0, "spec": ""}))
    ours_port, other_port = free_port(), free_port()
    tagged = {**os.environ, "V4_ROLLOUT_SESSION": token}
    procs = [subprocess.Popen([sys.executable, "-c", LISTENER, str(port)], stdout=subprocess.PIPE, text=True, env=env)
             for port, env in ((ours_port, tagged), (other_port, dict(os.environ)))]
    try:
        for p in procs:
            assert p.stdout.readline().strip() == "listening"
        args = {"work": str(tmp_path), "local": str(tmp_path), "ray_state": str(tmp_path / "ray"),
                "rollout_state": str(state), "token_file": str(tmp_path / "none"), "ports": [ours_port, other_port],
                "packages": ["ray"], "paths": []}
        r = subprocess.run([sys.executable, "-", json.dumps(args)], input=source("node_facts"), capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        facts = json.loads(r.stdout)
        if importlib.util.find_spec("sglang") is None:
            assert facts["sglang"] is None
        else:
            assert facts["sglang"]                                         # its version string
        assert facts["ports"][str(ours_port)]["ours"] is True
        assert facts["ports"][str(other_port)]["ours"] is False
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=10)


# --- SGLang's own parser, where SGLang is installed ---------------------------------------------------------------

@pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="sglang is not installed (GPU nodes only)")
def test_sglang_parses_the_rendered_command(layout_cfg):
    """The rendered argv through SGLang's own argparse (`ServerArgs.add_cli_args`, what `python -m
    sglang.launch_server` builds): every flag exists, every value lands where it is meant to."""
    import argparse

    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    argv = rollout.server_argv(layout_cfg, "10.0.8.10")
    assert argv[1:3] == ["-m", "sglang.launch_server"]
    ns = parser.parse_args(argv[3:])
    assert (ns.model_path, ns.host, ns.port) == (BF16, "10.0.8.10", 30000)
    assert (ns.tp_size, ns.ep_size, ns.dp_size, ns.mem_fraction_static) == (4, 4, 2, 0.6)
    assert ns.trust_remote_code and ns.skip_tokenizer_init and ns.enable_return_routed_experts
    assert ns.enable_memory_saver and ns.enable_deterministic_inference
    assert ns.dsv4_attn_backend == "flashmla" and ns.enable_decoder_swa_bounded_replay is False
    assert ns.max_running_requests == 64 and ns.json_model_override_args == '{"a": 1}'
    # the schema's choices are SGLang's
    from launcher.config.schema import SCHEMA
    backend = next(a for a in parser._actions if a.dest == "dsv4_attn_backend")
    assert set(SCHEMA["V4_ROLLOUT_DSV4_ATTN_BACKEND"].choices) == set(backend.choices)


def test_sglang_servers_take_weights_by_broadcast_or_disk():
    (msg,) = refused(PRESET_RL_SYNC="inproc")
    assert msg.startswith("PRESET_RL_SYNC=inproc (cli --set PRESET_RL_SYNC) copies weights inside the trainer's")
    assert "V4_ROLLOUT_ENGINE=sglang" in msg and "use broadcast" in msg
    h20(PRESET_RL_SYNC="broadcast")
    h20()                                                            # auto: broadcast for SGLang


def test_rl_dryrun_plans_sglang_on_every_training_node(capsys):
    """The RL stage B0 preset on the shipped 8-node cluster: validates, and its plan starts a colocated SGLang
    server on every node before the train step and stops them after it."""
    with pytest.raises(SystemExit) as e:
        main(["run", "--preset", "rl_dryrun", "--cluster", "h20_8node", "--hw", "h200", "--dry-run", "--json"])
    out, err = capsys.readouterr()
    assert e.value.code == 0, err
    plan = json.loads(out)
    names = [s["name"] for s in plan["steps"]]
    assert names[-5:] == ["convert", "rollout-up", "train", "rollout-down", "gates"]
    up = next(s for s in plan["steps"] if s["name"] == "rollout-up")
    assert len(up["nodes"]) == 8
    train = next(s for s in plan["steps"] if s["name"] == "train")
    assert train["available"] and "jobs.train_rl" in json.dumps(train)
