"""`nccl_pairs` on three SSH hosts in network namespaces: node_scripts/nccl_bw.py started on both nodes of each ring
pair at once, all-reducing across them (gloo on these CPU hosts; NCCL on GPU ones, the same code path), then one
host's link planted slow with a token-bucket qdisc: it fails in both its pairs and is the one named."""
from __future__ import annotations

import math
import subprocess
import time
from contextlib import contextmanager
from dataclasses import replace

import pytest

from launcher.config import resolve
from launcher.nodes import opened, python_on_nodes
from launcher.preflight import CHECKS
from launcher.preflight.gather import gather
from launcher.preflight.probes import nccl_pairs

pytestmark = [pytest.mark.netns, pytest.mark.slow]

GLOO = {"gpus": 1, "bytes": 4 << 20, "iters": 3, "timeout": 60, "backend": "gloo"}


def measure(cfg):
    with opened(cfg) as nodes:
        ctx = gather(cfg, nodes, [], measure_nccl=False, measure_gpu=False, measure_pairs=False)
        assert not ctx.errors, ctx.errors
        t0 = time.monotonic()
        ctx.pairs = nccl_pairs(cfg, nodes, ctx, python_on_nodes(cfg), args=GLOO)
        print(f"3 pairs in 3 rounds: {time.monotonic() - t0:.1f} s")
    return ctx, {n: CHECKS["nccl_pairs"].judge(n, ctx) for n in ctx.order}


# The planted slow link: 32 Mbit/s, ~0.004 GB/s, ~160 times under a healthy pair here (~0.65 GB/s on an idle 2-core
# machine). Each of its two pairs moves 6 x 4 MiB through it (the sum check, 2 warm-ups, 3 timed): ~6 s a pair, where
# a slower link would only make the test longer.
SLOW_MBIT = 32


@contextmanager
def slow_link(host, rate=f"{SLOW_MBIT}mbit"):
    dev = f"v4eth{host.index}"
    subprocess.run(["ip", "netns", "exec", host.ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
                    "burst", "32kbit", "latency", "400ms"], check=True)
    try:
        yield
    finally:
        subprocess.run(["ip", "netns", "exec", host.ns, "tc", "qdisc", "del", "dev", dev, "root"], check=False)


def test_ring_pairs_across_ssh_hosts_then_a_slow_link_named(netns_cluster, netns_cfg):
    ips = [h.ip for h in netns_cluster.hosts]
    ctx, r = measure(netns_cfg)
    assert [p["nodes"] for p in ctx.pairs] == [[ips[0], ips[1]], [ips[1], ips[2]], [ips[2], ips[0]]]
    for p in ctx.pairs:
        assert p["error"] == "" and p["world"] == 2, p
        assert math.isfinite(p["busbw_gbps"]) and p["busbw_gbps"] > 0
    assert all(v.status == "PASS" for v in r.values()), r
    healthy = min(p["busbw_gbps"] for p in ctx.pairs)
    print("healthy pairs (GB/s):", [round(p["busbw_gbps"], 3) for p in ctx.pairs])

    # host 2 sends at 32 Mbit/s: its pairs fall to ~0.004 GB/s (a world-2 all-reduce's bus bandwidth is its bytes over
    # its time). The floor sits halfway between that and the slowest healthy pair, on a log scale: far from both
    # on a loaded machine too
    sel = netns_cfg.selection
    floor = (healthy * SLOW_MBIT * 1e6 / 8 / 1e9) ** 0.5
    cfg = resolve(replace(sel, sets=(*sel.sets, f"V4_NCCL_MIN_PAIR_BUSBW_GBPS={floor:.6f}")))
    with slow_link(netns_cluster.hosts[2]):
        ctx, r = measure(cfg)
    print("with host 2 slow (GB/s):", [round(p["busbw_gbps"] or 0, 4) for p in ctx.pairs])
    assert r[ips[2]].status == "FAIL" and "every pair with this node" in r[ips[2]].detail, r[ips[2]]
    assert r[ips[0]].status == r[ips[1]].status == "WARN"
    assert f"look at {ips[2]}" in r[ips[0]].detail and f"look at {ips[2]}" in r[ips[1]].detail
