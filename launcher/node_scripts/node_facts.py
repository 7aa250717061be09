"""Everything preflight needs to know about one node, gathered in one go (stdlib only).

Usage: python - 'JSON_ARGS' (script on stdin; prints one JSON object). JSON_ARGS holds: work,
local, ray_state (our Ray's record), rollout_state (our SGLang server's record, optional), token_file, ports,
packages, paths (required inputs to stat).
"""
import fcntl
import json
import os
import platform
import resource
import shutil
import socket
import struct
import subprocess
import sys
import time

T_START = time.time()
args = json.loads(sys.argv[1])
facts = {"time": T_START, "hostname": socket.gethostname(), "python": platform.python_version(),
         "python_executable": sys.executable}


def run(argv, timeout=20):
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
        return r.returncode, r.stdout, r.stderr
    except (OSError, subprocess.TimeoutExpired) as e:
        return 127, "", str(e)


# --- packages: versions from metadata, never imported (torch alone takes seconds) ------------
def version(dist):
    from importlib import metadata
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


facts["packages"] = {p: version(p) for p in args["packages"]}
# Apart from the packages every node must agree on: only the rollout nodes need SGLang (preflight `sglang`).
facts["sglang"] = version("sglang")

# --- GPUs -------------------------------------------------------------------------------------
gpu = {"nvidia_smi": bool(shutil.which("nvidia-smi")), "gpus": [], "apps": [], "cuda": None,
       "driver": None, "nvlink_active": None, "error": ""}
if gpu["nvidia_smi"]:
    rc, out, err = run(["nvidia-smi", "--query-gpu=index,name,memory.total,memory.used,driver_version,uuid",
                        "--format=csv,noheader,nounits"])
    if rc != 0:
        gpu["error"] = (err or out).strip()[-500:]
    for line in out.strip().splitlines() if rc == 0 else []:
        idx, name, total, used, driver, uuid = [x.strip() for x in line.split(",")]
        gpu["gpus"].append({"index": int(idx), "name": name, "memory_total_mib": float(total),
                            "memory_used_mib": float(used), "uuid": uuid})
        gpu["driver"] = driver
    rc, out, _ = run(["nvidia-smi", "--query-compute-apps=pid,used_memory,gpu_uuid", "--format=csv,noheader,nounits"])
    for line in out.strip().splitlines() if rc == 0 else []:
        parts = [x.strip() for x in line.split(",")]
        if len(parts) == 3 and parts[0].isdigit():
            pid = int(parts[0])
            try:
                env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
                tag = next((e.decode().split("=", 1)[1] for e in env if e.startswith(b"V4_RAY_SESSION=")), "")
            except OSError:
                tag = None               # another container's or user's process: not ours to read
            gpu["apps"].append({"pid": pid, "used_mib": float(parts[1] or 0), "gpu_uuid": parts[2], "v4_session": tag})
    rc, out, _ = run(["nvidia-smi"])
    if rc == 0 and "CUDA Version:" in out:
        gpu["cuda"] = out.split("CUDA Version:")[1].split()[0]
    rc, out, _ = run(["nvidia-smi", "nvlink", "--status"])
    if rc == 0:
        gpu["nvlink_active"] = sum(1 for line in out.splitlines() if "GB/s" in line and "inactive" not in line.lower())
facts["gpu"] = gpu

# --- InfiniBand ---------------------------------------------------------------------------------
ib = []
base = "/sys/class/infiniband"
for dev in sorted(os.listdir(base)) if os.path.isdir(base) else []:
    ports = {}
    for port in sorted(os.listdir(f"{base}/{dev}/ports")):
        try:
            state = open(f"{base}/{dev}/ports/{port}/state").read().strip()          # "4: ACTIVE"
            layer = open(f"{base}/{dev}/ports/{port}/link_layer").read().strip()
        except OSError:
            state, layer = "?", "?"
        ports[port] = {"state": state, "link_layer": layer}
    ib.append({"device": dev, "ports": ports})
facts["ib"] = ib


