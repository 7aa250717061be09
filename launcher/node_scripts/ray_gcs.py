"""What Ray's GCS says about the cluster: nodes (address, state, resources), and the Jobs API.

Usage: python - GCS_HOST:PORT DASHBOARD_URL  (script on stdin; prints JSON). Runs on the head.
"""
import json
import os
import socket
import sys
import urllib.request

gcs, dashboard = sys.argv[1], sys.argv[2]
out = {"gcs": gcs, "gcs_ok": False, "error": "", "nodes": [], "dashboard_ok": False, "jobs": None}
host, port = gcs.rsplit(":", 1)
try:
    socket.create_connection((host, int(port)), timeout=3).close()
except OSError as e:
    out["error"] = f"nothing answers on {gcs}: {e}"
else:
    os.environ.setdefault("RAY_gcs_rpc_server_reconnect_timeout_s", "5")
    try:
        from ray._raylet import GcsClient   # the GCS itself: no driver, no job registered
        for info in GcsClient(address=gcs).get_all_node_info(timeout=10).values():
            out["nodes"].append({
                "node_id": info.node_id.hex(), "ip": info.node_manager_address,
                "hostname": info.node_manager_hostname, "is_head": bool(info.is_head_node),
                "state": "ALIVE" if info.state == 0 else "DEAD",
                "resources": {k: v for k, v in info.resources_total.items()
                              if k in ("CPU", "GPU", "memory", "object_store_memory")}})
        out["gcs_ok"] = True
    except Exception as e:  # noqa: BLE001 - reported to the launcher
        out["error"] = f"{type(e).__name__}: {e}"
headers = {}
if os.environ.get("RAY_AUTH_MODE") == "token":   # the GCS client above reads the same file by itself
    try:
        headers["Authorization"] = "Bearer " + open(os.environ["RAY_AUTH_TOKEN_PATH"]).read().strip()
    except (KeyError, OSError) as e:
        out["dashboard_error"] = f"no auth token: {e}"
try:
    with urllib.request.urlopen(urllib.request.Request(dashboard + "/api/version", headers=headers), timeout=3) as r:
        out["dashboard_ok"] = r.status == 200
    with urllib.request.urlopen(urllib.request.Request(dashboard + "/api/jobs/", headers=headers), timeout=5) as r:
        out["jobs"] = [{k: j.get(k) for k in ("submission_id", "job_id", "status", "entrypoint",
                                              "start_time", "end_time", "message")} for j in json.load(r)]
except Exception as e:  # noqa: BLE001
    out["dashboard_error"] = f"{type(e).__name__}: {e}"
print(json.dumps(out))
