"""What preflight measures on the GPUs beyond listing them (checks `gpu_perf`, `gpu_errors`, `nccl_pairs`).

- Per node, `node_scripts/gpu_health.py`: every GPU's bf16 GEMM TFLOP/s and HBM copy bandwidth, measured at once,
  and its ECC counters and the kernel log's Xid events.
- Per pair of neighbouring nodes, `node_scripts/nccl_bw.py` started on both at once: an all-reduce across the GPUs
  of the two nodes, whose bus bandwidth is the fabric's between them. The pairs are the ring (0,1), (1,2), ...,
  (N-1,0), not all N(N-1)/2: every node sits in two pairs, so a node whose link is bad fails in both and its
  neighbours in one each -- enough to name it -- and the ring runs in two rounds (three for an odd N) of pairs
  that share no node, where all pairs would take N-1 rounds (7 on 8 nodes, ~20 s each).
"""
from __future__ import annotations

import json
import shlex
import threading

from launcher.node_scripts import source

# Whatever the hw layer: 256 MiB bf16 a pair, as the per-node `nccl` probe (nccl-tests' busbw settles there).
PAIR_BYTES = 256 << 20


def gpu_health_args(cfg, probes: bool = True) -> dict | None:
    """What gpu_health.py runs with on each node, or None where it does not apply (no GPU expected)."""
    if cfg.get("HW_DEVICE") != "cuda":
        return None
    return {"gpus": int(cfg.get("V4_NUM_GPUS_PER_NODE", 1) or 1), "seconds": 1.0, "gemm_n": 8192,
            "copy_mib": 2048, "probes": probes, "timeout": 120}


def run_gpu_health(node, python: str, args: dict) -> dict:
    """gpu_health.py's report from `node`, or {"error": ...} when it could not run."""
    cmd = f"{shlex.quote(python)} - {shlex.quote(json.dumps(args))} <<'V4_GPU'\n{source('gpu_health')}V4_GPU\n"
    r = node.run(cmd, timeout=float(args["timeout"]) + 60)
    try:
        return json.loads(r.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"error": f"rc {r.rc}: {r.tail(4)}"}


def pair_args(cfg) -> dict | None:
    """What nccl_bw.py measures on each pair of nodes, or None where it does not apply (CPU, one node)."""
    if cfg.get("HW_DEVICE") != "cuda" or len(cfg.nodes) < 2:
        return None
    return {"gpus": int(cfg.get("V4_NUM_GPUS_PER_NODE", 1) or 1), "bytes": PAIR_BYTES, "iters": 10, "timeout": 90,
            "backend": "nccl"}


def ring_pairs(n: int) -> list[tuple[int, int]]:
    if n < 2:
        return []
    return [(0, 1)] if n == 2 else [(i, (i + 1) % n) for i in range(n)]


def rounds(pairs: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """The pairs in rounds whose pairs share no node (a node runs one probe at a time): greedy, in order."""
    out: list[list[tuple[int, int]]] = []
    for p in pairs:
        for r in out:
            if not {x for q in r for x in q} & set(p):
                r.append(p)
                break
        else:
            out.append([p])
    return out


def _ifname(cfg, ctx, node: str) -> str:
    """The interface NCCL/Gloo bootstrap on: V4_SOCKET_IFNAME, else the one carrying the node's address (what the
    `socket_ifname` check looks at), else the default route's."""
    want = str(cfg.get("V4_SOCKET_IFNAME", "auto") or "auto")
    if want != "auto":
        return want
    net = ctx.facts.get(node, {}).get("net", {})
    carrying = [n for n, i in net.get("ifaces", {}).items() if i.get("ipv4") == node]
    return carrying[0] if carrying else (net.get("default_if") or "")


def _env(cfg, ifname: str) -> dict[str, str]:
    env = {"NCCL_NVLS_ENABLE": str(int(bool(cfg.get("HW_NCCL_NVLS_ENABLE"))))}
    if ifname:
        env["NCCL_SOCKET_IFNAME"] = env["GLOO_SOCKET_IFNAME"] = ifname
    if cfg.get("V4_NCCL_IB_DISABLE"):
        env["NCCL_IB_DISABLE"] = "1"         # as the jobs get it (plan.job_env)
    return env


def nccl_pairs(cfg, nodes, ctx, python: str, args: dict | None = None) -> list[dict] | None:
    """One result a ring pair of the nodes that have facts (not read from a container's host): {"nodes": [a, b],
    "gpus", "world", "bytes", "seconds", "busbw_gbps", "error"}. None where no pair applies."""
    args = args or pair_args(cfg)
    if args is None:
        return None
    usable = [n for n in nodes if n.name in ctx.facts and ctx.where.get(n.name) != "host"]
    results: dict[tuple[int, int], dict] = {}
    for batch in rounds(ring_pairs(len(usable))):
        threads = [threading.Thread(target=lambda p=p: results.__setitem__(p, _pair(cfg, ctx, python, args,
                                                                                       usable[p[0]], usable[p[1]])),
                                    daemon=True) for p in batch]
        for t in threads:
            t.start()
        for t in threads:
            t.join(float(args["timeout"]) + 90)
    return [results.get(p) or {"nodes": [usable[p[0]].name, usable[p[1]].name], "error": "the probe did not return"}
            for p in ring_pairs(len(usable))]


def _pair(cfg, ctx, python: str, args: dict, a, b) -> dict:
    """nccl_bw.py on node a (rank 0, the rendezvous on a port free there) and node b at once."""
    out = {"nodes": [a.name, b.name], "gpus": args["gpus"], "world": 2 * args["gpus"], "bytes": args["bytes"],
           "seconds": None, "busbw_gbps": None, "error": ""}
    free = (f"{shlex.quote(python)} -c "
            + shlex.quote("import socket; s = socket.socket(); s.bind(('', 0)); print(s.getsockname()[1])"))
    try:
        r = a.run(free, timeout=30)
        port = int(r.stdout.strip().splitlines()[-1])
    except Exception as e:   # noqa: BLE001 - the pair's result says why it was not measured
        out["error"] = f"{a.name}: could not pick a free port for the rendezvous: {type(e).__name__}: {e}"
        return out
    sides: dict[str, dict] = {}

    def side(node, rank: int) -> None:
        spec = {**args, "nodes": 2, "node_rank": rank, "master_addr": a.name, "master_port": port}
        cmd = f"{shlex.quote(python)} - {shlex.quote(json.dumps(spec))} <<'V4_NCCL'\n{source('nccl_bw')}V4_NCCL\n"
        try:
            r = node.run(cmd, env=_env(cfg, _ifname(cfg, ctx, node.name)), timeout=float(args["timeout"]) + 30)
            sides[node.name] = json.loads(r.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            sides[node.name] = {"error": f"rc {r.rc}: {r.tail(4)}"}
        except Exception as e:   # noqa: BLE001
            sides[node.name] = {"error": f"{type(e).__name__}: {e}"}

    threads = [threading.Thread(target=side, args=(n, i), daemon=True) for i, n in enumerate((a, b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(float(args["timeout"]) + 60)
    errors = [f"{n}: {sides.get(n, {}).get('error') or 'no answer'}" for n in (a.name, b.name)
              if sides.get(n, {}).get("error") or n not in sides]
    if errors:
        out["error"] = "; ".join(errors)
        return out
    n = out["world"]
    out["seconds"] = max(sides[x]["seconds"] for x in (a.name, b.name))
    out["busbw_gbps"] = 2 * (n - 1) / n * args["bytes"] / out["seconds"] / 1e9
    return out
