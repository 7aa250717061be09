"""Onboarding a cluster by commands: `v4 cluster init` writes a cluster file with no template placeholder left,
`v4 config validate` refuses what bring-up would (placeholders, a name that is not its file's, a loopback head with
remote workers, container mode without an image), and `v4 bootstrap` walks the checklist and resumes."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.clusterinit import init, quote
from launcher.config import Selection, resolve
from launcher.config.checks import InvalidConfig
from launcher.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def root(tmp_path):
    """A copy of the layer files: init writes envs/cluster/NAME.env there, not into the checkout."""
    for d in ("envs", "hw", "presets"):
        shutil.copytree(ROOT / d, tmp_path / d)
    return tmp_path


GOOD = dict(V4_MASTER_IP="10.1.0.1", V4_WORKER_IPS="10.1.0.2 10.1.0.3", V4_WORK="/shared/v4",
            V4_SSH_KNOWN_HOSTS="/shared/v4/known_hosts", V4_DOCKER_MOUNTS="/shared:/shared")


def test_init_refuses_to_leave_a_placeholder_and_writes_nothing(root):
    with pytest.raises(ConfigError) as e:
        init("lab", "h200_template", {k: v for k, v in GOOD.items() if k != "V4_WORK"}, root=root)
    assert "V4_WORK is still h200_template.env's placeholder: pass --work" in e.value.message
    assert "V4_MODELS" not in e.value.message             # derived from V4_WORK: fixed with it, not named apart
    assert sorted(p.name for p in (root / "envs/cluster").iterdir()) == ["h200_template.env", "h20_8node.env", "local.env"]


def test_init_writes_a_file_that_validates(root):
    path, text = init("lab", "h200_template", GOOD, root=root)
    assert path == root / "envs/cluster/lab.env" and 'V4_CLUSTER_NAME="lab"' in text
    assert "V4_CLUSTER_TEMPLATE" not in text and 'V4_NUM_NODES="3"' in text
    assert "# the container image's interpreter" in text            # the template's comments stay
    cfg = resolve(Selection(cluster="lab", environ={}, root=root))
    assert cfg.nodes == ["10.1.0.1", "10.1.0.2", "10.1.0.3"] and cfg["V4_WORK"] == "/shared/v4"
    assert cfg.origin("V4_MASTER_IP").where.startswith("envs/cluster/lab.env:")
    with pytest.raises(ConfigError, match="exists"):
        init("lab", "h200_template", GOOD, root=root)
    init("lab", "h200_template", {**GOOD, "V4_NUM_GPUS_PER_NODE": "4"}, force=True, root=root)
    assert resolve(Selection(cluster="lab", environ={}, root=root))["V4_NUM_GPUS_PER_NODE"] == 4


def test_values_survive_quoting():
    for v in ('a b', 'x"y', "$HOME", "back`tick`", "c:\\d"):
        r = subprocess.run(["bash", "-c", f"V={quote(v)}; printf %s \"$V\""], capture_output=True, text=True)
        assert r.stdout == v


@pytest.mark.parametrize("text, match", [
    ('V4_CLUSTER_NAME=lab\nV4_TRANSPORT=ssh\nV4_MASTER_IP=192.0.2.1\n', r"V4_MASTER_IP=192.0.2.1 .* template placeholder"),
    ('V4_CLUSTER_NAME=lab\nV4_WORK=/your/shared/storage\n', r"V4_WORK=/your/shared/storage .* template placeholder"),
    ('V4_CLUSTER_NAME=other\n', r"V4_CLUSTER_NAME=other .* differs from its file's name 'lab'"),
    ('V4_CLUSTER_NAME=lab\nV4_TRANSPORT=ssh\nV4_MASTER_IP=127.0.0.1\nV4_WORKER_IPS="10.1.0.2"\nV4_NUM_NODES=2\n',
     r"V4_MASTER_IP=127.0.0.1 .* loopback address but the workers \(10.1.0.2"),
    ('V4_CLUSTER_NAME=lab\nV4_CONTAINER=c\n', r"V4_CONTAINER=c .* needs the image"),
], ids=["doc-address", "your-path", "name", "loopback-head", "container-no-image"])
def test_validate_refuses_what_bring_up_would(root, text, match):
    (root / "envs/cluster/lab.env").write_text(text)
    with pytest.raises(InvalidConfig, match=match):
        resolve(Selection(cluster="lab", hw="cpu", environ={}, root=root))


def test_a_template_says_so_and_passes():
    cfg = resolve(Selection(cluster="h200_template", hw="h200", environ={}))
    assert cfg["V4_CLUSTER_TEMPLATE"] and cfg["V4_MASTER_IP"] == "192.0.2.1"


def v4(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "launcher", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ))


def test_bootstrap_lists_its_steps(tmp_path):
    r = v4("bootstrap", "--hw", "cpu", "--set", f"V4_WORK={tmp_path}", "--json", "--dry-run")
    assert r.returncode == 0, r.stderr
    steps = json.loads(r.stdout)["steps"]
    assert [s["step"] for s in steps] == ["validate", "ssh", "preflight", "up", "probe", "nccl", "smoke", "dryrun_plan"]
    assert all(s["status"] == "pending" for s in steps)
    assert steps[0]["command"] == f"v4 config validate --cluster local --hw cpu --set V4_WORK={tmp_path}"
    assert not (tmp_path / ".v4-bootstrap").exists()                 # --dry-run records nothing


@pytest.mark.slow
def test_bootstrap_stops_at_a_failure_and_continues_there(tmp_path):
    """The local cluster up to the probe: preflight fails while the dashboard port is taken (exit 3), the
    second call starts at preflight (validate and ssh are not run again) and goes on through Ray and the probe."""
    flags = ("--hw", "cpu", "--set", f"V4_WORK={tmp_path}")
    cfg = resolve(Selection(hw="cpu", sets=(f"V4_WORK={tmp_path}",)))
    blocker = socket.socket()
    blocker.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    blocker.bind(("0.0.0.0", cfg["V4_DASHBOARD_PORT"]))
    blocker.listen()
    try:
        r = v4("bootstrap", *flags, "--until", "probe")
    finally:
        blocker.close()
    assert r.returncode == 3, r.stderr[-3000:]
    assert "bootstrap stopped at step 3/5 (preflight, exit 3)" in r.stderr and "(continues at preflight)" in r.stderr
    state = json.loads((tmp_path / ".v4-bootstrap/local.json").read_text())
    assert {k: s["status"] for k, s in state["steps"].items()} == {"validate": "passed", "ssh": "passed",
                                                                   "preflight": "failed"}
    try:
        r = v4("bootstrap", *flags, "--until", "probe")
        assert r.returncode == 0, r.stderr[-3000:]
        assert "[1/5] validate: passed" in r.stderr and "[3/5] preflight: software" in r.stderr
        assert "bootstrap of local passed up to probe" in r.stderr
        state = json.loads((tmp_path / ".v4-bootstrap/local.json").read_text())
        assert all(s["status"] == "passed" for s in state["steps"].values()) and len(state["steps"]) == 5
    finally:
        v4("cluster", "down", *flags)


def test_init_never_overwrites_its_own_template(root):
    """`cluster init NAME --from NAME --force` (by name, by path, or through a link) would replace the template
    it reads: refused, whatever --force says, and the template is left byte for byte."""
    template = root / "envs/cluster/h200_template.env"
    before = template.read_bytes()
    (root / "elsewhere.env").symlink_to(template)
    for src in ("h200_template", str(template), str(root / "elsewhere.env")):
        for force in (False, True):
            with pytest.raises(ConfigError, match="itself: writing it would replace the template") as e:
                init("h200_template", src, GOOD, force=force, root=root)
            assert "pick another NAME" in e.value.fix
    assert template.read_bytes() == before
    # another name from it, and then that file from itself, the same
    lab, _ = init("lab", "h200_template", GOOD, root=root)
    lab_text = lab.read_bytes()
    with pytest.raises(ConfigError, match="is envs/cluster/lab.env itself"):
        init("lab", str(lab), {**GOOD, "V4_NUM_GPUS_PER_NODE": "4"}, force=True, root=root)
    assert lab.read_bytes() == lab_text and template.read_bytes() == before
