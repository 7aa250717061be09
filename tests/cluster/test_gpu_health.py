"""GPU health that measures: node_scripts/gpu_health.py run as preflight runs it (`python - ARGS`, script on stdin)
and the verdicts of `gpu_perf`, `gpu_errors` and `nccl_pairs`.

This machine has no GPU: the script's skip is real here; the driver's answers (ECC counters, Xid lines) come from a
stand-in `nvidia-smi` and `dmesg` on PATH, fed the text real ones print, so that the script's own reading of them
is what is tested. The GEMM/copy figures a GPU reports are written into the facts, as in test_preflight_checks.py;
the H200 figures themselves come from running the script there (docs/resilience.md)."""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.config import Selection, resolve
from launcher.node_scripts import source
from launcher.preflight import CHECKS
from launcher.preflight.probes import ring_pairs, rounds
from launcher.preflight.registry import Context

H200 = json.loads((Path(__file__).parent / "data" / "facts_h200.json").read_text())
A, B, C, D = "10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.4"

# What nvidia-smi prints for the queries gpu_health.py makes (two GPUs; GPU 1 with an uncorrectable error and a
# pending remap), and a kernel log with Xid 79 on GPU 1's bus and an application's Xid 13 on GPU 0's.
FAKE_SMI = r"""#!/bin/bash
case "$*" in
  *index,name,pci.bus_id*) printf '0, NVIDIA H200, 00000000:18:00.0\n1, NVIDIA H200, 00000000:2A:00.0\n' ;;
  *index,ecc.mode.current,*)
     [ -n "$SMI_OLD_DRIVER" ] && { echo 'Field "remapped_rows.pending" is not a valid field to query.'; exit 2; }
     printf '0, Enabled, 0, 3, [N/A], No, No\n1, Enabled, 2, 0, [N/A], Yes, No\n' ;;
  *remapped_rows*) echo 'Field "remapped_rows.pending" is not a valid field to query.'; exit 2 ;;
  *ecc.mode.current*) printf '0, Enabled\n1, Enabled\n' ;;
  *uncorrected.volatile*) printf '0, 0\n1, 2\n' ;;
  *corrected.volatile*) printf '0, 3\n1, 0\n' ;;
  *retired_pages*) printf '0, [N/A]\n1, [N/A]\n' ;;
  *) echo "stand-in nvidia-smi: $* not supported" >&2; exit 1 ;;
esac
"""
FAKE_DMESG = r"""#!/bin/bash
[ -n "$DMESG_DENIED" ] && { echo "dmesg: read kernel buffer failed: Operation not permitted" >&2; exit 1; }
echo "[ 12.3] NVRM: Xid (PCI:0000:18:00): 13, pid=4242, name=python, Graphics Exception"
echo "[ 99.1] NVRM: Xid (PCI:0000:2a:00): 79, pid=1, name=python, GPU has fallen off the bus."
"""


def run_script(args: dict, env: dict | None = None) -> dict:
    p = subprocess.run([sys.executable, "-", json.dumps(args)], input=source("gpu_health"), capture_output=True,
                       text=True, timeout=120, env={**os.environ, **(env or {})})
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.fixture
def fake_driver(tmp_path):
    d = tmp_path / "bin"
    d.mkdir()
    for name, text in (("nvidia-smi", FAKE_SMI), ("dmesg", FAKE_DMESG), ("journalctl", "#!/bin/bash\nexit 1\n")):
        (d / name).write_text(text)
        (d / name).chmod(0o755)
    return {"PATH": f"{d}:{os.environ['PATH']}"}


def cfg_for(hw="h200", cluster="h200_template", **sets):
    return resolve(Selection(cluster=cluster, hw=hw, sets=tuple(f"{k}={v}" for k, v in sets.items())))


def judge(name, cfg, per_node: dict, **ctx_fields):
    ctx = Context(cfg=cfg, order=list(per_node), facts=per_node, token="tok", **ctx_fields)
    return {n: CHECKS[name].judge(n, ctx) for n in per_node}


