"""SGLang rollout servers for RL runs: render each node's server launch, bring them up, wait on health, tear down.

With PRESET_MODE=rl and V4_ROLLOUT_ENGINE=sglang the trainer generates through SGLang servers the launcher starts,
one per rollout node (V4_ROLLOUT_NODES, or the trainer's own nodes when that is empty), instead of the embedded
engine. The plan shows every server command (`plan.rollout_step`), the pipeline starts them before the RL train step and
stops them after it, and `v4 cluster down` stops them too. Like Ray's daemons, a server is ours only if it carries
the V4_ROLLOUT_SESSION token its start script gave it, with its PID recorded per node (node_scripts/rollout_procs.py):
teardown never touches another SGLang on the host.

The server's flags, checked against SGLang 0.5.23's own argparse (`ServerArgs.add_cli_args` from the PyPI wheel,
sglang/srt/arg_groups/fields/*.py; parsed for real in tests/launcher/test_rollout.py where sglang is importable):
  --model-path (alias --model), --host, --port           fields/model.py, fields/serving.py
  --tp-size, --ep-size, --dp-size                         fields/parallel.py (--dp-size counts whole replicas)
  --mem-fraction-static (float)                           fields/schedule.py
  --trust-remote-code, --skip-tokenizer-init              store_true, fields/model.py, fields/serving.py
  --enable-return-routed-experts, --enable-memory-saver   store_true, fields/exec_.py
  --enable-deterministic-inference                        store_true, fields/exec_.py
  --dsv4-attn-backend auto|flashmla|flashmla_mega|trtllm  fields/exec_.py (the CLI has no other choice)
  --no-enable-decoder-swa-bounded-replay                  BooleanOptionalAction, fields/exec_.py: its help says to
                                                          use it "for RL rollouts whose logprobs must match the trainer"
and the environment variable SGLANG_DSV4_FP4_EXPERTS (srt/environ.py, EnvBool, default True; "Set False when using
FP4-to-FP8 converted DeepSeek V4 checkpoint"): 0, because the trainer pushes FP8 expert blocks, never MXFP4.
`python -m sglang.launch_server` still works in 0.5.23 (it warns that `sglang serve` is the recommended entrypoint;
same parser, `prepare_server_args`).

Never imports sglang (nor torch): it renders text and speaks HTTP with the standard library.
"""
from __future__ import annotations

import hashlib
import json
import shlex
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

from launcher.cluster import container_state, render, site_env
from launcher.config.checks import server_url, sglang_engine
from launcher.errors import ClusterError
from launcher.node_scripts import source
from launcher.nodes import Node, Result, fan_out, node_local_dir, opened, python_on_nodes

Progress = Callable[[str], None]
HEALTH_PATH = "/health_generate"      # generates one token (input_ids=[0]): the model is loaded and serves
HEARTBEAT_S = 15.0
ALIVE_CHECK_S = 10.0                  # while waiting for health: how often to ask the nodes whether the server exited
REQUEST_TIMEOUT_S = 20.0              # one health request; the first generation after loading can be slow


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# --- what runs where --------------------------------------------------------------------------------

def sglang_selected(cfg) -> bool:
    """Whether the configuration asks for SGLang servers (whatever the mode: `v4 cluster down` stops them)."""
    return sglang_engine(cfg)


def enabled(cfg) -> bool:
    """Whether a run of this configuration starts SGLang rollout servers: an RL run with the SGLang engine."""
    return sglang_selected(cfg) and cfg.get("PRESET_MODE") == "rl"


def rollout_nodes(cfg) -> list[str]:
    """Addresses of the nodes that run a server (the config's derived ROLLOUT_NODES), head first when colocated."""
    return list(cfg.get("ROLLOUT_NODES") or [])


def state_dir(cfg, ip: str) -> str:
    """Where a node keeps its server's log, process record and the record script. Keyed by the port, as Ray's is by
    the GCS port: two launchers' servers on one host (two ports) never see each other's."""
    return f"{node_local_dir(cfg, ip)}/sglang{cfg['V4_ROLLOUT_PORT']}"


