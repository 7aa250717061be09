"""Test hosts made of network namespaces: one bridge, N namespaces, each with its own sshd,
hostname (a UTS namespace) and directories. Everything is stopped by PID and by namespace.

The hosts share this machine's filesystem and process table, so each host gets its own
directory, and teardown kills exactly the processes whose network namespace is one we made.
"""
from __future__ import annotations

import fcntl
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

SSHD = "/usr/sbin/sshd"
PREFIX = "v4t"          # every namespace/link we create starts with it (and carries our pid)


def missing_requirements() -> str | None:
    """Why network-namespace hosts cannot be built here, or None."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    for tool in ("ip", "unshare", "ssh-keygen"):
        if shutil.which(tool) is None:
            return f"`{tool}` missing (apt-get install -y iproute2 openssh-server)"
    if not os.path.exists(SSHD):
        return f"{SSHD} missing (apt-get install -y openssh-server)"
    r = subprocess.run(["ip", "netns", "add", f"{PREFIX}probe{os.getpid()}"], capture_output=True, text=True)
    if r.returncode != 0:
        return f"cannot create a network namespace here: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", f"{PREFIX}probe{os.getpid()}"], capture_output=True)
    return None


def sh(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(list(args), capture_output=True, text=True)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} -> {r.returncode}: {r.stderr.strip()}")
    return r


@dataclass
class Host:
    index: int
    ns: str
    ip: str
    hostname: str
    dir: Path                           # per-host state: sshd config, keys, logs
    sshd: subprocess.Popen | None = None
    extra_sshd_config: str = ""
    private_mounts: tuple[tuple[str, str], ...] = ()   # (src, dst) bind mounts only this host sees

    @property
    def authorized_keys(self) -> Path:
        return self.dir / "authorized_keys"


@dataclass
class NetnsCluster:
    root: Path
    subnet: str                         # "10.200.N"
    bridge: str
    hosts: list[Host]
    client_key: Path
    known_hosts: Path
    extra_pids: list[int] = field(default_factory=list)

    # -- construction ---------------------------------------------------------------------------

    @classmethod
    def create(cls, n: int = 3) -> "NetnsCluster":
        root = Path(tempfile.mkdtemp(prefix="v4n", dir="/tmp"))    # short: Ray socket paths live below
        tag = f"{os.getpid() % 100000}"
        # one build at a time on this machine (pytest-xdist runs test files in parallel): a subnet is free until
        # its bridge holds it, and each host's interface is made under a fixed name in the root namespace before it
        # moves into the host's; two clusters on one subnet would reach each other's hosts
        with _build_lock():
            sweep_stale()
            c = cls(root=root, subnet=_free_subnet(), bridge=f"{PREFIX}{tag}br", hosts=[],
                    client_key=root / "client_ed25519", known_hosts=root / "known_hosts")
            try:
                c._build(n, tag)
            except BaseException:
                c.teardown()
                raise
        return c

    def _build(self, n: int, tag: str) -> None:
        sh("ip", "link", "add", self.bridge, "type", "bridge")
        sh("ip", "addr", "add", f"{self.subnet}.1/24", "dev", self.bridge)
        sh("ip", "link", "set", self.bridge, "up")
        sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "v4-test-client", "-f", str(self.client_key))
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
        lines = []
        for i in range(n):
            ip = f"{self.subnet}.{i + 2}"
            h = Host(index=i, ns=f"{PREFIX}{tag}n{i}", ip=ip, hostname=f"v4host{i}",
                     dir=self.root / f"host{i}")
            h.dir.mkdir()
            veth_out, veth_in = f"{PREFIX}{tag}v{i}", f"v4eth{i}"
            sh("ip", "netns", "add", h.ns)
            # `ip netns exec` bind-mounts /etc/netns/NS/* over /etc: each host resolves its own
            # name locally, and no DNS lookup waits on a server it cannot reach.
            etc = Path("/etc/netns") / h.ns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(f"127.0.0.1 localhost\n{ip} {h.hostname}\n" +
                                       "".join(f"{self.subnet}.{j + 2} v4host{j}\n" for j in range(n) if j != i))
            (etc / "resolv.conf").write_text("options timeout:1 attempts:1\n")
            sh("ip", "link", "add", veth_out, "type", "veth", "peer", "name", veth_in)
            sh("ip", "link", "set", veth_in, "netns", h.ns)
            sh("ip", "link", "set", veth_out, "master", self.bridge, "up")
            for cmd in (["ip", "addr", "add", f"{ip}/24", "dev", veth_in], ["ip", "link", "set", veth_in, "up"],
                        ["ip", "link", "set", "lo", "up"],
                        ["ip", "route", "add", "default", "via", f"{self.subnet}.1"]):
                sh("ip", "netns", "exec", h.ns, *cmd)
            sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", h.hostname, "-f", str(h.dir / "host_ed25519"))
            lines.append(f"{ip} {(h.dir / 'host_ed25519.pub').read_text().split()[0]} "
                         f"{(h.dir / 'host_ed25519.pub').read_text().split()[1]}\n")
            h.authorized_keys.write_text(Path(f"{self.client_key}.pub").read_text())
            self.hosts.append(h)
        self.known_hosts.write_text("".join(lines))
        for h in self.hosts:
            self.start_sshd(h)

    # -- sshd -----------------------------------------------------------------------------------

    def start_sshd(self, h: Host) -> None:
        cfg = h.dir / "sshd_config"
        cfg.write_text(f"""Port 22
