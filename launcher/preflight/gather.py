"""Gather each node's facts in parallel: one SSH round trip per node (plus the head's token write)."""
from __future__ import annotations

import json
import secrets
import shlex
import time

from launcher.cluster import ray_state_dir
from launcher.node_scripts import source
from launcher.nodes import Node, fan_out, node_local_dir, python_on_nodes
from launcher.preflight.registry import Context, RequiredInput

# Distributions whose versions must agree across nodes (Python itself is compared too).
PACKAGES = ("torch", "megatron-core", "tilelang", "ray")


def head_ports(cfg) -> list[int]:
    keys = ("V4_RAY_PORT", "V4_DASHBOARD_PORT", "V4_DIST_PORT", "V4_PROMETHEUS_PORT", "V4_GRAFANA_PORT")
    return [int(cfg.get(k, 0) or 0) for k in keys if int(cfg.get(k, 0) or 0)]


def nccl_args(cfg) -> dict | None:
    """What `node_scripts/nccl_bw.py` measures on each node, or None where it does not apply (CPU, one GPU)."""
    gpus = int(cfg.get("V4_NUM_GPUS_PER_NODE", 1) or 1)
    if cfg.get("HW_DEVICE") != "cuda" or gpus < 2:
        return None
    return {"gpus": gpus, "bytes": 256 << 20, "iters": 10, "timeout": 90, "backend": "nccl"}


def gather(cfg, nodes: list[Node], inputs: list[RequiredInput], measure_nccl: bool = True) -> Context:
    """Facts of every node; `measure_nccl`: also time an all-reduce across each node's GPUs (~10-20 s)."""
    ctx = Context(cfg=cfg, order=[n.name for n in nodes], inputs=inputs)
    work = str(cfg["V4_WORK"])
    python = python_on_nodes(cfg)
    token_dir = f"{work}/.v4-preflight"
    token_file = f"{token_dir}/{secrets.token_hex(8)}"
    ctx.token = secrets.token_hex(16)

    # The head writes a token into V4_WORK; every node must then read it back (really shared?).
    head = nodes[0]
    try:
        r = head.run(f"mkdir -p {shlex.quote(token_dir)} && printf %s {ctx.token} > {shlex.quote(token_file)}",
                     timeout=30)
        if not r.ok:
            ctx.token_error = f"the head could not write {token_file}: {r.tail(3)}"
    except Exception as e:   # noqa: BLE001 - the ssh check reports the head itself
        ctx.token_error = f"the head could not write {token_file}: {e}"

    paths = sorted({i.path for i in inputs} | {f"{i.path}/{i.sentinel}" for i in inputs if i.sentinel})
    script = source("node_facts")
    nccl = nccl_args(cfg) if measure_nccl else None
    nccl_cmd = (f"{shlex.quote(python)} - {shlex.quote(json.dumps(nccl))} <<'V4_NCCL'\n{source('nccl_bw')}V4_NCCL\n"
                if nccl else "")
    # the run's own NCCL setting: NVLink SHARP stays off where the hw layer says so
    nccl_env = {"NCCL_NVLS_ENABLE": str(int(bool(cfg.get("HW_NCCL_NVLS_ENABLE"))))}

    def facts(node: Node) -> dict:
        args = {"work": work, "local": node_local_dir(cfg, node.name), "ray_state": ray_state_dir(cfg, node.name),
                "token_file": token_file,
                "ports": head_ports(cfg) if node.name == ctx.head else [],
                "packages": list(PACKAGES), "paths": paths}
        cmd = f"{shlex.quote(python)} - {shlex.quote(json.dumps(args))} <<'V4_FACTS'\n{script}V4_FACTS\n"
        t0 = time.time()
        try:
            node.run("true", timeout=30)           # reachability first: separates ssh from python trouble
        except Exception as e:   # noqa: BLE001
            return {"_stage": "ssh", "_error": f"{type(e).__name__}: {e}"}
        t1 = time.time()
        r = node.run(cmd, timeout=120)
        t2 = time.time()
        if not r.ok:
            why = "not found" if r.rc == 127 else f"rc {r.rc}"
            return {"_stage": "python", "_error": f"{python} on the node ({why}): {r.tail(4)}", "_ssh_s": t1 - t0}
        out = json.loads(r.stdout.strip().splitlines()[-1])
        # The node read its clock at script start; our send/receive times bound when that was.
        window = max(0.0, t2 - t1 - out.get("elapsed", 0))
        out["_clock"] = (out["time"] - (t1 + t2 - out.get("elapsed", 0)) / 2, window / 2)
        out["_ssh_s"] = t1 - t0
        if nccl_cmd:
            r = node.run(nccl_cmd, env=nccl_env, timeout=nccl["timeout"] + 30)
            try:
                out["nccl"] = json.loads(r.stdout.strip().splitlines()[-1])
            except (ValueError, IndexError):
                out["nccl"] = {"gpus": nccl["gpus"], "error": f"rc {r.rc}: {r.tail(4)}"}
        return out

    for name, f in zip(ctx.order, fan_out(nodes, facts,
                                           on_error=lambda n, e: {"_stage": "python", "_error": f"{type(e).__name__}: {e}"})):
        if "_stage" in f:
            ctx.errors[name] = (f["_stage"], f["_error"])
            if "_ssh_s" in f:
                ctx.ssh_seconds[name] = f["_ssh_s"]
        else:
            ctx.facts[name] = f
            ctx.clock[name] = f["_clock"]
            ctx.ssh_seconds[name] = f["_ssh_s"]
    try:
        head.run(f"rm -f {shlex.quote(token_file)}; rmdir {shlex.quote(token_dir)} 2>/dev/null || true", timeout=30)
    except Exception:   # noqa: BLE001 - best effort cleanup of a tiny file
        pass
    return ctx