def facts(health=None, **changes):
    f = copy.deepcopy(H200)
    if health is not None:
        f["gpu_health"] = health
    f.update(changes)
    return f


def health(gemm=(790, 790), hbm=(4200, 4200), ecc=None, xid=None, errors=()):
    gpus = [{"index": i, "name": "NVIDIA H200", "gemm_tflops": g, "hbm_gbps": h, "error": ""}
            for i, (g, h) in enumerate(zip(gemm, hbm))]
    for i in errors:
        gpus[i].update(gemm_tflops=None, hbm_gbps=None, error="RuntimeError: CUDA error: unspecified launch failure")
    return {"gpus": gpus, "skipped": "", "elapsed_s": 3.0,
            "ecc": ecc if ecc is not None else [{"index": i, "mode": "Enabled", "uncorrected_volatile": 0,
                                                 "corrected_volatile": 0, "retired_pending": None,
                                                 "remapped_pending": 0, "remapped_failure": 0}
                                                for i in range(len(gpus))],
            "xid": xid or {"readable": True, "source": "dmesg", "error": "", "events": []}}


# --- the script on the node ----------------------------------------------------------------------------------

def test_without_a_gpu_the_probes_skip_with_the_reason():
    r = run_script({"gpus": 8})
    assert r["skipped"] == "nvidia-smi not found" and r["gpus"] == [] and r["xid"]["readable"] is False
    standalone = subprocess.run([sys.executable, "-m", "launcher.node_scripts.gpu_health", "--json"],
                                capture_output=True, text=True, timeout=60, cwd=Path(__file__).resolve().parents[2])
    assert standalone.returncode == 0 and json.loads(standalone.stdout)["skipped"] == "nvidia-smi not found"


def test_counters_and_xid_events_as_the_driver_reports_them(fake_driver):
    r = run_script({"gpus": 2, "probes": False}, fake_driver)
    assert r["skipped"] == "probes not asked for"
    assert r["ecc"][0] == {"index": 0, "mode": "Enabled", "uncorrected_volatile": 0, "corrected_volatile": 3,
                           "retired_pending": None, "remapped_pending": 0, "remapped_failure": 0}
    assert r["ecc"][1]["uncorrected_volatile"] == 2 and r["ecc"][1]["remapped_pending"] == 1
    assert [(e["gpu"], e["code"]) for e in r["xid"]["events"]] == [(0, 13), (1, 79)]
    assert r["xid"]["source"] == "dmesg"
    # an older driver refuses the whole query for one field it lacks: the others are still read, one by one
    old = run_script({"gpus": 2, "probes": False}, {**fake_driver, "SMI_OLD_DRIVER": "1"})
    assert old["ecc"][1]["uncorrected_volatile"] == 2 and old["ecc"][1]["remapped_pending"] is None
    closed = run_script({"gpus": 2, "probes": False}, {**fake_driver, "DMESG_DENIED": "1"})
    assert closed["xid"]["readable"] is False and "Operation not permitted" in closed["xid"]["error"]


def test_the_script_s_counters_judged(fake_driver):
    cfg = cfg_for(V4_NUM_GPUS_PER_NODE=2)
    r = judge("gpu_errors", cfg, {A: facts(run_script({"gpus": 2, "probes": False}, fake_driver))})[A]
    assert r.status == "FAIL" and "GPU 1: 2 uncorrectable ECC" in r.detail and "pending remapping" in r.detail
    assert "nvidia-smi -r" in r.fix


def test_probes_that_cannot_reach_a_gpu_say_so_per_gpu(fake_driver):
    """nvidia-smi lists two GPUs but torch finds no CUDA device: each GPU's figure is an error, not a number."""
    r = run_script({"gpus": 2, "seconds": 0.1, "copy_mib": 1, "gemm_n": 64, "timeout": 60}, fake_driver)
    assert [g["index"] for g in r["gpus"]] == [0, 1]
    assert all(g["error"] and g["gemm_tflops"] is None for g in r["gpus"]), r["gpus"]
    v = judge("gpu_perf", cfg_for(V4_NUM_GPUS_PER_NODE=2), {A: facts(r)})[A]
    assert v.status == "FAIL" and v.detail.startswith("GPU 0: the probe failed")


