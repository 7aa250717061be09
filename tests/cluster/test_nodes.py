"""LocalNode and SSHNode against real processes and a real sshd in a network namespace."""
from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from launcher.nodes import HostKeyError, LocalNode, SSHNode, fan_out, in_container


def _proc_cmdlines() -> list[str]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                out.append(Path(f"/proc/{d}/cmdline").read_bytes().replace(b"\0", b" ").decode())
            except OSError:
                pass
    return out


def _ssh(c, host, **kw) -> SSHNode:
    kw = {"key_file": str(c.client_key), "known_hosts": str(c.known_hosts), "connect_timeout": 3, **kw}
    return SSHNode(host.ip, **kw)


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
