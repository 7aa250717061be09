"""Gather each node's facts in parallel: a few SSH round trips per node (plus the head's token write).

In container mode the facts come from inside V4_CONTAINER when it is the one `v4 cluster up` would use (ours, running
V4_IMAGE); otherwise (a fresh cluster: preflight runs before `up` creates it) from the host, with the host's python3.
The host sees the same GPUs, network (--network host), V4_WORK and V4_LOCAL_DIR (mounted at the same paths); only the
image's software cannot be judged there.
"""
from __future__ import annotations

import json
import secrets
import shlex
import time

from launcher.cluster import container_state, ray_state_dir, site_env
from launcher import rollout
from launcher.node_scripts import source
from launcher.nodes import Node, fan_out, node_local_dir, python_on_nodes
from launcher.preflight import probes
from launcher.preflight.registry import Context, RequiredInput

# Distributions whose versions must agree across nodes (Python itself is compared too).
PACKAGES = ("torch", "megatron-core", "tilelang", "ray")


def head_ports(cfg) -> list[int]:
    from launcher.config.schema import PORT_KEYS
    return [int(cfg.get(k, 0) or 0) for k in PORT_KEYS if int(cfg.get(k, 0) or 0)]


def node_ports(cfg, node: str, head: str) -> list[int]:
    """The fixed ports `node` must have free: the head's, and V4_ROLLOUT_PORT on a node that runs an SGLang server."""
    ports = head_ports(cfg) if node == head else []
    if rollout.enabled(cfg) and node in rollout.rollout_nodes(cfg) and cfg["V4_ROLLOUT_PORT"] not in ports:
        ports.append(int(cfg["V4_ROLLOUT_PORT"]))
    return ports


def nccl_args(cfg) -> dict | None:
    """What `node_scripts/nccl_bw.py` measures on each node, or None where it does not apply (CPU, one GPU)."""
    gpus = int(cfg.get("V4_NUM_GPUS_PER_NODE", 1) or 1)
    if cfg.get("HW_DEVICE") != "cuda" or gpus < 2:
        return None
    return {"gpus": gpus, "bytes": 256 << 20, "iters": 10, "timeout": 90, "backend": "nccl"}


def wandb_args(cfg) -> dict | None:
    """What `node_scripts/wandb_probe.py` asks on each node, or None where a run needs nothing of W&B there
    (V4_WANDB_PROJECT empty, V4_WANDB_MODE=offline, or no `train` step: only training logs to W&B)."""
    if not cfg.get("V4_WANDB_PROJECT") or cfg.get("V4_WANDB_MODE") == "offline" \
            or "train" not in (cfg.get("PRESET_STEPS") or []):
        return None
    return {"base_url": str(cfg.get("V4_WANDB_BASE_URL") or ""), "timeout": float(cfg.get("V4_WANDB_TIMEOUT") or 30)}


