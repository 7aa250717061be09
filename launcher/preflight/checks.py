"""The checks, in the order they run and print. Why each exists: ../shared/reference/prior-art-launcher.md
(the bash launcher's preflight checked only that paths existed and that `ray status` printed something).
"""
from __future__ import annotations

import math
import re

from launcher.nodes import python_on_nodes
from launcher.preflight.gather import nccl_args
from launcher.preflight.registry import Context, check

PASS, WARN, FAIL, SKIP = "PASS", "WARN", "FAIL", "SKIP"
RAY_SOCKET_TAIL = len("/ray65535/session_2026-11-29_10-04-04_812959_17681/sockets/plasma_store")
AF_UNIX_MAX = 107

# (distribution, first bad, last bad, what goes wrong, fix)
KNOWN_BAD = [
    ("tilelang", "0.1.9", "0.1.10",
     "aggressive shared-memory merge aliases an accumulator onto Q_shared in the sparse-MLA backward: "
     "NaN gradients (tile-ai/tilelang#2199, fixed in 0.1.11)",
     "upgrade to tilelang>=0.1.11 or set TL_ENABLE_AGGRESSIVE_SHARED_MEMORY_MERGE False"),
]


def vtuple(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", v.split("+")[0])[:3])


def is_cuda(ctx: Context) -> bool:
    return ctx.cfg.get("HW_DEVICE", "cpu") == "cuda"


def gpus_per_node(ctx: Context) -> int:
    return int(ctx.cfg["V4_NUM_GPUS_PER_NODE"])


# --- reachability --------------------------------------------------------------------------------

@check("ssh", "the node answers over SSH (key auth, pinned host key)", needs_facts=False)
def ssh(node, ctx):
    stage, err = ctx.errors.get(node, ("", ""))
    cfg = ctx.cfg
    if stage == "ssh":
        if "host key" in err:
            fix = err.split(". ", 1)[-1] if ". " in err else "add the node's host key to V4_SSH_KNOWN_HOSTS"
        elif "V4_SSH_KEY=" in err:          # the key file itself is missing or unreadable: no host is to blame
            fix = ("point V4_SSH_KEY at an existing private key file this user can read (the key whose .pub is in "
                   f"~{cfg['V4_SSH_USER']}/.ssh/authorized_keys on the nodes), or create one: ssh-keygen -t ed25519 -f FILE")
        elif err.startswith("`true` over SSH exited"):
            fix = (f"log in as {cfg['V4_SSH_USER']}@{node} and run `bash -c true`: the account's shell (nologin?) or a "
                   "startup file (~/.bashrc, BASH_ENV) must let a command run and exit 0; `timeout` (coreutils) must exist")
        elif "authentication failed" in err:
            fix = (f"append {cfg.get('V4_SSH_KEY') or 'your key'}.pub to ~{cfg['V4_SSH_USER']}/.ssh/authorized_keys "
                   f"on {node}, or point V4_SSH_KEY at a key it accepts")
        else:
            fix = (f"check the address, that sshd runs on port {cfg['V4_SSH_PORT']}, and firewalls "
                   f"(V4_SSH_CONNECT_TIMEOUT={cfg['V4_SSH_CONNECT_TIMEOUT']:g} s)")
        return FAIL, err, fix
    if cfg["V4_TRANSPORT"] == "local":
        return PASS, "local (no SSH)"
    host = ctx.facts.get(node, {}).get("hostname", "?")
    return PASS, f"{cfg['V4_SSH_USER']}@{node} ({host}) in {ctx.ssh_seconds.get(node, 0):.2f} s"


def _not_in_container(ctx: Context, node: str) -> str:
    """Why a software check cannot judge `node` yet (container mode, facts from the host)."""
    box = ctx.containers.get(node, {})
    state = {"absent": "does not exist yet", "stopped": "is stopped", "error": "cannot be inspected"}.get(
        box.get("state", ""), "is not the one `v4 cluster up` would use" if box else "was not inspected")
    return (f"container {ctx.cfg['V4_CONTAINER']} {state}: judged inside it once `v4 cluster up` runs it "
            "(run `v4 preflight` again then)")


@check("container", "container mode: V4_CONTAINER on each host is absent (made by `v4 cluster up`) or v4's own, "
                    "running V4_IMAGE", needs_facts=False)
def container(node, ctx):
    cfg = ctx.cfg
    name, image = str(cfg.get("V4_CONTAINER", "") or ""), str(cfg.get("V4_IMAGE", "") or "")
    if ctx.errors.get(node, ("",))[0] == "ssh":
        return None                          # the ssh row says why nothing is known about this node
    if not name:
        return SKIP, "V4_CONTAINER is empty: commands run on the host"
    box = ctx.containers.get(node)
    if box is None:
        return None                          # gathering failed before it was asked; the python row says why
    if box["state"] == "error":
        fix = (f"install Docker on {node} (with the NVIDIA container toolkit for GPUs), or empty V4_CONTAINER to run on "
               "the hosts" if "not found" in box["error"] else
               f"make `docker` work for {cfg['V4_SSH_USER']} on {node} (daemon running; the user in the docker group)")
        return FAIL, box["error"], fix
    if box["state"] == "absent":
        return PASS, f"{name} not created yet: `v4 cluster up` creates it from {image}; facts read on the host"
    if not box["ours"]:
        return FAIL, (f"a container named {name} exists but v4 did not create it for cluster {cfg['V4_CLUSTER_NAME']} "
                      f"(label v4.launcher={box['owner'] or '(none)'}); `v4 cluster up` will refuse it"), \
            f"remove it on {node} (docker rm -f {name}) if it is unused, or set V4_CONTAINER to another name"
    if box["state"] != "running":
        return PASS, f"{name} (v4's) is stopped: `v4 cluster up` replaces it; facts read on the host"
    if box["image"] != image:
        return WARN, (f"{name} runs {box['image']}, not V4_IMAGE={image}: a healthy cluster keeps it; facts read on "
                      "the host"), "`v4 cluster down`, then `v4 cluster up` to run V4_IMAGE (or set V4_IMAGE back)"
    return PASS, f"{name} runs {image} (v4's); facts read inside it"


@check("python", "V4_PYTHON runs on the node (>= 3.12)", needs_facts=False)
def python(node, ctx):
    stage, err = ctx.errors.get(node, ("", ""))
    if stage == "ssh":
        return None
    if stage == "python":
        if ctx.where.get(node) == "host":
            return FAIL, err, (f"until container {ctx.cfg['V4_CONTAINER']} runs, preflight reads {node}'s facts with "
                               "the host's python3 (3.8+, standard library only): install it there, or run "
                               "`v4 cluster up` first and `v4 preflight` again")
        if ctx.where.get(node) == "container":
            return FAIL, err, (f"the image {ctx.cfg.get('V4_IMAGE')} must provide V4_PYTHON "
                               f"({python_on_nodes(ctx.cfg)}): fix the image or V4_PYTHON")
        return FAIL, err, "install the project's environment on every node at the same path, or set V4_PYTHON"
    if ctx.on_host(node):
        return SKIP, _not_in_container(ctx, node)
    f = ctx.facts[node]
    if vtuple(f["python"]) < (3, 12):
        return FAIL, f"{f['python_executable']} is Python {f['python']}", "use Python >= 3.12 (megatron-core >= 0.17)"
    return PASS, f"{f['python_executable']} (Python {f['python']})"


# --- software --------------------------------------------------------------------------------------

def _versions(f: dict) -> dict:
    return {"python": f["python"], **{k: v or "absent" for k, v in f["packages"].items()}}


@check("versions", "python, torch, megatron-core, tilelang and ray are the same on every node")
def versions(node, ctx):
    if ctx.on_host(node):
        return SKIP, _not_in_container(ctx, node)
    mine, usual = _versions(ctx.facts[node]), ctx.majority(_versions, where=lambda n: not ctx.on_host(n))
    diff = {k: v for k, v in mine.items() if usual.get(k) != v}
    text = ", ".join(f"{k} {v}" for k, v in mine.items())
    if diff:
        return (FAIL, "differs from the other nodes: " + ", ".join(f"{k} {v} (others: {usual[k]})" for k, v in diff.items()),
                f"install the same versions on {node} as elsewhere (one image / one venv at the same path); "
                f"check PATH/PYTHONPATH there")
    return PASS, text


@check("packages", "packages the jobs import are installed")
def packages(node, ctx):
    if ctx.on_host(node):
        return SKIP, _not_in_container(ctx, node)
    pk = ctx.facts[node]["packages"]
    # Ray is needed only when steps run as Ray jobs (V4_EXECUTOR=local runs them as subprocesses)
    need = (["ray"] if ctx.cfg.get("V4_EXECUTOR", "ray") == "ray" else []) + ["torch", "megatron-core"]
    if is_cuda(ctx) and ctx.cfg.get("PRESET_ATTN_IMPL", "auto") in ("auto", "tilelang"):
        need.append("tilelang")
    missing = [p for p in need if not pk.get(p)]
    if missing:
        return FAIL, f"not installed for {python_on_nodes(ctx.cfg)}: {', '.join(missing)}", \
            f"pip install {' '.join(missing)} into that environment (see pyproject.toml for the versions)"
    return PASS, ", ".join(need) + " present"


@check("known_bad", "no package version with a known correctness bug")
def known_bad(node, ctx):
    if ctx.on_host(node):
        return SKIP, _not_in_container(ctx, node)
    pk = ctx.facts[node]["packages"]
    for dist, lo, hi, why, fix in KNOWN_BAD:
        v = pk.get(dist)
        if v and vtuple(lo) <= vtuple(v) <= vtuple(hi):
            return FAIL, f"{dist} {v}: {why}", fix
    return PASS, "none of: " + ", ".join(f"{d} {lo}-{hi}" for d, lo, hi, _, _ in KNOWN_BAD)


def _rollout_node(ctx: Context, node: str) -> bool:
    """Whether this run starts an SGLang rollout server on `node` (launcher/rollout.py)."""
    from launcher import rollout
    return rollout.enabled(ctx.cfg) and node in rollout.rollout_nodes(ctx.cfg)


@check("sglang", "on rollout nodes (V4_ROLLOUT_ENGINE=sglang): V4_PYTHON has SGLang at the pinned V4_SGLANG_VERSION")
def sglang(node, ctx):
    cfg = ctx.cfg
    if cfg.get("V4_ROLLOUT_ENGINE", "embedded") != "sglang":
        return SKIP, f"V4_ROLLOUT_ENGINE={cfg.get('V4_ROLLOUT_ENGINE', 'embedded')}: no SGLang server"
    if cfg.get("PRESET_MODE") != "rl":
        return SKIP, f"PRESET_MODE={cfg.get('PRESET_MODE')}: only RL runs start SGLang servers"
    if not _rollout_node(ctx, node):
        return SKIP, "no rollout server on this node (V4_ROLLOUT_NODES)"
    if ctx.on_host(node):
        return SKIP, _not_in_container(ctx, node)
    pin, have = str(cfg["V4_SGLANG_VERSION"]), ctx.facts[node].get("sglang")
    install = f"pip install sglang=={pin} into {python_on_nodes(cfg)} on {node} (or the image)"
    if not have:
        return FAIL, f"sglang is not installed for {python_on_nodes(cfg)}", install
    if have != pin:
        return FAIL, f"sglang {have}, but V4_SGLANG_VERSION={pin} is pinned (flags and the RL API change between " \
                     "versions)", f"{install}, or pin V4_SGLANG_VERSION={have} after checking its flags"
    return PASS, f"sglang {have} (pinned {pin})"


# --- GPUs --------------------------------------------------------------------------------------------

@check("gpu", "GPU count and model match the hw layer")
def gpu(node, ctx):
    g = ctx.facts[node]["gpu"]
    if not is_cuda(ctx):
        return SKIP, f"HW_DEVICE=cpu ({len(g['gpus'])} GPU(s) seen, none needed)"
    cfg, want = ctx.cfg, gpus_per_node(ctx)
    if not g["nvidia_smi"]:
        return FAIL, "nvidia-smi not found: no NVIDIA driver", "install the driver, or use --hw cpu"
    if g["error"]:
        return FAIL, f"nvidia-smi failed: {g['error']}", "check the driver (dmesg, nvidia-smi)"
    names = sorted({x["name"] for x in g["gpus"]})
    if len(g["gpus"]) < want:
        return FAIL, f"{len(g['gpus'])} GPU(s) ({', '.join(names)}), V4_NUM_GPUS_PER_NODE={want}", \
            "fix the node (nvidia-smi) or lower V4_NUM_GPUS_PER_NODE"
    expect = str(cfg.get("HW_GPU_NAME", "") or "")
    # A whole word: "H20" must not accept an "NVIDIA H200" (nor the reverse).
    word = re.compile(rf"(?<![A-Za-z0-9]){re.escape(expect)}(?![A-Za-z0-9])", re.I)
    wrong = [x["name"] for x in g["gpus"] if expect and not word.search(x["name"])]
    if wrong:
        return FAIL, f"GPU model {wrong[0]!r} does not contain HW_GPU_NAME={expect!r}", \
            "select the matching hw layer (--hw), or fix HW_GPU_NAME"
    # Vendors' "141 GB" (H200) / "96 GB" (H20) are GiB: nvidia-smi says 143771 / 97871 MiB.
    mem_gb = min(x["memory_total_mib"] for x in g["gpus"]) / 1024
    want_gb = float(cfg.get("HW_GPU_MEMORY_GB", 0) or 0)
    detail = f"{len(g['gpus'])} x {names[0]} ({mem_gb:.0f} GiB)"
    if want_gb and abs(mem_gb - want_gb) > 0.1 * want_gb:
        return WARN, detail + f"; HW_GPU_MEMORY_GB={want_gb:g}", "correct HW_GPU_MEMORY_GB in the hw layer"
    return PASS, detail


@check("driver", "driver supports the CUDA torch was built for; same driver on every node")
def driver(node, ctx):
    g = ctx.facts[node]["gpu"]
    if not is_cuda(ctx):
        return SKIP, "HW_DEVICE=cpu"
    if not g["driver"]:
        return FAIL, "no driver version (nvidia-smi)", "install the NVIDIA driver"
    torch_v = ctx.facts[node]["packages"].get("torch") or ""
    m = re.search(r"\+cu(\d+)(\d)$", torch_v)
    detail = f"driver {g['driver']}, CUDA {g['cuda']}" + (f", torch {torch_v}" if torch_v else "")
    usual = ctx.majority(lambda f: f["gpu"]["driver"])
    if m and g["cuda"]:
        need = (int(m.group(1)), int(m.group(2)))
        have = vtuple(g["cuda"])[:2]
        if have[0] < need[0]:
            return FAIL, detail + f": torch needs CUDA {need[0]}.{need[1]}", "upgrade the driver or use a torch built for this CUDA"
        if have < need:
            return WARN, detail + f": torch built for CUDA {need[0]}.{need[1]} (minor-version compatibility only)", \
                "upgrade the driver"
    if usual and g["driver"] != usual:
        return WARN, detail + f"; other nodes run driver {usual}", "run one driver version across the cluster"
    return PASS, detail


@check("gpu_memory", "no GPU memory held by processes this tool did not start")
def gpu_memory(node, ctx):
    f = ctx.facts[node]
    g = f["gpu"]
    if not is_cuda(ctx):
        return SKIP, "HW_DEVICE=cpu"
    ours = f.get("our_session")
    worst, who = 0.0, ""
    for x in g["gpus"]:
        apps = [a for a in g["apps"] if a["gpu_uuid"] == x["uuid"]]
        foreign = sum(a["used_mib"] for a in apps if not (ours and a["v4_session"] == ours))
        invisible = max(0.0, x["memory_used_mib"] - sum(a["used_mib"] for a in apps) - 1024)  # driver reserve
        used = (foreign + invisible) / 1024
        if used > worst:
            worst = used
            pids = [str(a["pid"]) for a in apps if not (ours and a["v4_session"] == ours)]
            who = f"GPU {x['index']}: {used:.1f} GiB" + (f" (pids {', '.join(pids)})" if pids else
                                                          " (processes not visible here, e.g. another container)")
    if worst > 2:
        return FAIL, f"memory in use by others: {who}", "stop those processes (the cluster's reaper/other users) first"
    if worst > 0.5:
        return WARN, f"memory in use by others: {who}", "check what holds it (nvidia-smi)"
    return PASS, f"{len(g['gpus'])} GPU(s) free of foreign processes"


@check("nvlink", "NVLink links are up; NVLS only where NVLink exists")
def nvlink(node, ctx):
    g = ctx.facts[node]["gpu"]
    if not is_cuda(ctx):
        return SKIP, "HW_DEVICE=cpu"
    if gpus_per_node(ctx) < 2:
        return SKIP, "one GPU per node"
    nvls = bool(ctx.cfg.get("HW_NCCL_NVLS_ENABLE", False))
    if g["nvlink_active"] is None:
        return WARN, "could not query NVLink (nvidia-smi nvlink --status)", "check the driver"
    if g["nvlink_active"] == 0:
        if nvls:
            return FAIL, "HW_NCCL_NVLS_ENABLE=1 but no NVLink link is active", "set HW_NCCL_NVLS_ENABLE=0"
        return WARN, "no active NVLink: GPU-to-GPU traffic goes over PCIe", "check the NVLink/NVSwitch fabric manager"
    return PASS, f"{g['nvlink_active']} active link(s); NVLS {'on' if nvls else 'off'}"


@check("nccl", "an all-reduce across the node's GPUs over NCCL sums right, at the bus bandwidth the hw layer expects")
def nccl(node, ctx):
    if nccl_args(ctx.cfg) is None:               # the rule that decides whether gather measures at all
        return SKIP, "needs HW_DEVICE=cuda and 2 or more GPUs per node"
    r = ctx.facts[node].get("nccl")
    if r is None:
        return SKIP, _not_in_container(ctx, node) if ctx.on_host(node) else "not measured"
    fix = ("on the node, NCCL_DEBUG=INFO in the environment says why; check `nvidia-smi topo -m` (GPU links), "
           "NCCL_P2P_DISABLE / NCCL_SHM_DISABLE in the environment, and that no other job holds the GPUs")
    if r.get("error"):
        return FAIL, f"all-reduce over {r['gpus']} GPUs failed: {r['error']}", fix
    busbw = r.get("busbw_gbps")
    if not (isinstance(busbw, (int, float)) and math.isfinite(busbw) and busbw > 0):
        return FAIL, f"all-reduce over {r['gpus']} GPUs gave no usable bandwidth figure ({busbw!r})", fix
    want = float(ctx.cfg.get("HW_NCCL_MIN_BUSBW_GBPS", 0) or 0)
    detail = f"{r['gpus']} GPUs, {r['bytes'] >> 20} MiB bf16: bus bandwidth {busbw:.0f} GB/s"
    if want and busbw < want:
        return WARN, detail + f", under HW_NCCL_MIN_BUSBW_GBPS={want:g}", fix
    return PASS, detail


def _gpu_health(node, ctx: Context):
    """(report, None) or (None, the SKIP/FAIL verdict) for the gpu_health checks."""
    if not is_cuda(ctx):
        return None, (SKIP, "HW_DEVICE=cpu: no GPU to measure")
    if ctx.on_host(node):
        return None, (SKIP, _not_in_container(ctx, node))
    h = ctx.facts[node].get("gpu_health")
    if h is None:
        return None, (SKIP, "not measured")
    if h.get("error"):
        return None, (FAIL, f"the GPU probe did not run: {h['error']}",
                      "run `python -m launcher.node_scripts.gpu_health` on the node to see why")
    return h, None


def _median(values: list[float]) -> float | None:
    import statistics
    return statistics.median(values) if values else None


@check("gpu_perf", "each GPU's bf16 GEMM and HBM copy reach HW_GPU_PROBE_MIN_FRACTION of the hw layer's figures "
                   "(or of the cluster's GPUs' median)")
def gpu_perf(node, ctx):
    h, verdict = _gpu_health(node, ctx)
    if verdict:
        return verdict
    if h.get("skipped"):
        return FAIL, f"the GPU probes were skipped: {h['skipped']}", \
            "the packages and driver checks above say what is missing; fix that, then `v4 preflight` again"
    gpus = h["gpus"]
    broken = [g for g in gpus if g.get("error") or not all(
        isinstance(g.get(k), (int, float)) and math.isfinite(g[k]) and g[k] > 0 for k in ("gemm_tflops", "hbm_gbps"))]
    if broken:
        g = broken[0]
        return FAIL, f"GPU {g['index']}: the probe failed: {g.get('error') or 'no usable figure'}", \
            "check the GPU (nvidia-smi -q, dmesg for Xid events); reset it (nvidia-smi -r) or leave this node out"
    frac = float(ctx.cfg.get("HW_GPU_PROBE_MIN_FRACTION") or 0)
    parts, slow = [], []
    for key, what, unit, hw in (("gemm_tflops", "GEMM", "TFLOP/s", "HW_GEMM_TFLOPS"),
                                ("hbm_gbps", "copy", "GB/s", "HW_HBM_GBPS")):
        want = float(ctx.cfg.get(hw) or 0)
        source = hw
        if not want:
            everyone = [g[key] for n in ctx.order if (f := ctx.facts.get(n, {}).get("gpu_health")) and not
                        f.get("error") for g in f.get("gpus", []) if isinstance(g.get(key), (int, float))]
            want = _median(everyone) if len(everyone) >= 2 else 0
            source = f"median of the cluster's {len(everyone)} GPUs ({hw} unset)"
        vals = [g[key] for g in gpus]
        parts.append(f"{what} {min(vals):.0f}" + (f"-{max(vals):.0f}" if round(max(vals)) > round(min(vals)) else "")
                     + f" {unit}"
                     + (f" (expected {want:.0f}: {source})" if want else f" ({hw} unset: not judged)"))
        slow += [f"GPU {g['index']} {what} {g[key]:.0f} {unit} = {g[key] / want:.0%} of {want:.0f}"
                 for g in gpus if want and not g[key] >= frac * want]   # a NaN measurement is slow too
    detail = f"{len(gpus)} GPU(s): " + ", ".join(parts)
    if slow:
        return FAIL, detail + f"; under {frac:g} (HW_GPU_PROBE_MIN_FRACTION): " + "; ".join(slow), \
            ("on the node: nvidia-smi -q -d PERFORMANCE,CLOCK,POWER (throttle reasons, power cap, clocks), "
             "nvidia-smi -q -d ECC,ROW_REMAPPER; reset or replace the GPU, or leave this node out")
    return PASS, detail


def _flag(value) -> bool:
    return isinstance(value, int) and value > 0


@check("gpu_errors", "no uncorrectable ECC errors, pending page retirements or row remaps, and no hardware Xid "
                     "events on the node's GPUs (where the driver and the kernel log report them)")
def gpu_errors(node, ctx):
    h, verdict = _gpu_health(node, ctx)
    if verdict:
        return verdict
    from launcher.node_scripts.gpu_health import HARDWARE_XIDS
    fails, warns, notes = [], [], []
    reported = [e for e in h.get("ecc", []) if any(e.get(k) is not None for k in e if k != "index")]
    for e in h.get("ecc", []):
        i = e["index"]
        if _flag(e.get("uncorrected_volatile")):
            fails.append(f"GPU {i}: {e['uncorrected_volatile']} uncorrectable ECC error(s) since the driver loaded")
        if _flag(e.get("remapped_failure")):
            fails.append(f"GPU {i}: a row remapping failed")
        if _flag(e.get("remapped_pending")) or _flag(e.get("retired_pending")):
            fails.append(f"GPU {i}: memory pending remapping/retirement (takes effect at the next GPU reset)")
        if e.get("mode") == "Disabled":
            warns.append(f"GPU {i}: ECC is off")
    if reported:
        corrected = sum(e.get("corrected_volatile") or 0 for e in reported)
        notes.append(f"ECC on {len(reported)} GPU(s): 0 uncorrectable, {corrected} corrected" if not fails else "")
    else:
        notes.append("ECC counters not reported by the driver")
    x = h.get("xid", {})
    hw = [ev for ev in x.get("events", []) if ev["code"] in HARDWARE_XIDS]
    if not x.get("readable"):
        notes.append(f"Xid events not checked: the kernel log is not readable ({x.get('error') or 'unknown'})")
    elif hw:
        codes = sorted({(ev["gpu"], ev["code"]) for ev in hw}, key=lambda t: (t[0] is None, t))
        warns.append("hardware Xid events in the kernel log since boot: " + ", ".join(
            f"{c} on GPU {g}" if g is not None else f"{c} (another GPU)" for g, c in codes)
            + f" (last: {hw[-1]['line'][-120:]})")
    else:
        notes.append(f"no hardware Xid event since boot ({x.get('source')})")
    note = "; ".join(n for n in notes if n)
    if fails:
        return FAIL, "; ".join(fails) + (f"; {note}" if note else ""), \
            ("drain the node: reset the GPU (nvidia-smi -r, no process on it) to apply pending remaps, and have it "
             "replaced if uncorrectable errors come back; or leave this node out")
    if warns:
        return WARN, "; ".join(warns) + (f"; {note}" if note else ""), \
            ("an Xid since boot may be old (a reset since fixed it): compare `dmesg -T | grep Xid` times with the "
             "GPU's last reset; NVIDIA's Xid catalog says what each code means")
    return PASS, note


@check("nccl_pairs", "an all-reduce between the GPUs of each pair of neighbouring nodes sums right, at the fabric's "
                     "bus bandwidth (V4_NCCL_MIN_PAIR_BUSBW_GBPS; else against the other pairs)")
def nccl_pairs(node, ctx):
    from launcher.preflight.probes import pair_args
    if ctx.pairs is None:
        if pair_args(ctx.cfg) is None:           # the rule that decides whether gather measures at all
            return SKIP, "needs HW_DEVICE=cuda and 2 or more nodes"
        return SKIP, "not measured"
    mine = [p for p in ctx.pairs if node in p["nodes"]]
    if not mine:
        return SKIP, _not_in_container(ctx, node) if ctx.on_host(node) else "in no measured pair"
    floor = float(ctx.cfg.get("V4_NCCL_MIN_PAIR_BUSBW_GBPS") or 0)
    good = [p["busbw_gbps"] for p in ctx.pairs if _pair_figure(p)]
    # a link that fell back from RDMA to TCP sockets measures ten times slower or worse: half the median pair
    # flags that, and a fabric's usual spread of a few percent does not
    median = _median(good) if len(good) >= 3 else None

    def judge(p) -> str:
        if not _pair_figure(p):
            return "failed"
        if floor and p["busbw_gbps"] < floor:
            return "under_floor"
        if median and p["busbw_gbps"] < 0.5 * median:
            return "slow"
        return ""

    def text(p) -> str:
        other = next(n for n in p["nodes"] if n != node)
        if not _pair_figure(p):
            return f"with {other}: failed ({p.get('error') or 'no usable figure'})"
        return f"with {other}: {p['busbw_gbps']:.0f} GB/s"

    verdicts = [judge(p) for p in mine]
    detail = f"{mine[0].get('world', '?')} GPUs a pair, {(mine[0].get('bytes') or 0) >> 20} MiB bf16: " + \
        "; ".join(text(p) for p in mine)
    fix = ("NCCL_DEBUG=INFO on both nodes says which transport NCCL chose (NET/IB vs NET/Socket) and why; check "
           "`ibstat` (ports ACTIVE, rate), the cables and switch ports, NCCL_IB_HCA / NCCL_SOCKET_IFNAME, and "
           "ulimit -l")
    bad = [v for v in verdicts if v]
    if not bad:
        limits = [f"floor {floor:g} GB/s (V4_NCCL_MIN_PAIR_BUSBW_GBPS)" if floor else "",
                  f"median pair {median:.0f} GB/s" if median else ""]
        return PASS, detail + "".join(f"; {x}" for x in limits if x)
    severe = any(v in ("failed", "under_floor") for v in bad)
    why = (f" (under V4_NCCL_MIN_PAIR_BUSBW_GBPS={floor:g})" if "under_floor" in bad else "") + \
          (f" (under half the median pair, {median:.0f} GB/s)" if "slow" in bad else "")
    nodes_in_pairs = {n for p in ctx.pairs for n in p["nodes"]}
    if len(bad) == len(mine) and (len(mine) >= 2 or len(nodes_in_pairs) == 2):
        whose = ("every pair with this node: its link is the likely fault" if len(mine) >= 2 else
                 "the only pair: which of the two nodes is at fault cannot be told from here")
        return (FAIL if severe else WARN), detail + why + f"; {whose}", fix
    partners = [next(n for n in p["nodes"] if n != node) for p, v in zip(mine, verdicts) if v]
    return WARN, detail + why + f"; this node's other pair is fine: look at {', '.join(partners)} first", fix


def _pair_figure(p: dict) -> bool:
    v = p.get("busbw_gbps")
    return not p.get("error") and isinstance(v, (int, float)) and math.isfinite(v) and v > 0


@check("ib", "InfiniBand ports are active when V4_EXPECT_IB=1")
def ib(node, ctx):
    devs = ctx.facts[node]["ib"]
    active = [f"{d['device']}/{p}" for d in devs for p, s in d["ports"].items() if "ACTIVE" in s["state"]]
    if not ctx.cfg.get("V4_EXPECT_IB", False):
        return SKIP, f"V4_EXPECT_IB=0 ({len(devs)} device(s) present)"
    if not active:
        return FAIL, f"no ACTIVE InfiniBand port ({len(devs)} device(s))", \
            "check `ibstat` and the HCA driver, or set V4_EXPECT_IB=0 (NCCL then uses TCP: slow)"
    return PASS, f"active: {', '.join(active)}"


# --- network, storage, time -------------------------------------------------------------------------

@check("socket_ifname", "the interface NCCL/Gloo will use exists, is up and carries the node's address")
def socket_ifname(node, ctx):
    net = ctx.facts[node]["net"]
    want = str(ctx.cfg.get("V4_SOCKET_IFNAME", "auto") or "auto")
    multi = len(ctx.order) > 1
    carrying = [n for n, i in net["ifaces"].items() if i["ipv4"] == node]
    if want == "auto":
        name = net["default_if"]
        if not name:
            return (FAIL if multi else WARN), "no default route: cannot pick an interface", \
                f"set V4_SOCKET_IFNAME (the interface holding {node}" + (f": {carrying[0]})" if carrying else ")")
        how = "default route"
    else:
        name, how = want, "V4_SOCKET_IFNAME"
    iface = net["ifaces"].get(name)
    if iface is None:
        return FAIL, f"{how} interface {name} does not exist (have: {', '.join(net['ifaces'])})", \
            "set V4_SOCKET_IFNAME to one of those"
    if iface["operstate"] not in ("up", "unknown"):
        return FAIL, f"{name} is {iface['operstate']}", f"bring {name} up or choose another V4_SOCKET_IFNAME"
    detail = f"{name} ({iface['ipv4'] or 'no IPv4'}, {how})"
    if multi and iface["ipv4"] != node:
        return WARN, detail + f" but the node is addressed as {node}" + (f" (on {carrying[0]})" if carrying else ""), \
            f"set V4_SOCKET_IFNAME={carrying[0]}" if carrying else "set V4_SOCKET_IFNAME to the cluster interface"
    return PASS, detail


def _disk(d: dict, what: str) -> tuple[str, str, str]:
    used = 1 - d["free_gb"] / d["total_gb"] if d["total_gb"] else 0
    text = f"{what} {d['path']}: {d['free_gb']:.0f} GB free of {d['total_gb']:.0f} ({used:.0%} used)"
    if not d["writable"]:
        return FAIL, f"{what} {d['path']}: {d['existing']} is not writable", f"fix permissions or change {what}"
    if d["free_gb"] < 2 or used > 0.98:
        return FAIL, text, f"free space under {d['existing']} or change {what}"
    if used > 0.95:
        return WARN, text, f"free space under {d['existing']}"
    return PASS, text, ""


def _checkpoint_room(cfg, d: dict, verdict: tuple[str, str, str], have_gb: float = 0.0,
                     trained: bool = False) -> tuple[str, str, str]:
    """The run's training checkpoints (under V4_OUT, on V4_WORK by default) must fit: a disk that fills
    on the second save loses the step's work after hours of training. A resumed run's checkpoints already
    on disk count as room (each stays in the peak count or is deleted to make way); a run whose training
    finished needs none."""
    need = cfg.derived.get("CKPT_PEAK_GB")
    if need is None or "train" not in cfg["PRESET_STEPS"] or verdict[0] == FAIL or not d["writable"]:
        return verdict
    if trained:
        return verdict[0], f"{verdict[1]}; this run's training is done: no checkpoints to save", verdict[2]
    need, n, each = need.value, cfg.derived["CKPT_PEAK_COUNT"].value, cfg.derived["CKPT_GB"].value
    gb = lambda x: f"{x:.1f} GB" if x >= 1 else f"{x:.2g} GB"
    text = f"{verdict[1]}; training checkpoints need ~{gb(need)} ({n} x {gb(each)} at once)"
    if have_gb > 0:
        text += f", {gb(have_gb)} of this run's already on disk"
    if d["free_gb"] + have_gb >= need:
        return verdict[0], text, verdict[2]
    keys = ", ".join(f"{k}={cfg.shown(k)}" for k in ("PRESET_NUM_STEPS", "PRESET_SAVE_INTERVAL", "PRESET_SAVE_RETAIN_INTERVAL"))
    fix = (f"free space under {d['existing']}, point V4_WORK at a larger disk, or save less often "
           f"({keys}; e.g. --set PRESET_SAVE_INTERVAL={cfg['PRESET_NUM_STEPS']} keeps one checkpoint)")
    return FAIL, text, fix


@check("disk", "free space on V4_WORK and the node-local directory; room for the run's checkpoints")
def disk(node, ctx):
    d = ctx.facts[node]["disk"]
    w, l = _disk(d["work"], "V4_WORK"), _disk(d["local"], "V4_LOCAL_DIR")
    w = _checkpoint_room(ctx.cfg, d["work"], w, ctx.run_ckpt_gb, ctx.run_trained)
    status = FAIL if FAIL in (w[0], l[0]) else WARN if WARN in (w[0], l[0]) else PASS
    fix = "; ".join(x[2] for x in (w, l) if x[0] != PASS)
    return status, f"{w[1]}; {l[1]}", fix


@check("ray_temp", "Ray's socket paths under V4_LOCAL_DIR fit the 107-byte AF_UNIX limit", needs_facts=False)
def ray_temp(node, ctx):
    from launcher.nodes import node_local_dir
    if ctx.errors.get(node, ("",))[0] == "ssh":
        return None
    n = len(node_local_dir(ctx.cfg, node)) + RAY_SOCKET_TAIL
    if n > AF_UNIX_MAX:
        return FAIL, f"Ray socket paths would be ~{n} bytes (> {AF_UNIX_MAX})", "choose a shorter V4_LOCAL_DIR (e.g. /tmp/v4)"
    return PASS, f"~{n} bytes"


@check("shared_work", "V4_WORK is one shared filesystem: a file the head writes is read on every node")
def shared_work(node, ctx):
    f, work = ctx.facts[node], ctx.cfg["V4_WORK"]
    if ctx.token_error:
        return FAIL, ctx.token_error, f"make V4_WORK ({work}) writable on the head"
    if f["token"] == ctx.token:
        return PASS, f"{work} shows the head's token"
    return FAIL, f"{work} on {node} does not show the file the head wrote ({f.get('token_error', 'different content')})", \
        f"mount the shared filesystem at {work} on {node} (the same path on every node)"


@check("clock", "clocks agree across nodes (Ray timeouts, logs, checkpoint times)")
def clock(node, ctx):
    if node not in ctx.clock or ctx.head not in ctx.clock:
        return SKIP, "head clock unknown"
    off, unc = ctx.clock[node]
    skew = off - ctx.clock[ctx.head][0]
    tol = unc + ctx.clock[ctx.head][1]
    detail = f"{skew:+.3f} s vs the head (± {tol:.3f})"
    if abs(skew) - tol > 10:
        return FAIL, detail, "sync clocks (chrony/ntpd) on every node"
    if abs(skew) - tol > 1:
        return WARN, detail, "sync clocks (chrony/ntpd)"
    return PASS, detail


@check("ports", "the head's Ray, dashboard and rendezvous ports, and a rollout node's SGLang port, are free (or held "
                "by what v4 started)")
def ports(node, ctx):
    if node != ctx.head and not ctx.facts[node]["ports"]:
        return SKIP, "no fixed ports on a worker"
    from launcher.config.ports import auto_keys, record_path
    from launcher.config.schema import PORT_KEYS
    keys = (("V4_ROLLOUT_PORT",) if _rollout_node(ctx, node) else ()) + PORT_KEYS   # the head's names win a tie
    names = {int(ctx.cfg.get(k, 0) or 0): k for k in keys}
    taken, ours = [], []
    for port, p in ctx.facts[node]["ports"].items():
        key = names.get(int(port), port)
        if p["free"]:
            continue
        if p["ours"]:
            ours.append(f"{key}={port}")
        else:
            who = ", ".join(f"{x['comm']} pid {x['pid']}" for x in p["pids"]) or "a process not visible here"
            taken.append(f"{key}={port} is taken by {who}")
    if taken:
        fix = "stop that process or choose another port in the cluster file"
        auto = [k for k in auto_keys(ctx.cfg) if any(t.startswith(f"{k}=") for t in taken)]
        if auto:
            # picked for this checkout when they were free: picking again is the fix, not a number in a file
            fix = (f"{', '.join(auto)} {'was' if len(auto) == 1 else 'were'} picked for this checkout and recorded in "
                   f"{record_path(ctx.cfg.values)}: `v4 cluster down`, delete that file, and run again (free ports "
                   "are picked); or stop that process")
        return FAIL, "; ".join(taken), fix
    free = [f"{names.get(int(p), p)}={p}" for p, x in ctx.facts[node]["ports"].items() if x["free"]]
    return PASS, "free: " + ", ".join(free) + (f"; held by what v4 started: {', '.join(ours)}" if ours else "")


@check("ulimit", "locked-memory limit (RDMA/NCCL need it unlimited)")
def ulimit(node, ctx):
    m = ctx.facts[node]["memlock"]
    if m == "unlimited":
        return PASS, "ulimit -l unlimited"
    if ctx.on_host(node):                   # container_run.sh.j2 starts it with --ulimit memlock=-1
        return PASS, f"host: ulimit -l {m // 1024} KiB; the container runs with --ulimit memlock=-1"
    detail = f"ulimit -l {m // 1024} KiB"
    fix = "raise memlock (limits.conf `* - memlock unlimited`, or docker run --ulimit memlock=-1)"
    if ctx.cfg.get("V4_EXPECT_IB", False):
        return FAIL, detail + " with InfiniBand expected", fix
    if is_cuda(ctx):
        return WARN, detail, fix
    return PASS, detail + " (enough on CPU)"


@check("inputs", "required inputs exist and carry their completion sentinels")
def inputs(node, ctx):
    if not ctx.inputs:
        return SKIP, "the pipeline declares no pre-existing inputs"
    paths = ctx.facts[node]["paths"]
    for i in ctx.inputs:
        if not paths.get(i.path, {}).get("exists"):
            return FAIL, f"{i.what}: {i.path} is missing", i.fix or f"create {i.path} first"
        if i.sentinel and not paths.get(f"{i.path}/{i.sentinel}", {}).get("exists"):
            return FAIL, f"{i.what}: {i.path} is incomplete (no {i.sentinel})", \
                i.fix or f"finish writing {i.path} (its sentinel {i.sentinel} is written last)"
    return PASS, f"{len(ctx.inputs)} input(s) complete"


@check("wandb", "V4_WANDB_PROJECT set, online: wandb is installed, has an API key and its server answers, on every "
                "node (the rank that logs the metrics, rank 0, may be placed on any)")
def wandb_ready(node, ctx):
    from launcher.preflight.gather import wandb_args
    cfg = ctx.cfg
    if not cfg.get("V4_WANDB_PROJECT"):
        return SKIP, "V4_WANDB_PROJECT is empty: metrics go to metrics.jsonl and TensorBoard"
    if cfg.get("V4_WANDB_MODE") == "offline":
        return SKIP, "V4_WANDB_MODE=offline: no key or server needed (the run stays under RUN/wandb for `wandb sync`)"
    if wandb_args(cfg) is None:
        return SKIP, "no train step in PRESET_STEPS: nothing logs to W&B"
    if ctx.on_host(node):
        return SKIP, _not_in_container(ctx, node)
    w = ctx.facts[node].get("wandb")
    if w is None:
        return SKIP, "not probed"
    if "version" not in w:
        return FAIL, w.get("error", "no answer from the probe"), "run `v4 preflight --only wandb` again"
    python = python_on_nodes(cfg)
    if not w["version"]:
        return FAIL, (f"V4_WANDB_PROJECT={cfg['V4_WANDB_PROJECT']} but wandb is not installed for {python}: the run "
                      "would log to metrics.jsonl and TensorBoard only"), \
            f"pip install 'v4-launcher[wandb]' into {python} on {node}, or empty V4_WANDB_PROJECT"
    base, timeout = w["base_url"], float(cfg.get("V4_WANDB_TIMEOUT") or 30)
    problems, fixes = [], []
    if not w["key_from"]:
        problems.append(f"no W&B API key for {base} (looked at {', '.join(w['looked'])})")
        fixes.append(f"export WANDB_API_KEY where the jobs run (Ray jobs inherit the environment `v4 cluster up` "
                     f"started Ray with, the local executor the launcher's), or run `wandb login --host {base}` there "
                     "as the user the jobs run as (it writes ~/.netrc)")
    if not w["answered"]:
        if "not an http(s) URL" in w["error"]:
            problems.append(w["error"] + f" ({w['base_from']})")
            fixes.append("set V4_WANDB_BASE_URL to the W&B server's http(s) address, e.g. https://api.wandb.ai")
        else:
            problems.append(f"the W&B server {base} ({w['base_from']}) did not answer within {timeout:g} s: "
                            f"{w['error']}")
            fixes.append("check the address (V4_WANDB_BASE_URL, or WANDB_BASE_URL on the node), the proxy "
                         f"(V4_HTTP_PROXY) and firewalls, or allow a slow link more (V4_WANDB_TIMEOUT={timeout:g})")
    if problems:
        fixes.append("or log offline (V4_WANDB_MODE=offline, `wandb sync RUN/wandb/offline-run-*` later), or empty "
                     "V4_WANDB_PROJECT")
        return FAIL, f"wandb {w['version']}: " + "; ".join(problems), "; ".join(fixes)
    return PASS, (f"wandb {w['version']}; key from {w['key_from']}; {base} answered in {w['seconds']:.2f} s "
                  f"(HTTP {w['status']})")
