"""LocalNode and SSHNode against real processes and a real sshd in a network namespace."""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from launcher.nodes import HostKeyError, LocalNode, SSHKeyError, SSHNode, fan_out, in_container

# A stand-in `docker` (this machine has the docker client but no engine): `exec` runs the command the way dockerd
# does, outside the client's process group and session (setsid --fork), so killing the client leaves it running.
FAKE_DOCKER_EXEC = """#!/bin/bash
case "$1" in
  exec) shift; [ "$1" = -i ] && shift; shift; exec setsid -f -w "$@" ;;
  *) echo "stand-in docker: only exec" >&2; exit 1 ;;
esac
"""


def _fake_docker_bin(d: Path) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "docker").write_text(FAKE_DOCKER_EXEC)
    (d / "docker").chmod(0o755)
    return d


def _kill_marked(marker: str) -> list[int]:
    """Kill (by PID) the processes whose command line carries `marker`; return their PIDs."""
    pids = []
    for d in os.listdir("/proc"):
        if d.isdigit() and int(d) != os.getpid():
            try:
                if marker in Path(f"/proc/{d}/cmdline").read_bytes().replace(b"\0", b" ").decode():
                    os.kill(int(d), signal.SIGKILL)
                    pids.append(int(d))
            except OSError:
                pass
    return pids


def _proc_cmdlines() -> list[str]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                out.append(Path(f"/proc/{d}/cmdline").read_bytes().replace(b"\0", b" ").decode())
            except OSError:
                pass
    return out


_OPENED: list[SSHNode] = []


@pytest.fixture(autouse=True)
def _close_ssh_nodes():
    """Close what a test opened while its sshd still runs: that sshd then reaps its session processes (killed
    at teardown instead, they would stay zombies under an init that does not reap)."""
    yield
    _close_opened()


def _close_opened() -> None:
    while _OPENED:
        _OPENED.pop().close()


def _ssh(c, host, **kw) -> SSHNode:
    kw = {"key_file": str(c.client_key), "known_hosts": str(c.known_hosts), "connect_timeout": 3, **kw}
    node = SSHNode(host.ip, **kw)
    _OPENED.append(node)
    return node


# --- LocalNode ---------------------------------------------------------------------------------

def test_local_run_env_and_rc():
    r = LocalNode().run('echo "$A|$B"; echo err >&2; exit 3', env={"A": "x y", "B": "it's"})
    assert (r.rc, r.stdout, r.stderr.strip()) == (3, "x y|it's\n", "err")
    assert not r.ok


def test_local_timeout_kills_the_whole_group():
    marker = f"sleep 37.{os.getpid()}"
    t = time.monotonic()
    r = LocalNode().run(f"({marker}) & {marker}", timeout=1)
    assert r.rc == 124 and r.timed_out
    assert time.monotonic() - t < 8
    time.sleep(0.2)
    assert not [c for c in _proc_cmdlines() if marker in c], "a child of the timed-out command survived"


def test_local_put_get(tmp_path):
    src = tmp_path / "a.txt"
    src.write_text("payload")
    LocalNode().put(src, str(tmp_path / "d" / "b.txt"))
    LocalNode().get(str(tmp_path / "d" / "b.txt"), tmp_path / "e" / "c.txt")
    assert (tmp_path / "e" / "c.txt").read_text() == "payload"


def test_container_wrapping_is_a_node_property():
    node = LocalNode(container="v4c")
    cmd = in_container("v4c", "echo hi")
    assert cmd == "docker exec -i v4c bash -c 'echo hi'"
    assert node.host().container == "" and node.container == "v4c"


def test_local_container_timeout_ends_the_command_inside(tmp_path, monkeypatch):
    """Killing `docker exec` does not stop what it started in the container: the timeout must act in there."""
    monkeypatch.setenv("PATH", f"{_fake_docker_bin(tmp_path / 'bin')}:{os.environ['PATH']}")
    marker = f"sleep 47.{os.getpid()}"
    try:
        t = time.monotonic()
        r = LocalNode(container="v4c").run(f"({marker}) & {marker}", timeout=1)
        assert r.rc == 124 and time.monotonic() - t < 9, r
        time.sleep(0.5)
        assert not [c for c in _proc_cmdlines() if marker in c], "the command outlived its timeout in the container"
    finally:
        _kill_marked(marker)