# --- the verdicts ---------------------------------------------------------------------------------------------

def test_gpu_checks_skip_on_cpu_and_when_not_measured():
    cpu = cfg_for(hw="cpu", cluster="local")
    for name in ("gpu_perf", "gpu_errors", "nccl_pairs"):
        r = judge(name, cpu, {A: facts(health())})[A]
        assert r.status == "SKIP" and ("HW_DEVICE=cpu" in r.detail or "HW_DEVICE=cuda" in r.detail), r
    assert judge("gpu_perf", cfg_for(), {A: facts()})[A].status == "SKIP"           # not measured
    assert judge("nccl_pairs", cfg_for(), {A: facts()})[A].detail == "not measured"


def test_a_gpu_at_half_speed_fails_against_the_hw_layer():
    cfg = cfg_for(V4_NUM_GPUS_PER_NODE=2, HW_GEMM_TFLOPS=790, HW_HBM_GBPS=0)
    ok = judge("gpu_perf", cfg, {A: facts(health(gemm=(781, 795)))})[A]
    assert ok.status == "PASS" and "GEMM 781-795 TFLOP/s (expected 790: HW_GEMM_TFLOPS)" in ok.detail
    assert "copy 4200 GB/s (expected 4200: median of the cluster's 2 GPUs (HW_HBM_GBPS unset))" in ok.detail
    alone = judge("gpu_perf", cfg_for(HW_GEMM_TFLOPS=790, HW_HBM_GBPS=0), {A: facts(health(gemm=(790,), hbm=(4200,)))})[A]
    assert alone.status == "PASS" and "copy 4200 GB/s (HW_HBM_GBPS unset: not judged)" in alone.detail
    slow = judge("gpu_perf", cfg, {A: facts(health(gemm=(790, 395)))})[A]
    assert slow.status == "FAIL" and "GPU 1 GEMM 395 TFLOP/s = 50% of 790" in slow.detail
    assert "HW_GPU_PROBE_MIN_FRACTION" in slow.detail and "PERFORMANCE" in slow.fix
    # 0.7 passes at a fraction of 0.6: the threshold is the hw layer's key
    assert judge("gpu_perf", cfg_for(V4_NUM_GPUS_PER_NODE=2, HW_GEMM_TFLOPS=790, HW_GPU_PROBE_MIN_FRACTION=0.6),
                 {A: facts(health(gemm=(790, 553)))})[A].status == "PASS"
    nan = judge("gpu_perf", cfg, {A: facts(health(gemm=(790, float("nan"))))})[A]    # NaN < threshold is False
    assert nan.status == "FAIL" and "GPU 1" in nan.detail, nan
    broken = judge("gpu_perf", cfg, {A: facts(health(errors=(1,)))})[A]
    assert broken.status == "FAIL" and "GPU 1: the probe failed" in broken.detail
    gone = judge("gpu_perf", cfg, {A: facts({"error": "rc 127: python3: not found"})})[A]
    assert gone.status == "FAIL" and "did not run" in gone.detail


def test_without_an_expectation_the_cluster_median_judges():
    cfg = cfg_for(V4_NUM_GPUS_PER_NODE=2, HW_GEMM_TFLOPS=0, HW_HBM_GBPS=0)
    r = judge("gpu_perf", cfg, {A: facts(health(hbm=(4200, 4150))), B: facts(health(hbm=(4180, 2000)))})
    assert r[A].status == "PASS" and "median of the cluster's 4 GPUs" in r[A].detail
    assert r[B].status == "FAIL" and "GPU 1 copy 2000 GB/s" in r[B].detail


