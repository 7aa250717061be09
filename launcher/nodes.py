"""Nodes: run a command, copy a file, on this machine or over SSH; fan out over many nodes.

A node runs shell command strings (bash). Both kinds enforce a timeout on the node itself
(`timeout` there, a killed process group here), so a hung command never outlives its caller.
When the cluster runs in containers, `container` makes every `run` a `docker exec` into it, with
the timeout enforced inside the container too (killing the `docker exec` client leaves the command
running there); `host()` is the same node without the wrapping (for `docker run` itself).
SSH connections stay open for reuse until `close()`: `opened(cfg)` closes the nodes it made.
"""
from __future__ import annotations

import logging

import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterator, Protocol, Sequence, TypeVar

TIMEOUT_RC = 124        # what coreutils `timeout` returns; we return it too
UNREACHABLE_RC = 255    # what ssh(1) returns when it cannot connect


@dataclass(frozen=True)
class Result:
    node: str
    rc: int
    stdout: str = ""
    stderr: str = ""

    @property
    def ok(self) -> bool:
        return self.rc == 0

    @property
    def timed_out(self) -> bool:
        return self.rc == TIMEOUT_RC

    def tail(self, lines: int = 20) -> str:
        """The last lines of stderr (else stdout): what to show a person when this failed."""
        text = (self.stderr.strip() or self.stdout.strip())
        return "\n".join(text.splitlines()[-lines:])


class Node(Protocol):
    name: str           # how people name it: its address
    container: str      # "" = commands run on the host

    def run(self, cmd: str, env: dict[str, str] | None = None, timeout: float | None = None) -> Result: ...
    def put(self, local: str | Path, remote: str) -> None: ...
    def get(self, remote: str, local: str | Path) -> None: ...
    def host(self) -> "Node": ...
    def close(self) -> None: ...


def shell_script(cmd: str, env: dict[str, str] | None) -> str:
    """`cmd` preceded by `export` lines for `env`, as one bash script."""
    exports = "".join(f"export {k}={shlex.quote(str(v))}\n" for k, v in (env or {}).items())
    return exports + cmd


def in_container(container: str, script: str) -> str:
    """The host-side command that runs `script` inside a running container."""
    return f"docker exec -i {shlex.quote(container)} bash -c {shlex.quote(script)}"


def _wrap(node_container: str, cmd: str, env: dict[str, str] | None, timeout: float | None = None) -> str:
    script = shell_script(cmd, env)
    if not node_container:
        return script
    if timeout:
        # The command runs under the container's init, not under `docker exec`: a timeout that kills the client
        # (or its process group) leaves it running. `timeout` inside ends the command's whole group there.
        script = f"timeout -k 5 {timeout:g} bash -c {shlex.quote(script)}"
    return in_container(node_container, script)


def container_grace(node_container: str, timeout: float | None) -> float | None:
    """The host-side deadline: later than the one inside the container, which should fire first."""
    return timeout + 10 if timeout and node_container else timeout


# --- this machine -----------------------------------------------------------------------------