def model_path(cfg) -> str:
    """The checkpoint the servers load: the BF16 HF checkpoint the pipeline's dequantize step writes (the RL trainer
    starts from the same weights, converted; it then pushes its own with each weight sync)."""
    return str(cfg["CKPT_BF16_DIR"])


def server_argv(cfg, ip: str) -> list[str]:
    """The command line of the server on node `ip`, one word per element."""
    argv = [python_on_nodes(cfg), "-m", "sglang.launch_server",
            "--model-path", model_path(cfg),
            "--host", ip, "--port", str(cfg["V4_ROLLOUT_PORT"]),
            "--tp-size", str(cfg["V4_ROLLOUT_TP"]), "--ep-size", str(cfg["V4_ROLLOUT_EP"]),
            "--dp-size", str(cfg["V4_ROLLOUT_DP"]),
            "--mem-fraction-static", f"{float(cfg['V4_ROLLOUT_MEM_FRACTION']):g}",
            "--trust-remote-code",
            # the trainer sends token ids and reads token ids: no tokenizer in the server
            "--skip-tokenizer-init",
            # routing replay: the experts each token was routed to come back with every generation
            "--enable-return-routed-experts",
            # release/resume_memory_occupation, so a colocated trainer gets the GPU memory back between rollouts
            "--enable-memory-saver",
            "--dsv4-attn-backend", str(cfg["V4_ROLLOUT_DSV4_ATTN_BACKEND"]),
            # full prefill: bounded SWA replay is "not numerically equivalent", and rollout logprobs must match the
            # trainer's
            "--no-enable-decoder-swa-bounded-replay",
            "--enable-deterministic-inference"]
    # validated by the config checks: shell words, none of the flags above
    return argv + shlex.split(str(cfg.get("V4_ROLLOUT_EXTRA_ARGS", "") or ""))


def server_env(cfg) -> dict[str, str]:
    """Environment of every server: FP8 experts (the trainer pushes FP8 blocks), the site's proxy and time zone,
    the run's NCCL settings."""
    env = {"SGLANG_DSV4_FP4_EXPERTS": "0", "HF_HOME": str(cfg["V4_HF_HOME"])}
    env.update(site_env(cfg))
    env["NCCL_NVLS_ENABLE"] = str(int(bool(cfg.get("HW_NCCL_NVLS_ENABLE"))))
    if cfg.get("V4_NCCL_IB_DISABLE"):
        env["NCCL_IB_DISABLE"] = "1"
    ifname = str(cfg.get("V4_SOCKET_IFNAME", "auto") or "auto")
    if ifname != "auto":            # auto: the start script picks the default-route interface, as Ray's does
        env["NCCL_SOCKET_IFNAME"] = env["GLOO_SOCKET_IFNAME"] = ifname
    return env


def shell_command(argv: list[str]) -> str:
    """`argv` as one shell command, each word quoted, one flag (with its value) per line so a plan reads well."""
    words = [shlex.quote(w) for w in argv]
    lines, i = [" ".join(words[:3])], 3
    while i < len(words):
        takes_value = i + 1 < len(words) and not argv[i + 1].startswith("--")
        lines.append(" ".join(words[i:i + 2]) if takes_value else words[i])
        i += 2 if takes_value else 1
    return " \\\n    ".join(lines)