def test_fan_out_never_drops_a_failure():
    def fn(node):
        if node.name == "b":
            raise RuntimeError("boom")
        return node.run(f"echo {node.name}")
    rs = fan_out([LocalNode("a"), LocalNode("b"), LocalNode("c")], fn)
    assert [r.node for r in rs] == ["a", "b", "c"]
    assert [r.ok for r in rs] == [True, False, True]
    assert "boom" in rs[1].stderr and "[b]" in rs[1].stderr


# --- SSHNode against a real sshd -----------------------------------------------------------------



@pytest.mark.netns
def test_ssh_runs_on_each_host(netns_cluster):
    c = netns_cluster
    rs = fan_out([_ssh(c, h) for h in c.hosts], lambda n: n.run('hostname; echo "$X"', env={"X": "a b"}))
    assert [r.rc for r in rs] == [0, 0, 0]
    assert [r.stdout.split("\n")[0] for r in rs] == [h.hostname for h in c.hosts]
    assert all(r.stdout.split("\n")[1] == "a b" for r in rs)


@pytest.mark.netns
def test_ssh_unknown_host_key_rejected_by_default(netns_cluster, tmp_path):
    c = netns_cluster
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    node = _ssh(c, c.hosts[1], known_hosts=str(empty))
    with pytest.raises(HostKeyError, match="not in .*rejected"):
        node.run("true")
    assert empty.read_text() == "", "a rejected key must not be recorded"


@pytest.mark.netns
def test_ssh_new_host_key_accepted_only_with_flag_and_announced(netns_cluster, tmp_path, capsys):
    c = netns_cluster
    kh = tmp_path / "known_hosts"
    r = _ssh(c, c.hosts[1], known_hosts=str(kh), accept_new_host_keys=True).run("hostname")
    assert r.ok and r.stdout.strip() == c.hosts[1].hostname
    assert "accepted NEW host key" in capsys.readouterr().err
    pub = (c.hosts[1].dir / "host_ed25519.pub").read_text().split()[1]
    assert pub in kh.read_text()
    # now pinned: the default (rejecting) policy connects
    assert _ssh(c, c.hosts[1], known_hosts=str(kh)).run("true").ok


@pytest.mark.netns
def test_ssh_changed_host_key_is_refused(netns_cluster, tmp_path):
    c = netns_cluster
    other = (c.hosts[2].dir / "host_ed25519.pub").read_text().split()
    kh = tmp_path / "known_hosts"
    kh.write_text(f"{c.hosts[1].ip} {other[0]} {other[1]}\n")      # host 1 under host 2's key
    with pytest.raises(HostKeyError, match="CHANGED"):
        _ssh(c, c.hosts[1], known_hosts=str(kh), accept_new_host_keys=True).run("true")


@pytest.mark.netns
def test_ssh_command_timeout_kills_the_remote_command(netns_cluster):
    c = netns_cluster
    marker = f"sleep 41.{os.getpid()}"
    t = time.monotonic()
    r = _ssh(c, c.hosts[0]).run(f"({marker}) & {marker}", timeout=1)
    assert r.rc == 124 and "timed out" in r.stderr
    assert time.monotonic() - t < 10
    time.sleep(0.5)
    assert not [x for x in _proc_cmdlines() if marker in x], "the remote command outlived its timeout"


@pytest.mark.netns
def test_ssh_connect_retries_are_bounded(netns_cluster):
    c = netns_cluster
    node = _ssh(c, c.hosts[0], port=2222, retries=3, backoff=0.2)     # nothing listens there
    t = time.monotonic()
    with pytest.raises(ConnectionError, match="after 3 attempt"):
        node.run("true")
    dt = time.monotonic() - t
    assert 0.55 < dt < 5, dt          # two backoffs (0.2 + 0.4 s), then it gives up


@pytest.mark.netns
def test_ssh_auth_failure_is_not_retried(netns_cluster, tmp_path):
    c = netns_cluster
    h = c.hosts[2]
    saved = h.authorized_keys.read_text()
    h.authorized_keys.write_text("")
    try:
        t = time.monotonic()
        with pytest.raises(ConnectionError, match="authentication failed"):
            _ssh(c, h, retries=5, backoff=1.0).run("true")
        assert time.monotonic() - t < 3
    finally:
        h.authorized_keys.write_text(saved)


