"""The rendered per-node commands: valid bash, the flags that matter, container mode run against a
stand-in `docker` (no Docker engine here) that answers `inspect` from a state file and logs calls."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

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
    """At validate now (before any command is rendered): container mode needs its image."""
    from launcher.config.checks import InvalidConfig
    with pytest.raises(InvalidConfig, match=r"V4_CONTAINER=c1 .*container mode.* V4_IMAGE= .* is empty"):
        resolve(Selection(cluster="local", hw="cpu", sets=("V4_CONTAINER=c1", "V4_IMAGE=")))


# --- hostile values: pasted into scripts, they stay data -------------------------------------------------

# Stand-in commands for running the rendered scripts here, end to end, without Docker or Ray: each logs its
# arguments one per line (so a value that arrives as one word shows as one line) and succeeds.
STUB = """#!/bin/bash
printf '%s\\n' "${0##*/}" "$@" "--" >> "$STUB_LOG"
case "${0##*/}" in
  python3) echo '{"gcs_ok": false, "error": "stub", "nodes": []}' ;;
  docker) [ "$1" = inspect ] || exit 0
          [ -n "$DOCKER_EXISTS" ] || exit 1                 # no container of that name yet: created
          echo someone-else ;;                              # one exists, not ours: refused
esac
exit 0
"""
REAL = ("bash", "mkdir", "cat", "date", "awk", "tail", "touch", "rm")   # `touch`: what an injection would run


def _hostile(marker_dir) -> dict[str, str]:
    """Values that would run `touch` if pasted into bash unquoted (or, with a newline, into a comment)."""
    m = lambda i: f"{marker_dir}/pwn{i}"
    return {"V4_CLUSTER_NAME": f"x$(touch {m(1)})`touch {m(2)}`\";touch {m(3)};\"'x\ntouch {m(4)}",
            "V4_MASTER_IP": f"10.0.0.1$(touch {m(5)})",
            "worker": f"10.0.0.2;touch {m(6)}"}


def _stub_path(tmp_path) -> str:
    import shutil
    d = tmp_path / "stubs"
    d.mkdir()
    for name in ("docker", "python3", "setsid"):
        (d / name).write_text(STUB)
        (d / name).chmod(0o755)
    for name in REAL:
        (d / name).symlink_to(shutil.which(name))
    return str(d)


def test_hostile_cluster_name_and_addresses_are_inert_in_every_script(tmp_path, monkeypatch):
    """A cluster name like `x$(touch ...)` (or an address with `;`) reaches bash only as data: every rendered script
    (container run/rm, Ray start on head and worker, stop) and the GCS probe command run end to end against
    stand-in docker/python3/setsid, and no marker file appears; the values arrive as single arguments."""
    marks = tmp_path / "marks"
    marks.mkdir()
    bad = _hostile(marks)
    cfg = resolve(Selection(cluster="h200_template", hw="h200"))
    # set after resolving: the config layer may refuse such values, the templates must not depend on it
    cfg.values.update(V4_CLUSTER_NAME=bad["V4_CLUSTER_NAME"], V4_MASTER_IP=bad["V4_MASTER_IP"],
                      V4_WORKER_IPS=[bad["worker"]], V4_LOCAL_DIR=str(tmp_path / "local"), V4_PYTHON="python3",
                      V4_WORK=str(tmp_path / "work"))
    log = tmp_path / "stub.log"
    env = {"PATH": _stub_path(tmp_path), "STUB_LOG": str(log), "HOME": str(tmp_path)}
    scripts = []
    for nc in cluster.cluster_commands(cfg, force=True):
        Path(cluster.auth_token_path(cfg, nc.ip)).parent.mkdir(parents=True, exist_ok=True)
        Path(cluster.auth_token_path(cfg, nc.ip)).write_text("tok")     # so the start script reaches `ray start`
        scripts += [(nc.ip, what, s) for what, s in
                    (("container", nc.container), ("start", nc.start), ("stop", nc.stop), ("rm", nc.container_rm))]
    for ip, what, script in scripts:
        _bash_ok(script)
        for exists in ("", "1"):
            subprocess.run(["/bin/bash", "-c", script], env=dict(env, DOCKER_EXISTS=exists), capture_output=True,
                           text=True, timeout=60)
    monkeypatch.setenv("PATH", env["PATH"])
    monkeypatch.setenv("STUB_LOG", str(log))
    cluster._probe_gcs(cfg, LocalNode(name=bad["V4_MASTER_IP"]))
    assert sorted(p.name for p in marks.iterdir()) == [], "a value pasted into a script ran as a command"
    args = log.read_text().split("\n")
    # each value arrived whole: one argument, byte for byte
    assert f"--node-ip-address={bad['worker']}" in args and f"--dashboard-host={bad['V4_MASTER_IP']}" in args
    assert f"--address={bad['V4_MASTER_IP']}:{cfg['V4_RAY_PORT']}" in args
    assert f"v4.launcher={bad['V4_CLUSTER_NAME']}" in log.read_text()
    assert f"{bad['V4_MASTER_IP']}:{cfg['V4_RAY_PORT']}" in args                          # the probe's GCS address
    assert f"http://{bad['V4_MASTER_IP']}:{cfg['V4_DASHBOARD_PORT']}" in args
