"""What Ray's GCS says about the cluster: nodes (address, state, resources), and the Jobs API; and whether that Ray
is the one this checkout started.

Usage: python - GCS_HOST:PORT DASHBOARD_URL STATE_DIR [record]  (script on stdin; prints JSON). Runs on the head.

Identity, before any token leaves this process: the socket listening on the GCS port (and on the dashboard's) must
belong to a process of our Ray, one carrying the V4_RAY_SESSION tag of STATE_DIR/ray.session or started below one
(raylet's agents do not always show the tag). A port held by anything else is `foreign`: another user's Ray on a
port our cluster file names is never sent our token, never given our jobs, never joined by our workers. Then the GCS
must accept our token (Ray's token auth) and report the cluster id recorded in STATE_DIR/identity.json when `up`
started this head (`record` writes it). The token alone would not do: a Ray started without token auth accepts any.
"""
import json
import os
import pwd
import socket
import sys
import urllib.parse
import urllib.request

gcs, dashboard, state = sys.argv[1], sys.argv[2], sys.argv[3]
record = sys.argv[4:5] == ["record"]
out = {"gcs": gcs, "gcs_ok": False, "error": "", "nodes": [], "dashboard_ok": False, "jobs": None,
       "foreign": "", "foreign_port": 0, "foreign_cluster_id": False, "cluster_id": "", "recorded_cluster_id": ""}
host, port = gcs.rsplit(":", 1)
dash_port = int(dashboard.rsplit(":", 1)[1].split("/")[0])