ListenAddress {h.ip}
HostKey {h.dir / 'host_ed25519'}
PidFile {h.dir / 'sshd.pid'}
AuthorizedKeysFile {h.authorized_keys}
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
PermitRootLogin prohibit-password
StrictModes no
UsePAM no
MaxSessions 64
MaxStartups 64
Subsystem sftp internal-sftp
{h.extra_sshd_config}
""")
        mounts = "".join(f"mount --bind {src} {dst}; " for src, dst in h.private_mounts)
        # `ip netns exec` already gives the process its own mount namespace (slave of ours), so a
        # bind mount made here stays invisible to every other host.
        script = f"hostname {h.hostname}; {mounts}exec {SSHD} -D -e -f {cfg}"
        log = open(h.dir / "sshd.log", "ab")
        h.sshd = subprocess.Popen(["ip", "netns", "exec", h.ns, "unshare", "--uts", "bash", "-c", script],
                                  stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if h.sshd.poll() is not None:
                raise RuntimeError(f"sshd on {h.ip} exited: {(h.dir / 'sshd.log').read_text()[-2000:]}")
            try:
                with socket.create_connection((h.ip, 22), timeout=0.5) as s:
                    if s.recv(4).startswith(b"SSH"):
                        return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"sshd on {h.ip} did not answer in 15 s")

    def stop_sshd(self, h: Host) -> None:
        if h.sshd is not None and h.sshd.poll() is None:
            h.sshd.terminate()
            try:
                h.sshd.wait(5)
            except subprocess.TimeoutExpired:
                h.sshd.kill(); h.sshd.wait()
        h.sshd = None

    def set_link(self, h: Host, up: bool) -> None:
        """Host `h` off or back on the network. Its interface going down takes the default route with it (the
        kernel drops routes through a downed interface): coming back up puts that back, as a later test on this
        cluster finds it (preflight's socket_ifname picks the default route's interface)."""
        sh("ip", "netns", "exec", h.ns, "ip", "link", "set", f"v4eth{h.index}", "up" if up else "down")
        if up:
            sh("ip", "netns", "exec", h.ns, "ip", "route", "replace", "default", "via", f"{self.subnet}.1")

    def restart_sshd(self, h: Host, extra_config: str = "", private_mounts=()) -> None:
        self.stop_sshd(h)
        h.extra_sshd_config, h.private_mounts = extra_config, tuple(private_mounts)
        self.start_sshd(h)

    def in_ns(self, h: Host, *argv: str, **kw) -> subprocess.Popen:
        """Start a process inside host `h` (stopped at teardown, by PID and by namespace)."""
        p = subprocess.Popen(["ip", "netns", "exec", h.ns, *argv], start_new_session=True, **kw)
        self.extra_pids.append(p.pid)
        return p

    # -- the cluster layer file for the launcher ------------------------------------------------

    def env_file(self, path: Path | None = None, **overrides) -> Path:
        values = {
            "V4_CLUSTER_NAME": "netns",
            "V4_TRANSPORT": "ssh",
            "V4_MASTER_IP": self.hosts[0].ip,
            "V4_WORKER_IPS": " ".join(h.ip for h in self.hosts[1:]),
            "V4_NUM_NODES": str(len(self.hosts)),
            "V4_NUM_GPUS_PER_NODE": "1",
            "V4_SSH_USER": "root",
            "V4_SSH_PORT": "22",
            "V4_SSH_KEY": str(self.client_key),
            "V4_SSH_KNOWN_HOSTS": str(self.known_hosts),
            "V4_SSH_CONNECT_TIMEOUT": "5",
            "V4_SSH_COMMAND_TIMEOUT": "120",
            "V4_SSH_RETRIES": "2",
            "V4_PYTHON": sys.executable,
            "V4_WORK": str(self.root / "work"),
            "V4_LOCAL_DIR": str(self.root / "{node_ip}"),
            "V4_RAY_PORT": "6390",
            "V4_DASHBOARD_PORT": "8266",
            "V4_RAY_NUM_CPUS": "1",
            "V4_RAY_READY_TIMEOUT": "120",
        }
        values.update({k: str(v) for k, v in overrides.items()})
        (self.root / "work").mkdir(exist_ok=True)
        path = path or self.root / "netns.env"
        path.write_text("# written by tests/cluster/netns.py\n" +
                        "".join(f'{k}="{v}"\n' for k, v in values.items()))
        return path

    # -- teardown -------------------------------------------------------------------------------

    def ns_pids(self) -> list[int]:
        return pids_in_namespaces([h.ns for h in self.hosts])

    def teardown(self) -> None:
        for h in self.hosts:
            self.stop_sshd(h)
        for pid in self.extra_pids:
            _kill_pgroup(pid)
        kill_namespace_processes([h.ns for h in self.hosts])
        for h in self.hosts:
            sh("ip", "netns", "del", h.ns, check=False)
            shutil.rmtree(Path("/etc/netns") / h.ns, ignore_errors=True)
        sh("ip", "link", "del", self.bridge, check=False)
        shutil.rmtree(self.root, ignore_errors=True)


def _kill_pgroup(pid: int) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        time.sleep(0.2)


def _ns_inode(ns: str) -> int | None:
    try:
        return os.stat(f"/run/netns/{ns}").st_ino
    except FileNotFoundError:
        return None


def pids_in_namespaces(names: list[str]) -> list[int]:
    """PIDs of the processes that live in any of these network namespaces."""
    inodes = {i for i in map(_ns_inode, names) if i is not None}
    pids = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                link = os.readlink(f"/proc/{d}/ns/net")          # "net:[4026532...]"
            except OSError:
                continue
            if int(link[5:-1]) in inodes:
                pids.append(int(d))
    return pids


def kill_namespace_processes(names: list[str], grace: float = 5.0) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids_in_namespaces(names):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace
        while pids_in_namespaces(names) and time.monotonic() < deadline:
            time.sleep(0.1)


@contextmanager
def _build_lock():
    with open("/tmp/v4t-netns-build.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _free_subnet() -> str:
    used = sh("ip", "-4", "addr").stdout + sh("ip", "-4", "route").stdout
    start = os.getpid() % 200
    for k in range(250):
        net = f"10.200.{(start + k) % 250 + 1}"
        if f"{net}." not in used:
            return net
    raise RuntimeError("no free 10.200.N.0/24 subnet")


def sweep_stale() -> None:
    """Remove namespaces/bridges a killed earlier test run of ours left behind (owner pid dead)."""
    for line in sh("ip", "netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        if name.startswith(PREFIX) and "n" in name[len(PREFIX):]:
            owner = name[len(PREFIX):].split("n")[0]
            if owner.isdigit() and not _pid_is_pytest(int(owner)):
                kill_namespace_processes([name], grace=2)
                sh("ip", "netns", "del", name, check=False)
                shutil.rmtree(Path("/etc/netns") / name, ignore_errors=True)
    for line in sh("ip", "-o", "link", "show", "type", "bridge", check=False).stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0]
        if name.startswith(PREFIX) and name.endswith("br"):
            owner = name[len(PREFIX):-2]
            if owner.isdigit() and not _pid_is_pytest(int(owner)):
                sh("ip", "link", "del", name, check=False)


def _pid_is_pytest(pid: int) -> bool:
    # Our names carry pid % 100000; treat any live python process with that pid as the owner.
    try:
        return "python" in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False
