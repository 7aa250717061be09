"""The built-in probe: a Ray job that runs one task on every alive node and reports what it sees.

Runs ON the cluster (`python probe_job.py --expect N`); prints one `V4_PROBE {json}` line and
exits 1 when it sees fewer than N nodes, so a broken cluster fails the job, not just a log line.
"""
import argparse
import json
import os
import shutil
import socket
import subprocess
import sys

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy


@ray.remote(num_cpus=0)
def look() -> dict:
    gpus = 0
    if shutil.which("nvidia-smi"):
        r = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
        gpus = len([x for x in r.stdout.splitlines() if x.startswith("GPU ")]) if r.returncode == 0 else -1
    return {"ip": ray.util.get_node_ip_address(), "hostname": socket.gethostname(), "pid": os.getpid(),
            "python": sys.executable, "gpus_visible": gpus, "ray": ray.__version__,
            "socket_ifname": os.environ.get("NCCL_SOCKET_IFNAME", "")}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--expect", type=int, default=0, help="fail unless this many nodes answer")
    args = ap.parse_args()
    ray.init()
    nodes = [n for n in ray.nodes() if n["Alive"]]
    refs = [look.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote()
            for n in nodes]
    seen = ray.get(refs, timeout=120)
    for n, s in zip(nodes, seen):
        s["node_id"] = n["NodeID"]
        s["resources"] = {k: v for k, v in n["Resources"].items() if k in ("CPU", "GPU")}
    for s in seen:
        print(f"{s['ip']:<16} {s['hostname']:<20} GPUs(ray)={s['resources'].get('GPU', 0):g} "
              f"nvidia-smi={s['gpus_visible']} pid={s['pid']}")
    print("V4_PROBE " + json.dumps({"nodes": seen}), flush=True)
    if args.expect and len(seen) < args.expect:
        print(f"probe: {len(seen)} node(s) answered, expected {args.expect}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