def read(path):
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def listeners(port):
    """(uid, inode) of every socket listening on TCP `port`, any address (/proc/net/tcp, tcp6)."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in read(table).splitlines()[1:]:
            f = line.split()
            if len(f) > 9 and f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:
                found.append((int(f[7]), f[9]))
    return found


def socket_pids(inodes):
    """PIDs holding one of these socket inodes (only processes whose fds we may read: our own user's)."""
    want, pids = {f"socket:[{i}]" for i in inodes}, []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            fds = os.listdir(f"/proc/{d}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{d}/fd/{fd}") in want:
                    pids.append(int(d))
                    break
            except OSError:
                pass
    return pids


def tagged(pid, tag):
    """`pid` or one of its ancestors carries our V4_RAY_SESSION tag."""
    while pid > 1:
        try:
            if tag in open(f"/proc/{pid}/environ", "rb").read().split(b"\0"):
                return True
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return False
    return False


def holder(port, session):
    """Who listens on `port`: {"ours": bool, "who": "gcs_server pid 12 (user bob)" or "a process of user bob"}."""
    socks = listeners(port)
    if not socks:
        return {"ours": False, "who": "nothing listening on this node (a forwarded port, or another host)"}
    pids = socket_pids([inode for _, inode in socks])
    tag = f"V4_RAY_SESSION={session}".encode()
    if session and pids and all(tagged(p, tag) for p in pids):
        return {"ours": True, "who": ""}
    users = []
    for uid in sorted({u for u, _ in socks}):
        try:
            users.append(f"{pwd.getpwuid(uid).pw_name} (uid {uid})")
        except KeyError:
            users.append(f"uid {uid}")
    names = [f"{read(f'/proc/{p}/comm') or '?'} pid {p}" for p in pids]
    return {"ours": False, "who": (", ".join(names) + " " if names else "a process ") + "of user " + ", ".join(users)}


def session_name(client):
    value = client.internal_kv_get(b"session_name", b"session", timeout=10)
    return value.decode() if value else ""


session = read(os.path.join(state, "ray.session"))
identity_file = os.path.join(state, "identity.json")
try:
    recorded = json.loads(read(identity_file) or "{}")
except ValueError:
    recorded = {}
out["recorded_cluster_id"] = recorded.get("cluster_id", "") if isinstance(recorded, dict) else ""
try:
    socket.create_connection((host, int(port)), timeout=3).close()
except OSError as e:
    out["error"] = f"nothing answers on {gcs}: {e}"
else:
    who = holder(int(port), session)
    if not who["ours"]:
        out["foreign"] = f"the Ray GCS port {gcs} is held by {who['who']}, not by the Ray this checkout started"
        out["foreign_port"] = int(port)
        out["error"] = "not ours: not asked (our token is not sent to it)"
    else:
        os.environ.setdefault("RAY_gcs_rpc_server_reconnect_timeout_s", "5")
        try:
            from ray._raylet import GcsClient   # the GCS itself: no driver, no job registered
            client = GcsClient(address=gcs)
            out["cluster_id"] = client.cluster_id.hex()
            if out["recorded_cluster_id"] and out["cluster_id"] != out["recorded_cluster_id"]:
                out["foreign"] = (f"the Ray GCS at {gcs} has cluster id {out['cluster_id'][:16]}..., this checkout "
                                  f"recorded {out['recorded_cluster_id'][:16]}... ({identity_file}) when it started "
                                  "its head")
                out["foreign_port"], out["foreign_cluster_id"] = int(port), True
            else:
                for info in client.get_all_node_info(timeout=10).values():
                    out["nodes"].append({
                        "node_id": info.node_id.hex(), "ip": info.node_manager_address,
                        "hostname": info.node_manager_hostname, "is_head": bool(info.is_head_node),
                        "state": "ALIVE" if info.state == 0 else "DEAD",
                        "resources": {k: v for k, v in info.resources_total.items()
                                      if k in ("CPU", "GPU", "memory", "object_store_memory")}})
                out["gcs_ok"] = True
                if record:
                    tmp = identity_file + ".tmp"
                    with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
                        json.dump({"cluster_id": out["cluster_id"], "session_name": session_name(client),
                                   "gcs": gcs, "ray_session": session}, f)
                    os.replace(tmp, identity_file)
                    out["recorded_cluster_id"] = out["cluster_id"]
        except Exception as e:  # noqa: BLE001 - reported to the launcher
            out["error"] = f"{type(e).__name__}: {e}"
if out["gcs_ok"]:
    # the dashboard too must be ours before it sees the token: a port of ours left free when our dashboard died
    # may have been taken by another
    try:
        socket.create_connection((urllib.parse.urlsplit(dashboard).hostname, dash_port), timeout=3).close()
        who = holder(dash_port, session)
    except OSError as e:        # not listening yet (a head starting its dashboard after its GCS): nothing to judge
        who = {"ours": None}
        out["dashboard_error"] = f"nothing answers on {dashboard}: {e}"
    if who["ours"] is None:
        pass
    elif not who["ours"]:
        out["foreign"] = f"the dashboard port {dashboard} is held by {who['who']}, not by the Ray this checkout started"
        out["foreign_port"] = dash_port
        out["dashboard_error"] = "not ours: not asked"
    else:
        headers = {}
        if os.environ.get("RAY_AUTH_MODE") == "token":   # the GCS client above reads the same file by itself
            try:
                headers["Authorization"] = "Bearer " + open(os.environ["RAY_AUTH_TOKEN_PATH"]).read().strip()
            except (KeyError, OSError) as e:
                out["dashboard_error"] = f"no auth token: {e}"
        try:
            req = urllib.request.Request(dashboard + "/api/version", headers=headers)
            with urllib.request.urlopen(req, timeout=3) as r:
                out["dashboard_ok"] = r.status == 200
            with urllib.request.urlopen(urllib.request.Request(dashboard + "/api/jobs/", headers=headers),
                                        timeout=5) as r:
                out["jobs"] = [{k: j.get(k) for k in ("submission_id", "job_id", "status", "entrypoint",
                                                      "start_time", "end_time", "message")} for j in json.load(r)]
        except Exception as e:  # noqa: BLE001
            out["dashboard_error"] = f"{type(e).__name__}: {e}"
print(json.dumps(out))
