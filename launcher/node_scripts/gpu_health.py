"""Each GPU of this node measured and its error counters read (preflight `gpu_perf` and `gpu_errors`).

Measured, one forked process a GPU, all GPUs at once (as training loads them; the parent never touches CUDA, so
forking is safe):
  gemm_tflops  a bf16 GEMM n x n x n (n = 8192: the shape HW_GEMM_TFLOPS was measured with), 2 n^3 flops a
               call, timed with CUDA events over `seconds` after a warm-up
  hbm_gbps     a device-to-device copy of `copy_mib` MiB, bytes read + bytes written per second
Read (no torch, nothing measured):
  ecc          per GPU from nvidia-smi: ECC mode, volatile (since the driver loaded) uncorrected and corrected error
               counts, pages or rows pending retirement/remapping, a remapping failure; None where the driver does
               not report a field on this GPU
  xid          NVIDIA Xid events in the kernel log since boot (dmesg, else journalctl -k), by GPU; `readable` False
               with the reason where the log is closed to this user
A GPU that runs at half speed (power- or clock-capped, a throttled or degraded part) shows in the first two; one
about to fail, in the last two.

Preflight sends it as `python - ARGS` (JSON: gpus, seconds, gemm_n, copy_mib, probes, timeout) and reads one JSON
line. Standalone, on a GPU host:
    python -m launcher.node_scripts.gpu_health --json        # every GPU nvidia-smi lists; --help for the knobs
Without torch or CUDA the probes are skipped with the reason (`skipped`); the counters are still read.
"""
import json
import re
import shutil
import subprocess
import sys
import time

ECC_FIELDS = ("ecc.mode.current", "ecc.errors.uncorrected.volatile.total", "ecc.errors.corrected.volatile.total",
              "retired_pages.pending", "remapped_rows.pending", "remapped_rows.failure")
ECC_KEYS = ("mode", "uncorrected_volatile", "corrected_volatile", "retired_pending", "remapped_pending",
            "remapped_failure")
XID_RE = re.compile(r"NVRM: Xid \(PCI:([0-9A-Fa-f]{4}:)?([0-9A-Fa-f]{2}:[0-9A-Fa-f]{2})[^)]*\): (\d+)")
# Xids NVIDIA's catalog puts on the hardware or the driver, not on the application (13, 31, 43, 45: a program's own
# faults): 48 double-bit ECC, 61/62 micro-controller, 63/64 row remapping, 74 NVLink, 79 fallen off the bus,
# 92 high single-bit ECC rate, 94/95 contained/uncontained ECC, 119/120 GSP, 140 unrecovered ECC
HARDWARE_XIDS = {48, 61, 62, 63, 64, 74, 79, 92, 94, 95, 119, 120, 140}


def run(argv, timeout=30):
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
        return r.returncode, r.stdout, r.stderr
    except (OSError, subprocess.TimeoutExpired) as e:
        return 127, "", str(e)


def _value(text):
    """An nvidia-smi csv cell: int, "Enabled"/"Disabled", a yes/no as 1/0, None for [N/A] and the like."""
    t = text.strip()
    if not t or t.startswith("[") or t.upper() in ("N/A", "NOT SUPPORTED"):
        return None
    if t.isdigit():
        return int(t)
    if t.lower() in ("yes", "no"):
        return int(t.lower() == "yes")
    return t


def smi_gpus():
    """[(index, name, pci bus id)] from nvidia-smi, or (None, why)."""
    if not shutil.which("nvidia-smi"):
        return None, "nvidia-smi not found"
    rc, out, err = run(["nvidia-smi", "--query-gpu=index,name,pci.bus_id", "--format=csv,noheader"])
    if rc != 0:
        return None, (err or out).strip()[-300:]
    rows = []
    for line in out.strip().splitlines():
        idx, name, bus = [x.strip() for x in line.split(",")]
        rows.append((int(idx), name, bus))
    return rows, ""