def gather(cfg, nodes: list[Node], inputs: list[RequiredInput], measure_nccl: bool = True,
           probe_wandb: bool = True, measure_gpu: bool = True, measure_pairs: bool = True) -> Context:
    """Facts of every node; `measure_nccl`: also time an all-reduce across each node's GPUs (~10-20 s);
    `probe_wandb`: also ask W&B's server from each node (at most V4_WANDB_TIMEOUT), where the run logs to it."""
    ctx = Context(cfg=cfg, order=[n.name for n in nodes], inputs=inputs)
    work = str(cfg["V4_WORK"])
    python = python_on_nodes(cfg)
    token_dir = f"{work}/.v4-preflight"
    token_file = f"{token_dir}/{secrets.token_hex(8)}"
    ctx.token = secrets.token_hex(16)

    # The head writes a token into V4_WORK; every node must then read it back (really shared?). On the host: V4_WORK
    # is mounted at the same path in a container, which may not exist yet.
    head = nodes[0].host()
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
    wb = wandb_args(cfg) if probe_wandb else None
    wandb_cmd = (f"{shlex.quote(python)} - {shlex.quote(json.dumps(wb))} <<'V4_WANDB'\n"
                 f"{source('wandb_probe')}V4_WANDB\n" if wb else "")
    # measure_gpu: each GPU's GEMM/copy figures and error counters (~10 s a node); measure_pairs: an all-reduce
    # between each pair of neighbouring nodes (probes.py: two or three rounds of ~20 s)
    gpu_args = probes.gpu_health_args(cfg) if measure_gpu else None
    # the run's own NCCL setting: NVLink SHARP stays off where the hw layer says so
    nccl_env = {"NCCL_NVLS_ENABLE": str(int(bool(cfg.get("HW_NCCL_NVLS_ENABLE"))))}

    image = str(cfg.get("V4_IMAGE", "") or "")

    def facts(node: Node) -> dict:
        args = {"work": work, "local": node_local_dir(cfg, node.name), "ray_state": ray_state_dir(cfg, node.name),
                "rollout_state": rollout.state_dir(cfg, node.name), "token_file": token_file,
                "ports": node_ports(cfg, node.name, ctx.head),
                "packages": list(PACKAGES), "paths": paths}
        t0 = time.time()
        try:
            # reachability first, on the host: separates ssh from container and python trouble
            r = node.host().run("true", timeout=30)
        except Exception as e:   # noqa: BLE001
            return {"_stage": "ssh", "_error": f"{type(e).__name__}: {e}"}
        ssh_s = time.time() - t0
        if not r.ok:           # a login that runs nothing: nologin shell, a profile that exits, no `timeout` there
            return {"_stage": "ssh", "_error": f"`true` over SSH exited with rc {r.rc}: {r.tail(4) or '(no output)'}",
                    "_ssh_s": ssh_s}
        target, py, where = node, python, "node"
        if node.container:
            box = ctx.containers[node.name] = container_state(cfg, node)
            where = "container"
            if not (box["state"] == "running" and box["ours"] and box["image"] == image):
                target, py, where = node.host(), "python3", "host"
        cmd = f"{shlex.quote(py)} - {shlex.quote(json.dumps(args))} <<'V4_FACTS'\n{script}V4_FACTS\n"
        t1 = time.time()
        r = target.run(cmd, timeout=120)
        t2 = time.time()
        if not r.ok:
            why = "not found" if r.rc == 127 else f"rc {r.rc}"
            place = "on the host" if where == "host" else "in the container" if where == "container" else "on the node"
            return {"_stage": "python", "_error": f"{py} {place} ({why}): {r.tail(4)}", "_ssh_s": ssh_s,
                    "_where": where}
        out = json.loads(r.stdout.strip().splitlines()[-1])
        out["_where"] = where
        # The node read its clock at script start; our send/receive times bound when that was.
        window = max(0.0, t2 - t1 - out.get("elapsed", 0))
        out["_clock"] = (out["time"] - (t1 + t2 - out.get("elapsed", 0)) / 2, window / 2)
        out["_ssh_s"] = ssh_s
        if nccl_cmd and where != "host":           # needs the image's torch
            r = node.run(nccl_cmd, env=nccl_env, timeout=nccl["timeout"] + 30)
            try:
                out["nccl"] = json.loads(r.stdout.strip().splitlines()[-1])
            except (ValueError, IndexError):
                out["nccl"] = {"gpus": nccl["gpus"], "error": f"rc {r.rc}: {r.tail(4)}"}
        if gpu_args and where != "host":           # needs the image's torch, as the all-reduce does
            try:
                out["gpu_health"] = probes.run_gpu_health(node, python, gpu_args)
            except Exception as e:   # noqa: BLE001 - the gpu checks' FAIL, not a lost node
                out["gpu_health"] = {"error": f"the probe did not run: {type(e).__name__}: {e}"}
        if wandb_cmd and where != "host":          # the jobs' Python and environment (the proxy too), not the host's
            try:
                r = node.run(wandb_cmd, env=site_env(cfg), timeout=wb["timeout"] + 30)
                out["wandb"] = json.loads(r.stdout.strip().splitlines()[-1])
            except Exception as e:   # noqa: BLE001 - a failed probe is the wandb check's FAIL, not a lost node
                out["wandb"] = {"error": f"the probe did not run: {type(e).__name__}: {e}"}
        return out

    for name, f in zip(ctx.order, fan_out(nodes, facts,
                                           on_error=lambda n, e: {"_stage": "python", "_error": f"{type(e).__name__}: {e}"})):
        if "_where" in f:
            ctx.where[name] = f["_where"]
        if "_stage" in f:
            ctx.errors[name] = (f["_stage"], f["_error"])
            if "_ssh_s" in f:
                ctx.ssh_seconds[name] = f["_ssh_s"]
        else:
            ctx.facts[name] = f
            ctx.clock[name] = f["_clock"]
            ctx.ssh_seconds[name] = f["_ssh_s"]
    if measure_pairs:                              # after every node's own probes: the GPUs are free again
        ctx.pairs = probes.nccl_pairs(cfg, nodes, ctx, python)
    try:
        head.run(f"rm -f {shlex.quote(token_file)}; rmdir {shlex.quote(token_dir)} 2>/dev/null || true", timeout=30)
    except Exception:   # noqa: BLE001 - best effort cleanup of a tiny file
        pass
    return ctx
