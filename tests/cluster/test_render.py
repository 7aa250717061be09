"""The rendered per-node commands: valid bash, the flags that matter, container mode run against a
stand-in `docker` (no Docker engine here) that answers `inspect` from a state file and logs calls."""
from __future__ import annotations

import os
import subprocess

import pytest

from launcher import cluster
from launcher.config import Selection, resolve
from launcher.nodes import LocalNode

FAKE_DOCKER = r"""#!/bin/bash
# stand-in docker: state in $FAKE_DOCKER_STATE (lines: label=..., running=..., image=...; absent = no container)
echo "docker $*" >> "$FAKE_DOCKER_LOG"
get() { grep "^$1=" "$FAKE_DOCKER_STATE" | cut -d= -f2-; }
case "$1" in
  inspect)
    [ -f "$FAKE_DOCKER_STATE" ] || exit 1
    case "$*" in
      *Labels*) get label ;;
      *State.Running*) get running ;;
      *Config.Image*) get image ;;
      *) echo "[]" ;;
    esac ;;
  rm) rm -f "$FAKE_DOCKER_STATE" ;;
  run) echo "run ok" ;;
  exec) shift; [ "$1" = -i ] && shift; shift; exec "$@" ;;      # exec -i NAME CMD...: run CMD here
esac
"""


@pytest.fixture
def docker(tmp_path, monkeypatch):
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "docker").write_text(FAKE_DOCKER)
    (bin_ / "docker").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_DOCKER_LOG", str(tmp_path / "docker.log"))
    monkeypatch.setenv("FAKE_DOCKER_STATE", str(tmp_path / "state"))
    return tmp_path


def _bash_ok(script: str) -> None:
    r = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr + script[:2000]


@pytest.fixture(scope="module")
def container_cfg():
    return resolve(Selection(cluster="h200_template", hw="h200"))


def test_every_rendered_script_is_valid_bash(container_cfg):
    local = resolve(Selection(cluster="local", hw="cpu"))
    for cfg in (local, container_cfg):
        for nc in cluster.cluster_commands(cfg, force=True):
            for script in (nc.container, nc.start, nc.stop, nc.container_rm):
                if script:
                    _bash_ok(script)


def test_head_and_worker_flags(container_cfg):
    cfg = container_cfg
    head, w = cluster.cluster_commands(cfg)[:2]
    ip0, ip1 = cfg.nodes[:2]
    assert head.role == "head" and w.role == "worker"
    assert f"--head --port={cfg['V4_RAY_PORT']} --include-dashboard=true --dashboard-host={ip0}" in head.start
    assert f"--address={ip0}:{cfg['V4_RAY_PORT']}" in w.start and "--head" not in w.start
    assert f"--node-ip-address={ip1}" in w.start
    assert f"--num-gpus={cfg['V4_NUM_GPUS_PER_NODE']}" in w.start         # cuda: GPUs advertised
    assert "ray stop" not in head.start + w.start + head.stop              # never without --force
    assert "ray.scripts.scripts stop --force" in cluster.cluster_commands(cfg, force=True)[0].stop
    assert "python3 -m ray.scripts.scripts start" in head.start and "export PATH" not in head.start
    assert w.local_dir == cfg["V4_LOCAL_DIR"].replace("{node_ip}", ip1)
    assert w.state_dir == f"{w.local_dir}/ray{cfg['V4_RAY_PORT']}" and '--temp-dir="$STATE"' in w.start
    # the plan shows the commands without the embedded node script
    shown = "\n".join(head.display())
    assert "<launcher/node_scripts/ray_procs.py>" in shown and "def marked" not in shown


def test_cpu_advertises_no_gpus():
    cfg = resolve(Selection(cluster="local", hw="cpu", sets=("V4_NUM_GPUS_PER_NODE=4",)))
    assert "--num-gpus=0" in cluster.cluster_commands(cfg)[0].start


def test_container_run_command(container_cfg):
    nc = cluster.cluster_commands(container_cfg)[1]
    c = nc.container
    work = container_cfg["V4_WORK"]
    assert "docker run -d --name \"$NAME\" --label v4.launcher=" in c
    for flag in ("--network host", "--ipc host", "--gpus all", "--shm-size=", "--ulimit memlock=-1",
                 "-v /your/shared/storage:/your/shared/storage", "-v /dev/infiniband:/dev/infiniband",
                 f"-w {work}", 'sleep infinity'):
        assert flag in c, flag
    assert cluster.same_path_mounted(nc.local_dir, container_cfg["V4_DOCKER_MOUNTS"])   # /local_nvme covers it
    assert f"-v {nc.local_dir}:" not in c
    cfg = resolve(Selection(cluster="h200_template", hw="h200", sets=("V4_DOCKER_MOUNTS=/a:/b",)))
    c = cluster.cluster_commands(cfg)[0].container
    assert f"-v {cfg['V4_WORK']}:{cfg['V4_WORK']}" in c and "-v /a:/b" in c


def _run_container_script(cfg, docker, state: str | None):
    st = docker / "state"
    if state is None:
        st.unlink(missing_ok=True)
    else:
        st.write_text(state)
    (docker / "docker.log").write_text("")
    r = LocalNode().run(cluster.cluster_commands(cfg)[0].container)
    return r, (docker / "docker.log").read_text()


def test_container_reuse_replace_refuse(container_cfg, docker):
    cfg = container_cfg
    name, image, owner = cfg["V4_CONTAINER"], cfg["V4_IMAGE"], cfg["V4_CLUSTER_NAME"]
    r, log = _run_container_script(cfg, docker, None)                     # none yet: created
    assert r.ok and "docker run -d --name" in log
    r, log = _run_container_script(cfg, docker, f"label={owner}\nrunning=true\nimage={image}\n")
    assert r.ok and "docker run" not in log and "docker rm" not in log    # ours, current: reused
    r, log = _run_container_script(cfg, docker, f"label={owner}\nrunning=true\nimage=old:1\n")
    assert r.ok and f"docker rm -f {name}" in log and "docker run -d" in log   # ours, stale: replaced
    r, log = _run_container_script(cfg, docker, "label=\nrunning=true\nimage=x\n")
    assert r.rc == 1 and "not created by v4" in r.stderr and "docker rm" not in log   # not ours: refused


def test_node_container_wrapping(docker):
    node = LocalNode(container="v4c")
    r = node.run('echo "in:$X"', env={"X": "a b"})
    assert r.ok and r.stdout == "in:a b\n"
    assert (docker / "docker.log").read_text().startswith("docker exec -i v4c bash -c ")
    (docker / "docker.log").write_text("")
    assert node.host().run("echo host").stdout == "host\n"
    assert (docker / "docker.log").read_text() == ""


def test_container_without_image_is_refused():
    from launcher.errors import ClusterError
    cfg = resolve(Selection(cluster="local", hw="cpu", sets=("V4_CONTAINER=c1", "V4_IMAGE=")))
    with pytest.raises(ClusterError, match="V4_IMAGE is empty"):
        cluster.cluster_commands(cfg)
