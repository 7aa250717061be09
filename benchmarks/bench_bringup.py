"""Bring-up time (`cluster up` until the GCS reports every node) for 1 host vs 3 hosts.

The hosts are network namespaces with their own sshd (tests/cluster/netns.py), so this needs root,
iproute2 and openssh-server. Both sizes are measured in the same run, alternating, on the same
hosts; the machine's load average is printed too, since the hosts share its cores.

    .venv/bin/python benchmarks/bench_bringup.py [--repeats 2]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "cluster")]

from launcher import cluster  # noqa: E402
from launcher.config import Selection, resolve  # noqa: E402
from netns import NetnsCluster, missing_requirements  # noqa: E402


def timed_up(cfg) -> tuple[float, float]:
    """(seconds to readiness, seconds to tear down)."""
    t0 = time.perf_counter()
    st = cluster.up(cfg, progress=lambda m: None)
    t1 = time.perf_counter()
    assert st.healthy and st.changed, st.problems
    reports = cluster.down(cfg, progress=lambda m: None)
    assert all(r["ok"] for r in reports), reports
    return t1 - t0, time.perf_counter() - t1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    why = missing_requirements()
    if why:
        sys.exit(f"bench_bringup: {why}")
    c = NetnsCluster.create(3)
    try:
        one = resolve(Selection(cluster=str(c.env_file(c.root / "one.env", V4_WORKER_IPS="", V4_NUM_NODES=1)), hw="cpu"))
        three = resolve(Selection(cluster=str(c.env_file(c.root / "three.env")), hw="cpu"))
        times = {1: [], 3: []}
        for i in range(args.repeats):
            for n, cfg in ((1, one), (3, three)):
                up_s, down_s = timed_up(cfg)
                times[n].append(up_s)
                print(f"repeat {i + 1}: {n} host(s): up {up_s:5.1f} s, down {down_s:4.1f} s  "
                      f"(load avg {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)", file=sys.stderr)
        m1, m3 = statistics.median(times[1]), statistics.median(times[3])
        print(f"bring-up to readiness (median of {args.repeats}): 1 host {m1:.1f} s, 3 hosts {m3:.1f} s, "
              f"ratio 3/1 = {m3 / m1:.2f}")
    finally:
        c.teardown()


if __name__ == "__main__":
    main()