def test_error_counters_and_xid_events():
    cfg = cfg_for(V4_NUM_GPUS_PER_NODE=2)
    clean = judge("gpu_errors", cfg, {A: facts(health())})[A]
    assert clean.status == "PASS" and "0 uncorrectable" in clean.detail and "no hardware Xid" in clean.detail
    h = health()
    h["xid"]["events"] = [{"gpu": 1, "code": 79, "line": "NVRM: Xid (PCI:0000:2a:00): 79, GPU has fallen off the bus."},
                          {"gpu": 0, "code": 13, "line": "NVRM: Xid (PCI:0000:18:00): 13, Graphics Exception"}]
    xid = judge("gpu_errors", cfg, {A: facts(h)})[A]
    assert xid.status == "WARN" and "79 on GPU 1" in xid.detail and "13" not in xid.detail.split(":")[1]
    h = health()
    h["ecc"][0]["remapped_failure"] = 1
    assert judge("gpu_errors", cfg, {A: facts(h)})[A].status == "FAIL"
    h = health(ecc=[{"index": 0, "mode": None, "uncorrected_volatile": None, "corrected_volatile": None,
                     "retired_pending": None, "remapped_pending": None, "remapped_failure": None}] * 2,
               xid={"readable": False, "source": "", "error": "dmesg: Operation not permitted", "events": []})
    unknown = judge("gpu_errors", cfg, {A: facts(h)})[A]
    assert unknown.status == "PASS" and "not reported" in unknown.detail and "not readable" in unknown.detail


def pair(a, b, busbw=None, error=""):
    return {"nodes": [a, b], "gpus": 8, "world": 16, "bytes": 256 << 20, "seconds": 1.0, "busbw_gbps": busbw,
            "error": error}


def test_the_node_with_the_bad_link_is_the_one_in_two_bad_pairs():
    nodes = {n: facts() for n in (A, B, C, D)}
    cfg = cfg_for(V4_NCCL_MIN_PAIR_BUSBW_GBPS=100)
    pairs = [pair(A, B, 180), pair(B, C, 8), pair(C, D, 7), pair(D, A, 181)]        # C's link fell back to TCP
    r = judge("nccl_pairs", cfg, nodes, pairs=pairs)
    assert r[C].status == "FAIL" and "every pair with this node" in r[C].detail and "ibstat" in r[C].fix
    assert r[B].status == r[D].status == "WARN" and f"look at {C}" in r[B].detail and f"look at {C}" in r[D].detail
    assert r[A].status == "PASS" and "with 10.0.0.2: 180 GB/s" in r[A].detail
    # without a floor the pairs are held to one another: the same two pairs, under half the median
    rel = judge("nccl_pairs", cfg_for(), nodes, pairs=pairs)
    assert rel[C].status == "WARN" and "half the median" in rel[C].detail and rel[A].status == "PASS"
    failed = [pair(A, B, 180), pair(B, C, error=f"{C}: RuntimeError: NCCL error: unhandled system error"),
              pair(C, D, error=f"{C}: no result from 8 rank(s) within 90 s"), pair(D, A, 179)]
    r = judge("nccl_pairs", cfg_for(), nodes, pairs=failed)
    assert r[C].status == "FAIL" and "unhandled system error" in r[C].detail and r[B].status == "WARN"


def test_two_nodes_one_pair_blames_both_and_one_node_skips():
    r = judge("nccl_pairs", cfg_for(V4_NCCL_MIN_PAIR_BUSBW_GBPS=100), {A: facts(), B: facts()},
              pairs=[pair(A, B, 12)])
    assert r[A].status == r[B].status == "FAIL" and "cannot be told" in r[A].detail
    one = judge("nccl_pairs", cfg_for(V4_NUM_NODES=1, V4_WORKER_IPS=""), {A: facts()})[A]
    assert one.status == "SKIP" and "2 or more nodes" in one.detail


@pytest.mark.parametrize("n", range(2, 10))
def test_ring_pairs_in_rounds(n):
    pairs, batches = ring_pairs(n), rounds(ring_pairs(n))
    assert sorted(p for b in batches for p in b) == sorted(pairs)
    assert len(batches) == (1 if n == 2 else 2 if n % 2 == 0 else 3)
    for b in batches:
        used = [x for p in b for x in p]
        assert len(used) == len(set(used))
    if n > 2:
        assert all(sum(i in p for p in pairs) == 2 for i in range(n))      # every node in two pairs
