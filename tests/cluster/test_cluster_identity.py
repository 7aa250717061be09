"""One cluster per checkout, and only its own: `v4 cluster up` finds out whose Ray answers on its ports before it
sends a token, submits a job or lets a worker join, and refuses any other (exit 5). Real Rays on this machine: one
started by the test itself with its own token (a stranger's), and two checkouts' local clusters side by side."""
from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from conftest import free_port, tagged_pids
from launcher import cluster, jobs
from launcher.config import Selection, resolve
from launcher.errors import ClusterError
from launcher.node_scripts import ray_procs

ROOT = Path(__file__).resolve().parents[2]


def local(local_dir: Path, *sets: str):
    """A checkout's local default: its own V4_LOCAL_DIR, so its own `auto` ports."""
    return resolve(Selection(cluster="local", hw="cpu", sets=(f"V4_LOCAL_DIR={local_dir}", "V4_RAY_NUM_CPUS=1",
                                                             f"V4_WORK={local_dir}/work", *sets)))


def v4(cfg, *args) -> subprocess.CompletedProcess:
    sets = [x for s in cfg.selection.sets for x in ("--set", s)]
    return subprocess.run([sys.executable, "-m", "launcher", *args, "--hw", "cpu", *sets], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture
def short_dir():
    # Ray's AF_UNIX socket paths live below V4_LOCAL_DIR: a pytest tmp_path is too long for them
    d = Path(f"/tmp/v4id-{secrets.token_hex(3)}")
    d.mkdir()
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def stranger(short_dir):
    """Another user's Ray head on free ports, with token auth and a token of its own (its processes tagged so that
    the test stops exactly them)."""
    d = short_dir / "stranger"
    (d / "auth").mkdir(parents=True, mode=0o700)
    token = secrets.token_urlsafe(32)
    (d / "auth/token").write_text(token)
    (d / "auth/token").chmod(0o600)
    session = f"test-stranger-{secrets.token_hex(4)}"
    (d / "ray.session").write_text(session)
    gcs, dash, client = free_port(), free_port(), free_port()
    env = dict(os.environ, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(d / "auth/token"), V4_RAY_SESSION=session,
               RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    r = subprocess.run(["setsid", "-w", sys.executable, "-m", "ray.scripts.scripts", "start", "--head",
                        f"--port={gcs}", "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}",
                        f"--ray-client-server-port={client}", "--node-ip-address=127.0.0.1", "--num-cpus=1",
                        "--num-gpus=0", f"--temp-dir={d}", "--dashboard-agent-listen-port=0",
                        "--disable-usage-stats"], env=env, capture_output=True, text=True, timeout=180,
                       stdin=subprocess.DEVNULL)
    ray_procs.record(str(d))
    try:
        assert r.returncode == 0, r.stderr[-3000:]
        yield {"gcs": gcs, "dashboard": dash, "token": token}
    finally:
        rep = ray_procs.stop(str(d))
        assert not rep["remaining"], rep


def listening_pids(port: int) -> set[int]:
    """The processes with a socket listening on TCP `port` (/proc/net/tcp and tcp6, then every process's fds)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f"socket:[{f[9]}]")
    pids = set()
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                if any(os.readlink(f"/proc/{d}/fd/{fd}") in inodes for fd in os.listdir(f"/proc/{d}/fd")):
                    pids.add(int(d))
            except OSError:
                pass
    return pids


def stranger_jobs(s) -> list:
    req = urllib.request.Request(f"http://127.0.0.1:{s['dashboard']}/api/jobs/",
                                 headers={"Authorization": f"Bearer {s['token']}"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.load(r)


def test_up_refuses_a_strangers_ray_on_the_port_of_its_cluster_file(stranger, short_dir):
    """The cluster file points at the port where another user's GCS listens: `up` says whose it is and stops (exit 5),
    before it writes a token, starts anything or joins it; `status` says the same."""
    cfg = local(short_dir / "ours", f"V4_RAY_PORT={stranger['gcs']}", f"V4_DASHBOARD_PORT={stranger['dashboard']}")
    with pytest.raises(ClusterError) as e:
        cluster.up(cfg, progress=lambda _: None)
    assert e.value.code == 5
    assert (f"the Ray GCS port 127.0.0.1:{stranger['gcs']} is held by gcs_server pid" in e.value.message
            and "not by the Ray this checkout started" in e.value.message)
    assert f"choose another V4_RAY_PORT than V4_RAY_PORT={stranger['gcs']} (cli --set V4_RAY_PORT)" in e.value.fix
    assert not Path(cluster.auth_token_path(cfg, "127.0.0.1")).exists()       # no token written, none sent
    assert not Path(cluster.ray_state_dir(cfg, "127.0.0.1"), "ray_procs.json").exists()   # nothing started
    r = v4(cfg, "cluster", "up")
    assert r.returncode == 5 and "is held by gcs_server pid" in r.stderr and "Traceback" not in r.stderr, r.stderr
    st = cluster.status(cfg)
    assert not st.healthy and st.foreign and st.jobs is None
    # nor does a command that only submits (the probe job) or reads jobs, without `up` before it
    with pytest.raises(ClusterError) as e:
        jobs.client(cfg)
    assert e.value.code == 5 and "is held by gcs_server pid" in e.value.message
    r = v4(cfg, "cluster", "probe")
    assert r.returncode == 5 and "is held by gcs_server pid" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert stranger_jobs(stranger) == []                                     # the stranger's Ray got nothing of ours


@pytest.mark.slow      # two Ray clusters brought up and down: ~30 s on an idle 2-core machine
def test_two_checkouts_run_their_own_clusters_side_by_side(short_dir):
    """Two checkouts (their own V4_LOCAL_DIR each) get ports of their own and bring their clusters up together; each
    refuses the other's Ray, and one whose recorded cluster id no longer matches the GCS is refused too."""
    a, b = local(short_dir / "a"), local(short_dir / "b")
    keys = ("V4_RAY_PORT", "V4_DASHBOARD_PORT", "V4_RAY_CLIENT_PORT")
    assert not {a[k] for k in keys} & {b[k] for k in keys}
    try:
        sa = cluster.up(a, progress=lambda _: None)
        sb = cluster.up(b, progress=lambda _: None)
        assert sa.healthy and sb.healthy, (sa.problems, sb.problems)
        sa, sb = cluster.status(a), cluster.status(b)
        assert sa.healthy and sb.healthy and sa.cluster_id and sb.cluster_id and sa.cluster_id != sb.cluster_id
        # every fixed port of each is its own Ray's: the client server too (Ray's default 10001 was one for both)
        for cfg in (a, b):
            session = json.loads(Path(cluster.ray_state_dir(cfg, "127.0.0.1"), "ray_procs.json").read_text())["session"]
            ours = set(tagged_pids(f"V4_RAY_SESSION={session}"))
            for k in keys:
                assert listening_pids(cfg[k]) & ours, f"{k}={cfg[k]}: not held by this checkout's Ray"
        # checkout b with its cluster file pointing at a's ports: a's Ray, not b's
        b_on_a = local(short_dir / "b", f"V4_RAY_PORT={a['V4_RAY_PORT']}", f"V4_DASHBOARD_PORT={a['V4_DASHBOARD_PORT']}")
        with pytest.raises(ClusterError, match=f"the Ray GCS port 127.0.0.1:{a['V4_RAY_PORT']} is held by gcs_server"):
            cluster.up(b_on_a, progress=lambda _: None)
        # a cluster id other than the one a's `up` recorded: refused though its processes are a's
        ident = Path(cluster.ray_state_dir(a, "127.0.0.1"), "identity.json")
        good = ident.read_text()
        assert json.loads(good)["cluster_id"] == sa.cluster_id
        ident.write_text(json.dumps({"cluster_id": sb.cluster_id}))
        try:
            st = cluster.status(a)
            assert not st.healthy and st.foreign_cluster_id and "this checkout recorded" in st.foreign
            with pytest.raises(ClusterError) as e:
                cluster.up(a, progress=lambda _: None)
            assert "`v4 cluster down`, then `v4 cluster up`" in e.value.fix
        finally:
            ident.write_text(good)
        assert cluster.status(a).healthy
        assert [r["ok"] for r in cluster.down(a, progress=lambda _: None)] == [True]
        assert cluster.status(b).healthy                            # a's `down` left b's cluster alone
        assert not ident.exists()                                   # a stopped head's id is no one's
    finally:
        for cfg in (a, b):
            cluster.down(cfg, progress=lambda _: None)