@dataclass
class LocalNode:
    """Runs commands here, each in its own process group so a timeout kills all it started."""
    name: str = "localhost"
    container: str = ""
    default_timeout: float | None = None

    def run(self, cmd: str, env: dict[str, str] | None = None, timeout: float | None = None) -> Result:
        timeout = timeout if timeout is not None else self.default_timeout
        script = _wrap(self.container, cmd, env, timeout)
        timeout = container_grace(self.container, timeout)
        proc = subprocess.Popen(["bash", "-c", script], stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        try:
            out, err = proc.communicate(timeout=timeout)
            return Result(self.name, proc.returncode, out, err)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            out, err = proc.communicate()
            return Result(self.name, TIMEOUT_RC, out, err + f"\n[{self.name}] timed out after {timeout:g} s; "
                          "its process group was killed")

    def put(self, local: str | Path, remote: str) -> None:
        Path(remote).parent.mkdir(parents=True, exist_ok=True)
        Path(remote).write_bytes(Path(local).read_bytes())

    def get(self, remote: str, local: str | Path) -> None:
        Path(local).parent.mkdir(parents=True, exist_ok=True)
        Path(local).write_bytes(Path(remote).read_bytes())

    def host(self) -> "LocalNode":
        return replace(self, container="")

    def close(self) -> None:
        pass


def _kill_group(proc: subprocess.Popen, grace: float = 3.0) -> None:
    """TERM, then KILL, the process group `proc` leads; reaps the leader so it does not linger."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            proc.poll()
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.05)


# --- over SSH ---------------------------------------------------------------------------------

class HostKeyError(Exception):
    pass


class SSHKeyError(ConnectionError):
    """V4_SSH_KEY names a file that cannot be read: no retry can fix it, and the host is not to blame."""


def _accept_and_record_policy(known_hosts: Path):
    """A paramiko policy that accepts an unknown host key, records it in `known_hosts`, and says so."""
    import paramiko

    class AcceptNewAndRecord(paramiko.MissingHostKeyPolicy):
        def missing_host_key(self, client, hostname, key):
            fp = key.fingerprint if hasattr(key, "fingerprint") else key.get_fingerprint().hex()
            client.get_host_keys().add(hostname, key.get_name(), key)
            known_hosts.parent.mkdir(parents=True, exist_ok=True)
            with open(known_hosts, "a") as f:
                f.write(f"{hostname} {key.get_name()} {key.get_base64()}\n")
            print(f"warning: accepted NEW host key for {hostname}: {key.get_name()} {fp}; "
                  f"recorded in {known_hosts}", file=sys.stderr)

    return AcceptNewAndRecord()


@dataclass
class _Conn:
    """One paramiko client per host, shared by the views of that host (`host()`)."""
    client: object = None
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass
class SSHNode:
    """A host reached with paramiko: key auth, host keys checked, bounded connect retries.

    Unknown host keys are rejected unless `accept_new_host_keys` (then each is recorded and
    announced on stderr). Transient connect failures are retried, `retries` attempts in all, with
    exponential backoff; a rejected host key or failed authentication is not, since retrying
    cannot fix it.
    """
    address: str
    user: str = "root"
    port: int = 22
    key_file: str = ""
    known_hosts: str = ""
    accept_new_host_keys: bool = False
    connect_timeout: float = 10.0
    command_timeout: float = 600.0
    retries: int = 3
    backoff: float = 0.5
    container: str = ""
    conn: _Conn = field(default_factory=_Conn, repr=False, compare=False)

    @property
    def name(self) -> str:
        return self.address

    def host(self) -> "SSHNode":
        return replace(self, container="")      # shares `conn`: same connection, no wrapping

    # connection

    def _known_hosts_path(self) -> Path:
        return Path(self.known_hosts or "~/.ssh/known_hosts").expanduser()

    def _connect_once(self):
        import paramiko
        # paramiko's transport thread logs every failed handshake with a traceback (~25 lines a node); the reason
        # reaches the user once, in our ConnectionError, so its own log stays quiet
        logging.getLogger("paramiko").setLevel(logging.CRITICAL)
        client = paramiko.SSHClient()
        kh = self._known_hosts_path()
        if kh.exists():
            client.load_host_keys(str(kh))
        client.set_missing_host_key_policy(
            _accept_and_record_policy(kh) if self.accept_new_host_keys else paramiko.RejectPolicy())
        try:
            client.connect(self.address, port=self.port, username=self.user,
                           key_filename=self.key_file or None, timeout=self.connect_timeout,
                           banner_timeout=self.connect_timeout, auth_timeout=self.connect_timeout,
                           allow_agent=not self.key_file, look_for_keys=not self.key_file)
        except BaseException:
            client.close()
            raise
        return client

    def _check_key_file(self) -> None:
        """The key file must exist and be readable before any connect: paramiko's OSError for a missing key would
        otherwise be retried like a refused connection, then reported as the host being unreachable."""
        if not self.key_file:
            return
        try:
            with open(Path(self.key_file).expanduser(), "rb"):
                pass
        except OSError as e:
            why = ("does not exist" if isinstance(e, FileNotFoundError) else
                   "is a directory, not a private key file" if isinstance(e, IsADirectoryError) else
                   f"cannot be read ({e.strerror or e})")
            raise SSHKeyError(f"{self.user}@{self.address}:{self.port}: authentication impossible: the SSH key "
                              f"V4_SSH_KEY={self.key_file} {why}") from None

    def connect(self):
        """The live client, connecting (with bounded retries) when there is none."""
        import paramiko
        with self.conn.lock:
            c = self.conn.client
            if c is not None and c.get_transport() is not None and c.get_transport().is_active():
                return c
            self._check_key_file()
            errors: list[BaseException] = []
            attempts = max(1, self.retries)
            for attempt in range(attempts):
                try:
                    self.conn.client = self._connect_once()
                    return self.conn.client
                except paramiko.BadHostKeyException as e:
                    raise HostKeyError(
                        f"{self.address}: host key CHANGED ({self._known_hosts_path()} holds another one). "
                        "Verify the host, then remove the stale line from that file") from e
                except paramiko.AuthenticationException as e:
                    raise ConnectionError(
                        f"{self.user}@{self.address}:{self.port}: authentication failed with key "
                        f"{self.key_file or '(agent / ~/.ssh defaults)'}: {e}") from e
                except paramiko.SSHException as e:
                    if "not found in known_hosts" in str(e):
                        raise HostKeyError(
                            f"{self.address}:{self.port}: host key not in {self._known_hosts_path()}, rejected. "
                            f"Check its fingerprint, then add it (ssh-keyscan -p {self.port} {self.address} "
                            f">> {self._known_hosts_path()}) or set V4_SSH_ACCEPT_NEW_HOST_KEYS=1") from e
                    errors.append(e)
                except (OSError, EOFError) as e:   # refused, unreachable, timed out, reset
                    errors.append(e)
                if attempt + 1 < attempts:
                    time.sleep(self.backoff * 2 ** attempt)
            raise ConnectionError(f"{self.user}@{self.address}:{self.port}: unreachable after "
                                  f"{len(errors)} attempt(s): {errors[-1]}")

    def close(self) -> None:
        with self.conn.lock:
            if self.conn.client is not None:
                self.conn.client.close()
                self.conn.client = None

    # commands and files

    def run(self, cmd: str, env: dict[str, str] | None = None, timeout: float | None = None) -> Result:
        import paramiko
        timeout = timeout if timeout is not None else self.command_timeout
        script = shlex.quote(_wrap(self.container, cmd, env, timeout))
        # The node enforces the timeout itself: `timeout` kills the command's whole process group
        # there, which closing our end of the channel would not do. (In a container, the one inside
        # fires first; this one ends a hung `docker exec`.)
        outer = container_grace(self.container, timeout)
        remote = f"timeout -k 5 {outer:g} bash -c {script}" if outer else f"bash -c {script}"
        client = self.connect()
        chan = None
        try:
            chan = client.get_transport().open_session(timeout=self.connect_timeout)
            chan.exec_command(remote)
        except (paramiko.SSHException, EOFError, AttributeError) as e:   # refused channel, dropped transport
            if chan is not None:
                chan.close()
            raise ConnectionError(f"{self.user}@{self.address}:{self.port}: SSH session failed: "
                                  f"{type(e).__name__}: {e}") from e
        t0 = time.monotonic()
        try:
            chan.shutdown_write()
            out, err = bytearray(), bytearray()
            deadline = time.monotonic() + outer + 15 if outer else None
            while True:
                idle = True
                while chan.recv_ready():
                    out += chan.recv(65536); idle = False
                while chan.recv_stderr_ready():
                    err += chan.recv_stderr(65536); idle = False
                if chan.exit_status_ready() and not chan.recv_ready() and not chan.recv_stderr_ready():
                    break
                if deadline and time.monotonic() > deadline:   # the node did not honour `timeout`
                    return Result(self.name, TIMEOUT_RC, out.decode(errors="replace"),
                                  err.decode(errors="replace") + f"\n[{self.name}] no answer after {outer:g} s")
                if idle:
                    time.sleep(0.02)
            rc = chan.recv_exit_status()
        finally:
            chan.close()
        stderr = err.decode(errors="replace")
        # 124/137 is how `timeout` reports it; a command that merely exits so early is not a timeout.
        if timeout and rc in (TIMEOUT_RC, 128 + 9) and time.monotonic() - t0 >= timeout:
            stderr += f"\n[{self.name}] timed out after {timeout:g} s; killed there"
            rc = TIMEOUT_RC
        return Result(self.name, rc, out.decode(errors="replace"), stderr)

    def _sftp(self):
        import paramiko
        client = self.connect()
        try:
            return client.open_sftp()
        except (paramiko.SSHException, EOFError) as e:      # sftp disabled in sshd_config, channel refused
            raise ConnectionError(f"{self.user}@{self.address}:{self.port}: SFTP session failed "
                                  f"({type(e).__name__}: {e}); is the sftp subsystem enabled in sshd?") from e

    def put(self, local: str | Path, remote: str) -> None:
        sftp = self._sftp()
        try:
            parts, p = [], Path(remote).parent
            while str(p) not in ("/", "."):
                parts.append(str(p)); p = p.parent
            for d in reversed(parts):
                try:
                    sftp.stat(d)
                except FileNotFoundError:
                    sftp.mkdir(d)
            sftp.put(str(local), f"{remote}.part")
            sftp.posix_rename(f"{remote}.part", remote)
        finally:
            sftp.close()

    def get(self, remote: str, local: str | Path) -> None:
        Path(local).parent.mkdir(parents=True, exist_ok=True)
        sftp = self._sftp()
        try:
            sftp.get(remote, str(local))
        finally:
            sftp.close()


# --- many nodes -------------------------------------------------------------------------------

T = TypeVar("T")


def failed(node: Node, exc: BaseException) -> Result:
    return Result(node.name, UNREACHABLE_RC, "", f"[{node.name}] {type(exc).__name__}: {exc}")


def fan_out(nodes: Sequence[Node], fn: Callable[[Node], T],
            on_error: Callable[[Node, BaseException], T] = failed) -> list[T]:
    """`fn(node)` on every node in parallel: one answer per node, in order. An exception never
    escapes or goes missing: it becomes `on_error(node, exc)` (a failed Result naming the node)."""
    def one(node):
        try:
            return fn(node)
        except Exception as e:   # noqa: BLE001 - reported per node, never dropped
            return on_error(node, e)
    if len(nodes) <= 1:
        return [one(n) for n in nodes]
    with ThreadPoolExecutor(max_workers=min(32, len(nodes))) as pool:
        return list(pool.map(one, nodes))


def close_all(nodes: Sequence[Node]) -> None:
    """Close every node's connection (SSH transports are threads: they outlive a forgotten client)."""
    for n in nodes:
        try:
            n.close()
        except Exception:   # noqa: BLE001 - closing is best effort; the peer may be gone already
            pass


@contextmanager
def opened(cfg, nodes: Sequence[Node] | None = None) -> Iterator[list[Node]]:
    """`nodes`, or the configured ones; those made here are closed on the way out, given ones are the caller's."""
    if nodes:
        yield list(nodes)
        return
    made = nodes_from_config(cfg)
    try:
        yield made
    finally:
        close_all(made)


def node_local_dir(cfg, ip: str) -> str:
    """V4_LOCAL_DIR for one node ({node_ip} replaced: test hosts share one filesystem)."""
    return str(cfg["V4_LOCAL_DIR"]).replace("{node_ip}", ip)


def python_on_nodes(cfg) -> str:
    """V4_PYTHON; else the image's python3 in a container, else the launcher's own interpreter."""
    if cfg.get("V4_PYTHON", ""):
        return str(cfg["V4_PYTHON"])
    return "python3" if cfg.get("V4_CONTAINER", "") else sys.executable


def nodes_from_config(cfg) -> list[Node]:
    """The cluster's nodes, head first, reached the way V4_TRANSPORT says."""
    container = str(cfg.get("V4_CONTAINER", "") or "")
    if cfg["V4_TRANSPORT"] == "local":
        return [LocalNode(name=ip, container=container, default_timeout=float(cfg["V4_SSH_COMMAND_TIMEOUT"]))
                for ip in cfg.nodes]
    return [SSHNode(address=ip, user=str(cfg["V4_SSH_USER"]), port=int(cfg["V4_SSH_PORT"]),
                    key_file=str(cfg.get("V4_SSH_KEY", "") or ""),
                    known_hosts=str(cfg.get("V4_SSH_KNOWN_HOSTS", "") or ""),
                    accept_new_host_keys=bool(cfg.get("V4_SSH_ACCEPT_NEW_HOST_KEYS", False)),
                    connect_timeout=float(cfg["V4_SSH_CONNECT_TIMEOUT"]),
                    command_timeout=float(cfg["V4_SSH_COMMAND_TIMEOUT"]),
                    retries=int(cfg["V4_SSH_RETRIES"]), container=container)
            for ip in cfg.nodes]