def spec_digest(argv: list[str], env: dict[str, str]) -> str:
    """What a running server was started with, in 16 hex digits: `up` keeps a server only when this matches."""
    return hashlib.sha256(json.dumps([argv, sorted(env.items())]).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class ServerCommands:
    ip: str
    url: str                # base URL the trainer and the health wait use
    state_dir: str
    argv: list[str]
    env: dict[str, str]
    start: str              # starts the server (or keeps ours), records its PID
    stop: str               # stops exactly what `start` recorded

    def display(self, script: str) -> list[str]:
        """A script as a plan shows it: the embedded node script abbreviated."""
        return [script.replace(source("rollout_procs"), "<launcher/node_scripts/rollout_procs.py>\n")]


def _script_context(cfg, ip: str) -> dict:
    return dict(python=python_on_nodes(cfg), procs_py=source("rollout_procs").rstrip("\n"), ip=ip,
                cluster_name=cfg["V4_CLUSTER_NAME"], port=cfg["V4_ROLLOUT_PORT"], state_dir=state_dir(cfg, ip),
                socket_ifname=str(cfg.get("V4_SOCKET_IFNAME", "auto") or "auto"))


def stop_script(cfg, ip: str) -> str:
    """Stops the server v4 recorded on `ip`. Needs no workload (`v4 cluster down` has no preset, hence no checkpoint
    to render a start command from)."""
    return render("sglang_stop.sh.j2", **_script_context(cfg, ip))


def server_commands(cfg) -> list[ServerCommands]:
    """Every rollout node's start and stop scripts, in ROLLOUT_NODES order (needs a preset: the checkpoint)."""
    env, out = server_env(cfg), []
    for ip in rollout_nodes(cfg):
        argv, ctx = server_argv(cfg, ip), _script_context(cfg, ip)
        out.append(ServerCommands(
            ip=ip, url=server_url(ip, cfg["V4_ROLLOUT_PORT"]), state_dir=ctx["state_dir"], argv=argv, env=env,
            start=render("sglang_server.sh.j2", **ctx, env=env, spec=spec_digest(argv, env),
                         command=shell_command(argv)),
            stop=stop_script(cfg, ip)))
    return out


# --- bring-up ------------------------------------------------------------------------------------

def _pick(cfg, nodes: list[Node]) -> list[Node]:
    """The rollout nodes among `nodes` (by name), in ROLLOUT_NODES order."""
    by_name = {n.name: n for n in nodes}
    missing = [ip for ip in rollout_nodes(cfg) if ip not in by_name]
    if missing:
        raise ClusterError(f"rollout node(s) {', '.join(missing)} are not among the nodes given ({', '.join(by_name)})",
                           fix="V4_ROLLOUT_NODES must name nodes of the cluster (V4_MASTER_IP + V4_WORKER_IPS)")
    return [by_name[ip] for ip in rollout_nodes(cfg)]


def rollout_up(cfg, nodes: list[Node] | None = None, progress: Progress = _stderr,
               timeout: float | None = None) -> list[dict]:
    """Start the SGLang server on every rollout node (keeping one of ours that runs with the same command line), then
    wait until each answers GET /health_generate with 200, at most V4_ROLLOUT_HEALTH_TIMEOUT seconds. Raises
    ClusterError (exit 5) naming the node that failed. A failed bring-up may leave servers running: the caller stops
    them with `rollout_down` (the pipeline does). `nodes`: the cluster's nodes (default: from the config)."""
    cmds = {c.ip: c for c in server_commands(cfg)}
    if not cmds:
        return []
    timeout = float(cfg["V4_ROLLOUT_HEALTH_TIMEOUT"]) if timeout is None else timeout
    t0 = time.monotonic()
    with opened(cfg, nodes) as all_nodes:
        targets = _pick(cfg, all_nodes)
        progress(f"rollout: starting SGLang on {', '.join(cmds)} (port {cfg['V4_ROLLOUT_PORT']}, "
                 f"TP {cfg['V4_ROLLOUT_TP']} EP {cfg['V4_ROLLOUT_EP']} DP {cfg['V4_ROLLOUT_DP']})")
        results = fan_out(targets, lambda n: n.run(cmds[n.name].start, timeout=120))
        bad = [r for r in results if not r.ok]
        if bad:
            raise ClusterError("SGLang server start failed on " + ", ".join(r.node for r in bad) + ":\n" +
                               "\n".join(f"  {r.node}: rc {r.rc}: {r.tail(12)}" for r in bad),
                               fix="; ".join(f"read {state_dir(cfg, r.node)}/sglang.log on {r.node}" for r in bad)
                                   + "; preflight `sglang` checks that the nodes' python has SGLang")
        reports = [{"node": r.node, "url": cmds[r.node].url, "pid": _pid(r), "state": _state(r),
                    "log": f"{cmds[r.node].state_dir}/sglang.log"} for r in results]
        for rep in reports:
            how = "kept (ours, already running with this command line)" if rep["state"] == "kept" else \
                f"started, pid {rep['pid']}"
            progress(f"{rep['node']}: SGLang {how}; log {rep['log']}")
        by_name = {n.name: n for n in targets}
        wait_healthy({ip: c.url for ip, c in cmds.items()}, timeout, progress=progress,
                     exited=lambda ip: _exited(cfg, by_name[ip]), logs={r["node"]: r["log"] for r in reports})
    progress(f"rollout: {len(cmds)} SGLang server(s) healthy in {time.monotonic() - t0:.1f} s: "
             + " ".join(c.url for c in cmds.values()))
    return reports


def _state(r: Result) -> str:
    return "kept" if r.stdout.strip().splitlines()[-1:] == ["running"] else "started"


def _pid(r: Result) -> int | None:
    last = (r.stdout.strip().splitlines() or [""])[-1].split()
    return int(last[1]) if len(last) == 2 and last[0] == "started" and last[1].isdigit() else None


def _exited(cfg, node: Node) -> str:
    """Why the server recorded on `node` is not running ('' while it runs): the last lines of its log."""
    state = shlex.quote(state_dir(cfg, node.name))
    try:
        r = node.run(f"{shlex.quote(python_on_nodes(cfg))} {state}/rollout_procs.py status {state}", timeout=60)
        st = json.loads(r.stdout.strip().splitlines()[-1])
        if st.get("alive"):
            return ""
        tail = node.run(f"tail -n 20 {state}/sglang.log", timeout=60)
    except Exception:   # noqa: BLE001 - cannot tell (SSH trouble, a slow node): the health deadline decides
        return ""
    return "the SGLang server exited; last lines of its log:\n    " + "\n    ".join(tail.stdout.splitlines()[-20:])


def probe(url: str, timeout: float) -> tuple[bool, str]:
    """GET url: (answered 200, what happened). Never through a proxy: the servers are the cluster's own addresses."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=timeout) as resp:
            return resp.status == 200, f"HTTP {resp.status}"
    except urllib.error.HTTPError as e:          # 503 while it starts or shuts down
        return False, f"HTTP {e.code}"
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        return False, f"{type(reason).__name__}: {reason}"


def wait_healthy(urls: dict[str, str], timeout: float, progress: Progress = _stderr,
                 exited: Callable[[str], str] | None = None, logs: dict[str, str] | None = None,
                 poll: float = 1.0, heartbeat: float = HEARTBEAT_S, alive_every: float = ALIVE_CHECK_S) -> None:
    """Poll GET <url>/health_generate of every node until each answered 200 once; ClusterError (exit 5) naming the
    nodes still not healthy when `timeout` seconds have passed, or at once naming a node whose server `exited(node)`
    says has exited. `urls`: node -> base URL."""
    t0 = time.monotonic()
    # whether a server exited is asked at the first unanswered round (an import error shows at once), then less often
    deadline, beat, next_alive = t0 + timeout, t0 + heartbeat, t0
    pending, last = dict(urls), {ip: "not asked yet" for ip in urls}
    logs = logs or {}
    with ThreadPoolExecutor(max_workers=min(32, max(1, len(urls)))) as pool:
        while pending:
            now = time.monotonic()
            wait = max(0.5, min(REQUEST_TIMEOUT_S, deadline - now))
            answers = dict(zip(pending, pool.map(lambda u: probe(u + HEALTH_PATH, wait), pending.values())))
            for ip, (ok, what) in answers.items():
                last[ip] = what
                if ok:
                    progress(f"{ip}: SGLang healthy ({urls[ip]}{HEALTH_PATH}) after {time.monotonic() - t0:.0f} s")
                    del pending[ip]
            if not pending:
                return
            now = time.monotonic()
            if exited is not None and now >= next_alive:
                for ip in pending:
                    why = exited(ip)
                    if why:
                        raise ClusterError(f"rollout server on {ip} is not coming up: {why}",
                                           fix=f"read {logs.get(ip, 'its sglang.log')} on {ip}; fix the cause, then "
                                               "run again (`v4 preflight` checks SGLang's install: check `sglang`)")
                next_alive = now + alive_every
            if now >= deadline:
                detail = "; ".join(f"{ip} ({urls[ip]}{HEALTH_PATH}: {last[ip]})" for ip in pending)
                raise ClusterError(
                    f"rollout server(s) not healthy after {timeout:g} s (V4_ROLLOUT_HEALTH_TIMEOUT): {detail}",
                    fix="; ".join(f"read {logs[ip]} on {ip}" for ip in pending if ip in logs) +
                        ("; " if logs else "") + "a large model loads for minutes: raise V4_ROLLOUT_HEALTH_TIMEOUT "
                        "if the log shows it still loading")
            if now >= beat:
                progress(f"rollout: waiting for {', '.join(pending)} ({now - t0:.0f} s so far, "
                         f"{max(0.0, deadline - now):.0f} s left of V4_ROLLOUT_HEALTH_TIMEOUT={timeout:g})")
                beat = now + heartbeat
            time.sleep(min(poll, max(0.0, deadline - time.monotonic())))


# --- teardown ------------------------------------------------------------------------------------------

def rollout_down(cfg, nodes: list[Node] | None = None, progress: Progress = _stderr) -> list[dict]:
    """Stop the SGLang servers v4 recorded on the rollout nodes (and only those), in parallel; one report per node
    with `ok`. Never raises for one node: its report says what went wrong."""
    if not rollout_nodes(cfg):
        return []
    with opened(cfg, nodes) as all_nodes:
        targets = _pick(cfg, all_nodes)
        reports = fan_out(targets, lambda n: _stop_one(cfg, n),
                          on_error=lambda n, e: {"node": n.name, "ok": False, "error": f"{type(e).__name__}: {e}"})
    none = []
    for rep in reports:
        if not rep["ok"]:
            why = rep.get("error") or f"still running: {rep.get('remaining')}"
            progress(f"{rep['node']}: stopping SGLang failed: {why}")
        elif rep.get("recorded") and not rep.get("stopped"):
            progress(f"{rep['node']}: the SGLang server v4 started (pid {rep.get('pid')}) had exited already")
        elif rep.get("recorded"):
            progress(f"{rep['node']}: stopped the SGLang server v4 started (pid {rep.get('pid')}, "
                     f"{len(rep['stopped'])} process(es))"
                     + (f"; SIGKILL for {len(rep['killed'])} of them" if rep.get("killed") else ""))
        else:
            none.append(rep["node"] + rep.get("note", ""))
    if none:
        progress(f"rollout: no SGLang server started by v4 on {', '.join(none)}")
    return reports


def _stop_one(cfg, node: Node) -> dict:
    if node.container:
        # a container that does not run (or is not ours) holds no server of ours, and `docker exec` into it would fail
        box = container_state(cfg, node)
        if box["state"] == "error":
            return {"node": node.name, "ok": False, "error": box["error"]}
        if not (box["state"] == "running" and box["ours"]):
            whose = "" if box["ours"] or box["state"] == "absent" else ", not v4's"
            return {"node": node.name, "ok": True, "recorded": False,
                    "note": f" (container {box['name']} is {box['state']}{whose})"}
    r = node.run(stop_script(cfg, node.name), timeout=120)
    try:
        rep = json.loads(r.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"node": node.name, "ok": False, "error": f"rc {r.rc}: {r.tail(8)}"}
    return {**rep, "node": node.name, "ok": r.ok and not rep.get("remaining")}


# --- the plan -------------------------------------------------------------------------------------------

def plan_nodes(cfg, which: str) -> dict[str, list[str]]:
    """node label -> the commands a plan shows for `which` ("start" or "stop")."""
    return {f"{c.ip} (rollout server)": c.display(c.start if which == "start" else c.stop)
            for c in server_commands(cfg)}