def ecc_counters(n_gpus):
    """Per GPU {mode, uncorrected_volatile, ...}; one query for all fields, else one a field (an older driver
    refuses the whole query for one field it does not know)."""
    out = [{"index": i, **{k: None for k in ECC_KEYS}} for i in range(n_gpus)]
    rc, text, _ = run(["nvidia-smi", f"--query-gpu=index,{','.join(ECC_FIELDS)}", "--format=csv,noheader,nounits"])
    if rc == 0:
        for line in text.strip().splitlines():
            cells = line.split(",")
            i = int(cells[0])
            if i < n_gpus:
                out[i].update({k: _value(c) for k, c in zip(ECC_KEYS, cells[1:])})
        return out
    for field, key in zip(ECC_FIELDS, ECC_KEYS):
        rc, text, _ = run(["nvidia-smi", f"--query-gpu=index,{field}", "--format=csv,noheader,nounits"])
        for line in text.strip().splitlines() if rc == 0 else []:
            i, cell = line.split(",", 1)
            if int(i) < n_gpus:
                out[int(i)][key] = _value(cell)
    return out


def xid_events(gpus):
    """Xid lines of the kernel log since boot, each with the GPU index its PCI address names (None: not ours)."""
    bus_to_index = {b.lower().split(":", 1)[-1][:5]: i for i, _, b in gpus}     # "00000000:18:00.0" -> "18:00"
    text, source, why = None, "", ""
    for argv in (["dmesg"], ["journalctl", "-k", "-b", "--no-pager", "-q"]):
        rc, out, err = run(argv)
        if rc == 0 and out:
            text, source = out, argv[0]
            break
        why = why or f"{argv[0]}: {(err or out).strip()[-200:] or f'rc {rc}'}"
    if text is None:
        return {"readable": False, "source": "", "error": why, "events": []}
    events = []
    for line in text.splitlines():
        m = XID_RE.search(line)
        if m:
            events.append({"gpu": bus_to_index.get(m.group(2).lower()), "code": int(m.group(3)),
                           "line": line.strip()[-300:]})
    return {"readable": True, "source": source, "error": "", "events": events[-200:]}


def probe_gpu(index, args, q):
    """One GPU's GEMM and copy figures, put on `q` as (index, result)."""
    res = {"index": index, "gemm_tflops": None, "hbm_gbps": None, "error": ""}
    try:
        import torch
        dev = torch.device("cuda", index)
        torch.cuda.set_device(dev)
        res["name"] = torch.cuda.get_device_name(dev)
        n, seconds = int(args["gemm_n"]), float(args["seconds"])
        a = torch.randn(n, n, dtype=torch.bfloat16, device=dev)
        b = torch.randn(n, n, dtype=torch.bfloat16, device=dev)
        res["gemm_tflops"] = _rate(lambda: torch.mm(a, b), 2 * n ** 3, seconds) / 1e12
        del a, b
        nbytes = int(args["copy_mib"]) << 20
        src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        dst = torch.empty_like(src)
        res["hbm_gbps"] = _rate(lambda: dst.copy_(src), 2 * nbytes, seconds / 2) / 1e9
    except Exception as e:   # noqa: BLE001 - reported per GPU: the parent prints one JSON line
        res["error"] = f"{type(e).__name__}: {e}"[-500:]
    q.put((index, res))


def _rate(fn, work, seconds):
    """work units per second of fn(): a warm-up, then calls for ~`seconds`, timed by CUDA events."""
    import torch
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    calls, t0 = 0, time.perf_counter()
    start.record()
    while time.perf_counter() - t0 < seconds:
        for _ in range(4):                     # a few queued per check: the host check stays off the timing
            fn()
        calls += 4
        torch.cuda.synchronize()
    end.record()
    torch.cuda.synchronize()
    return work * calls / (start.elapsed_time(end) / 1e3)


def probes(n_gpus, args):
    """[per-GPU result] or a reason they were skipped."""
    try:
        import importlib.util
        if importlib.util.find_spec("torch") is None:
            return [], "torch is not installed for this Python"
    except Exception as e:   # noqa: BLE001
        return [], f"torch: {e}"
    if n_gpus == 0:
        return [], "no GPU listed by nvidia-smi"
    import multiprocessing as mp
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=probe_gpu, args=(i, args, q)) for i in range(n_gpus)]
    for p in procs:
        p.start()
    got, deadline = {}, time.time() + float(args["timeout"])
    while len(got) < n_gpus:
        try:
            i, res = q.get(timeout=max(0.1, deadline - time.time()))
        except Exception:   # noqa: BLE001 - queue.Empty: a GPU that does not answer is itself a finding
            break
        got[i] = res
    for p in procs:
        p.join(5)
        if p.is_alive():
            p.kill()
    return [got.get(i, {"index": i, "gemm_tflops": None, "hbm_gbps": None,
                        "error": f"no result within {float(args['timeout']):g} s"}) for i in range(n_gpus)], ""