# --- network: the default-route interface and every interface's IPv4 address ------------------
def ipv4(ifname):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", ifname[:15].encode()))   # SIOCGIFADDR
        return socket.inet_ntoa(packed[20:24])
    except OSError:
        return None
    finally:
        s.close()


default_if = None
try:
    for line in open("/proc/net/route").read().splitlines()[1:]:
        f = line.split()
        if f[1] == "00000000":     # destination 0.0.0.0: the same rule as the Ray start script and jobs.common
            default_if = f[0]
            break
except OSError:
    pass
ifaces = {}
for name in sorted(os.listdir("/sys/class/net")) if os.path.isdir("/sys/class/net") else []:
    try:
        oper = open(f"/sys/class/net/{name}/operstate").read().strip()
    except OSError:
        oper = "?"
    ifaces[name] = {"operstate": oper, "ipv4": ipv4(name)}
facts["net"] = {"default_if": default_if, "ifaces": ifaces}


# --- disks --------------------------------------------------------------------------------------
def disk(path):
    p = path
    while p and not os.path.exists(p):
        p = os.path.dirname(p.rstrip("/")) or "/"
    st = os.statvfs(p)
    return {"path": path, "existing": p, "free_gb": st.f_bavail * st.f_frsize / 1e9,
            "total_gb": st.f_blocks * st.f_frsize / 1e9, "writable": os.access(p, os.W_OK),
            "device": os.stat(p).st_dev, "root_device": os.stat("/").st_dev}


facts["disk"] = {"work": disk(args["work"]), "local": disk(args["local"])}

# --- the shared-directory token the head wrote --------------------------------------------------
try:
    facts["token"] = open(args["token_file"]).read().strip()
except OSError as e:
    facts["token"] = None
    facts["token_error"] = f"{type(e).__name__}: {e.strerror or e}"


# --- ports: free, or held by our own Ray ------------------------------------------------------
def listeners(port):
    """Inodes of sockets listening on `port` (tcp and tcp6 of this network namespace)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:       # 0A = LISTEN
                inodes.add(f[9])
    return inodes


def holders(inodes):
    pids = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                for fd in os.listdir(f"/proc/{d}/fd"):
                    link = os.readlink(f"/proc/{d}/fd/{fd}")
                    if link.startswith("socket:[") and link[8:-1] in inodes:
                        pids.append(int(d))
                        break
            except OSError:
                continue
    return pids


try:
    our_session = json.load(open(os.path.join(args["ray_state"], "ray_procs.json")))["session"]
except (OSError, ValueError, KeyError):
    our_session = None
# A port held by the SGLang server v4 started (a resumed run's) is ours too: node_scripts/rollout_procs.py
try:
    rollout_session = json.load(open(os.path.join(args.get("rollout_state") or "/nonexistent",
                                                  "sglang_procs.json")))["session"]
except (OSError, ValueError, KeyError):
    rollout_session = None
ours_tags = [t for t in (our_session and f"V4_RAY_SESSION={our_session}",
                         rollout_session and f"V4_ROLLOUT_SESSION={rollout_session}") if t]
ports = {}
for port in args["ports"]:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)    # TIME_WAIT leftovers do not count
    try:
        s.bind(("0.0.0.0", port))
        ports[str(port)] = {"free": True}
    except OSError as e:
        info = {"free": False, "error": e.strerror, "pids": [], "ours": False}
        for pid in holders(listeners(port)):
            try:
                env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
                comm = open(f"/proc/{pid}/comm").read().strip()
            except OSError:
                env, comm = [], "?"
            ours = any(t.encode() in env for t in ours_tags)
            info["pids"].append({"pid": pid, "comm": comm, "ours": ours})
        info["ours"] = bool(info["pids"]) and all(p["ours"] for p in info["pids"])
        ports[str(port)] = info
    finally:
        s.close()
facts["ports"] = ports
facts["our_session"] = our_session

# --- limits and required inputs ---------------------------------------------------------------
soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
facts["memlock"] = "unlimited" if soft == resource.RLIM_INFINITY else soft
facts["paths"] = {p: {"exists": os.path.exists(p), "is_dir": os.path.isdir(p)} for p in args["paths"]}
facts["elapsed"] = time.time() - T_START
print(json.dumps(facts))