@pytest.mark.netns
def test_ssh_put_get_and_fan_out_with_one_host_down(netns_cluster, tmp_path):
    c = netns_cluster
    node = _ssh(c, c.hosts[1])
    src = tmp_path / "src.bin"
    src.write_bytes(os.urandom(100_000))
    remote = str(c.root / "host1" / "xfer" / "dst.bin")
    node.put(src, remote)
    node.get(remote, tmp_path / "back.bin")
    assert (tmp_path / "back.bin").read_bytes() == src.read_bytes()
    nodes = [_ssh(c, c.hosts[0]), _ssh(c, c.hosts[1], port=2222, retries=1), _ssh(c, c.hosts[2])]
    rs = fan_out(nodes, lambda n: n.run("true"))
    assert [r.ok for r in rs] == [True, False, True]
    assert c.hosts[1].ip in rs[1].stderr and "unreachable" in rs[1].stderr


@pytest.mark.netns
def test_ssh_exit_124_is_not_mistaken_for_a_timeout(netns_cluster):
    r = _ssh(netns_cluster, netns_cluster.hosts[0]).run("exit 124", timeout=30)
    assert r.rc == 124 and "timed out" not in r.stderr


@pytest.mark.netns
def test_auth_token_from_an_unreachable_head_is_a_cluster_error(netns_cluster):
    """The Jobs client reads the cluster's token from the head over SSH: when that fails, the launcher's own error
    (with its fix) comes out, not paramiko's."""
    from launcher.cluster import read_auth_token
    from launcher.errors import ClusterError
    c = netns_cluster
    head = _ssh(c, c.hosts[0], port=2222, retries=1)                    # nothing listens there
    with pytest.raises(ClusterError, match=f"auth token from the head {c.hosts[0].ip}"):
        read_auth_token({"V4_LOCAL_DIR": "/tmp/v4-{node_ip}", "V4_RAY_PORT": 6479}, head)


@pytest.mark.netns
def test_ssh_container_timeout_ends_the_command_inside(netns_cluster):
    """Over SSH, `timeout` on the host ends only the `docker exec` client; the command runs on in the container
    unless the timeout is also inside it."""
    c, h = netns_cluster, netns_cluster.hosts[1]
    fake = _fake_docker_bin(c.root / "fakedocker-exec")
    c.restart_sshd(h, extra_config=f"SetEnv PATH={fake}:/usr/local/bin:/usr/bin:/bin")
    marker = f"sleep 53.{os.getpid()}"
    try:
        t = time.monotonic()
        r = _ssh(c, h, container="v4c").run(f"({marker}) & {marker}", timeout=1)
        assert r.rc == 124 and time.monotonic() - t < 15, r
        time.sleep(0.5)
        assert not [x for x in _proc_cmdlines() if marker in x], "the command outlived its timeout in the container"
        assert _ssh(c, h, container="v4c").run("echo in").stdout == "in\n"      # no timeout: plain exec
    finally:
        _kill_marked(marker)
        _close_opened()
        c.restart_sshd(h)


@pytest.mark.netns
@pytest.mark.parametrize("kind", ["missing", "directory"])
def test_ssh_unusable_key_file_is_named_and_not_retried(netns_cluster, tmp_path, kind):
    """A V4_SSH_KEY that cannot be read is the launcher's problem, not the host's: said at once, naming the file."""
    key = tmp_path / "id_missing"
    if kind == "directory":
        key.mkdir()
    t = time.monotonic()
    with pytest.raises(SSHKeyError, match=f"V4_SSH_KEY={key} " + ("does not exist" if kind == "missing" else
                                                                   "is a directory")) as e:
        _ssh(netns_cluster, netns_cluster.hosts[0], key_file=str(key), retries=4, backoff=1.0).run("true")
    assert time.monotonic() - t < 1, "retried"
    assert "unreachable" not in str(e.value)
    assert isinstance(e.value, ConnectionError)          # callers that catch connection trouble still do


@pytest.mark.netns
def test_auth_token_when_the_head_refuses_sessions(netns_cluster):
    """SSH connects and authenticates, then the head refuses the session channel (MaxSessions 0): a ClusterError that
    names the head, not paramiko's ChannelException."""
    from launcher.cluster import read_auth_token
    from launcher.errors import ClusterError
    c, h = netns_cluster, netns_cluster.hosts[0]
    c.restart_sshd(h, extra_config="Match Address *\n  MaxSessions 0")
    try:
        with pytest.raises(ClusterError, match=f"auth token from the head {h.ip}") as e:
            read_auth_token({"V4_LOCAL_DIR": "/tmp/v4-{node_ip}", "V4_RAY_PORT": 6479}, _ssh(c, h, retries=1))
        assert h.ip in e.value.fix
    finally:
        _close_opened()
        c.restart_sshd(h)