def main(args):
    t0 = time.time()
    out = {"gpus": [], "ecc": [], "xid": {"readable": False, "source": "", "error": "", "events": []},
           "skipped": "", "elapsed_s": None, "args": args}
    listed, why = smi_gpus()
    if listed is None:
        out["skipped"] = why
        out["xid"]["error"] = why
    else:
        n = min(len(listed), int(args.get("gpus") or len(listed)))
        names = {i: name for i, name, _ in listed}
        out["ecc"] = ecc_counters(n)
        out["xid"] = xid_events(listed)
        if args.get("probes", True):
            results, out["skipped"] = probes(n, args)
            for r in results:
                r.setdefault("name", names.get(r["index"], ""))
            out["gpus"] = results
        else:
            out["skipped"] = "probes not asked for"
    out["elapsed_s"] = round(time.time() - t0, 2)
    return out


DEFAULTS = {"gpus": 0, "seconds": 1.0, "gemm_n": 8192, "copy_mib": 2048, "probes": True, "timeout": 120}


def _cli(argv):
    import argparse
    ap = argparse.ArgumentParser(prog="python -m launcher.node_scripts.gpu_health",
                                 description="Measure each GPU (bf16 GEMM, HBM copy) and read its ECC/Xid counters.")
    ap.add_argument("--json", action="store_true", help="one JSON object on stdout (default: a table)")
    ap.add_argument("--gpus", type=int, default=0, help="the first N GPUs (default: every one nvidia-smi lists)")
    ap.add_argument("--seconds", type=float, default=DEFAULTS["seconds"], help="GEMM timing (the copy: half)")
    ap.add_argument("--gemm-n", type=int, default=DEFAULTS["gemm_n"])
    ap.add_argument("--copy-mib", type=int, default=DEFAULTS["copy_mib"])
    ap.add_argument("--no-probes", action="store_true", help="read the counters only")
    a = ap.parse_args(argv)
    return a.json, {**DEFAULTS, "gpus": a.gpus, "seconds": a.seconds, "gemm_n": a.gemm_n, "copy_mib": a.copy_mib,
                    "probes": not a.no_probes}


def _table(out):
    lines = []
    if out["skipped"]:
        lines.append(f"probes skipped: {out['skipped']}")
    ecc = {e["index"]: e for e in out["ecc"]}
    for g in out["gpus"] or [{"index": i} for i in ecc]:
        e = ecc.get(g["index"], {})
        fig = (f"GEMM {g['gemm_tflops']:.0f} TFLOP/s, copy {g['hbm_gbps']:.0f} GB/s" if g.get("gemm_tflops")
               else g.get("error") or "not measured")
        lines.append(f"GPU {g['index']} {g.get('name', '')}: {fig}; ECC {e.get('mode')}, uncorrected "
                     f"{e.get('uncorrected_volatile')}, corrected {e.get('corrected_volatile')}, remap pending "
                     f"{e.get('remapped_pending')}, remap failure {e.get('remapped_failure')}")
    x = out["xid"]
    lines.append(f"Xid events since boot ({x['source']}): {len(x['events'])}" if x["readable"] else
                 f"Xid events: kernel log not readable ({x['error']})")
    lines += [f"  {ev['line']}" for ev in x["events"][-10:]]
    lines.append(f"({out['elapsed_s']} s)")
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1].lstrip().startswith("{"):       # preflight: JSON args, one JSON line
        print(json.dumps(main({**DEFAULTS, **json.loads(sys.argv[1])})))
    else:
        as_json, parsed = _cli(sys.argv[1:])
        result = main(parsed)
        print(json.dumps(result, indent=2) if as_json else _table(result))
