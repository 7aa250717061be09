"""The hang watchdog: a training step whose ranks stop making progress is looked into, named and stopped.

Every rank of a train step keeps a heartbeat file, RUN/heartbeat/rank<N>.json (dsv4/heartbeat.py: a mark before
the rendezvous, each checkpoint load and save, each optimizer step and each collective the trainer issues in it).
The launcher's wait loops -- `launcher.jobs.wait` for a Ray job, `launcher.pipeline.run_local` for a local one --
poll a `Watchdog`. When no rank's heartbeat has changed for PRESET_HANG_TIMEOUT seconds, by the launcher's own clock
(the nodes' clocks never enter), it
  1. names the rank(s) that did not arrive: each rank passes the same marks in the same order, so the ones whose
     last mark is the earliest (or that never wrote one) are those the others wait for. When every rank stands at
     the same mark, it names none: all of them are inside one collective or between two marks, and the stacks tell;
  2. writes every rank's Python stacks (`py-spy dump --pid`, run on the rank's node: here, or through the cluster's
     Node -- SSH, `docker exec`) to RUN/hang/rank<N>.txt, and the verdict to RUN/hang/hang.json;
  3. returns a `Hang`: the caller stops the job and ends the step with Outcome status HUNG and exit code 124
     (`launcher.errors.Timeout`, whose message names the rank and the stacks).
A job whose ranks never write a heartbeat (every step but train; PRESET_HANG_TIMEOUT=0) is never judged.

For a restart within a budget (docs/resilience.md), a caller reads `Outcome.hang` (`Hang.model_dump()`): `behind`,
`stacks_dir`, `message`; a second attempt that should keep the first one's stacks passes its own `stacks_dir`.
"""
from __future__ import annotations

import shlex
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Callable

from pydantic import BaseModel, ConfigDict

from dsv4.fileio import atomic_write
from dsv4.heartbeat import HEARTBEAT_DIR, Mark

HANG_DIR = "hang"                   # under the run directory: the stacks and the verdict of the last hang
DUMP_TIMEOUT_S = 30.0               # one py-spy dump (it pauses the process for milliseconds; a stuck ptrace won't)

Progress = Callable[[str], None]


class RankLast(BaseModel):
    """One rank's last heartbeat as the watchdog saw it (None fields: it never wrote one)."""
    model_config = ConfigDict(extra="forbid")
    rank: int
    seq: int | None = None
    step: int | None = None
    phase: str | None = None
    pid: int | None = None
    host: str | None = None
    ip: str | None = None
    stacks: str = ""                # the file its stacks were written to ("" : none could be taken)


class Hang(BaseModel):
    """The verdict: what hung, who did not arrive, where the stacks are. Outcome.hang holds its model_dump()."""
    model_config = ConfigDict(extra="forbid")
    timeout_s: float
    stalled_s: float                # seconds since any heartbeat last changed, when declared
    behind: list[int]               # the rank(s) the others wait for ([]: every rank at the same mark)
    missing: list[int]              # ranks that never wrote a heartbeat during this watch
    ranks: list[RankLast]
    stacks_dir: str
    dump_s: float                   # how long taking every rank's stacks took
    message: str


class Hung(Exception):
    """Raised by `wait_process` when the watchdog declares a hang."""

    def __init__(self, hang: Hang):
        super().__init__(hang.message)
        self.hang = hang


def heartbeat_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / HEARTBEAT_DIR


def clear(run_dir: str | Path | None) -> None:
    """Remove an earlier job's heartbeats before a new job of the run starts: a rank that then never writes one is
    seen as missing, not as the earlier job's rank."""
    if not run_dir:
        return
    for f in heartbeat_dir(run_dir).glob("rank*.json"):
        f.unlink(missing_ok=True)


def read_marks(run_dir: str | Path) -> dict[int, Mark]:
    """The ranks' current heartbeats (a file that does not parse as one is skipped: it is not ours)."""
    out = {}
    for f in heartbeat_dir(run_dir).glob("rank*.json"):
        try:
            m = Mark.model_validate_json(f.read_bytes())
        except (OSError, ValueError):
            continue
        out[m.rank] = m
    return out


def timeout_of(cfg) -> float:
    return max(0.0, float(cfg.get("PRESET_HANG_TIMEOUT") or 0))


def for_job(cfg, run_dir: str | Path | None, progress: Progress | None = None, fresh: bool = False,
            stacks_dir: str | Path | None = None) -> "Watchdog | None":
    """The watchdog for one job of `run_dir`, or None (no run directory, or PRESET_HANG_TIMEOUT=0). fresh: the job
    has not started yet -- the run's earlier heartbeats are removed first."""
    timeout_s = timeout_of(cfg)
    if not run_dir or timeout_s <= 0:
        return None
    if fresh:
        clear(run_dir)
    return Watchdog(cfg, run_dir, timeout_s, progress, stacks_dir=stacks_dir)


class Watchdog:
    """Judges one job's heartbeats; `poll()` as often as you like (it reads the files every `poll_s` at most)."""

    def __init__(self, cfg, run_dir: str | Path, timeout_s: float, progress: Progress | None = None,
                 stacks_dir: str | Path | None = None, clock: Callable[[], float] = time.monotonic):
        self.cfg, self.run_dir, self.timeout_s = cfg, Path(run_dir), float(timeout_s)
        self.stacks_dir = Path(stacks_dir) if stacks_dir else self.run_dir / HANG_DIR
        self.progress = progress or (lambda msg: None)
        self.clock = clock
        # files are read at most every poll_s: a tenth of the timeout, between 0.2 s (tests) and 5 s (64 ranks on a
        # network filesystem stay a dozen small reads a second)
        self.poll_s = min(5.0, max(0.2, self.timeout_s / 10))
        self._seen: dict[int, tuple[int, int]] = {}    # rank -> (pid, seq) last read
        self._changed_at: float | None = None          # when any heartbeat last changed (None: none seen yet)
        self._read_at = -1e18
        self.hang: Hang | None = None

    def poll(self) -> Hang | None:
        """None while the ranks make progress (or before the first heartbeat); the Hang once they stopped (its stacks
        already taken). Declared once: later polls return the same Hang."""
        if self.hang is not None:
            return self.hang
        now = self.clock()
        if now - self._read_at < self.poll_s:
            return None
        self._read_at = now
        marks = read_marks(self.run_dir)
        state = {r: (m.pid, m.seq) for r, m in marks.items()}
        if state and state != self._seen:
            self._seen, self._changed_at = state, now
        if self._changed_at is None or now - self._changed_at < self.timeout_s:
            return None
        self.hang = self._declare(marks, now - self._changed_at)
        return self.hang

    # ------------------------------------------------------------------------------------------ the verdict
    def _declare(self, marks: dict[int, Mark], stalled_s: float) -> Hang:
        world = max(m.world for m in marks.values())
        missing = sorted(set(range(world)) - set(marks))
        low = min(m.seq for m in marks.values())
        high = max(m.seq for m in marks.values())
        behind = missing or ([r for r, m in sorted(marks.items()) if m.seq == low] if low < high else [])
        self.progress(f"[watchdog] no heartbeat from any of {world} rank(s) for {stalled_s:.0f} s "
                      f"(PRESET_HANG_TIMEOUT={self.timeout_s:g}); taking every rank's Python stacks")
        t0 = time.monotonic()
        files = self._dump_stacks(marks, missing)
        dump_s = time.monotonic() - t0
        ranks = [RankLast(rank=r, stacks=files.get(r, ""), **({
            "seq": m.seq, "step": m.step, "phase": m.phase, "pid": m.pid, "host": m.host, "ip": m.ip}
            if (m := marks.get(r)) else {})) for r in range(world)]
        hang = Hang(timeout_s=self.timeout_s, stalled_s=round(stalled_s, 2), behind=behind, missing=missing,
                    ranks=ranks, stacks_dir=str(self.stacks_dir), dump_s=round(dump_s, 2), message="")
        hang.message = describe(hang)
        atomic_write(self.stacks_dir / "hang.json", hang.model_dump_json(indent=2))
        self.progress(f"[watchdog] {hang.message}")
        return hang

    def _dump_stacks(self, marks: dict[int, Mark], missing: list[int]) -> dict[int, str]:
        """Every rank's stacks into stacks_dir/rank<N>.txt, one command per node (nodes in parallel); the files."""
        self.stacks_dir.mkdir(parents=True, exist_ok=True)
        for f in self.stacks_dir.glob("rank*.txt"):     # an earlier hang's, not to be mixed with these
            f.unlink(missing_ok=True)
        groups: dict[tuple[str, str], list[Mark]] = {}
        for m in marks.values():
            groups.setdefault((m.ip, m.host), []).append(m)
        texts: dict[int, str] = {}
        nodes = _nodes(self.cfg)
        try:
            threads = [threading.Thread(target=lambda key=key, ms=ms: texts.update(self._dump_group(nodes, key, ms)),
                                        daemon=True) for key, ms in groups.items()]
            for t in threads:
                t.start()
            for t in threads:
                t.join(DUMP_TIMEOUT_S * (1 + max(len(ms) for ms in groups.values())) + 30)
        finally:
            from launcher.nodes import close_all
            close_all(nodes)
        files = {}
        for r in sorted(marks) + missing:
            m = marks.get(r)
            head = (f"rank {r}: pid {m.pid} on {m.host} ({m.ip}); last heartbeat: step {m.step} {m.phase!r} "
                    f"(mark {m.seq})\n\n" if m else
                    f"rank {r}: no heartbeat during this watch (it never reached its first mark): no process to "
                    f"look into\n")
            path = self.stacks_dir / f"rank{r}.txt"
            atomic_write(path, head + texts.get(r, "" if m is None else "(no stacks: the dump did not answer)\n"))
            files[r] = str(path)
        return files

    def _dump_group(self, nodes, key: tuple[str, str], ms: list[Mark]) -> dict[int, str]:
        ip, host = key
        node = _node_for(nodes, ip, host)
        if node is None:
            return {m.rank: f"(no stacks: {host} ({ip}) is neither this machine nor a node of the cluster file; run "
                            f"`py-spy dump --pid {m.pid}` there)\n" for m in ms}
        script = "\n".join(
            f"echo '@@V4_RANK {m.rank}'; P={shlex.quote(str(Path(m.python).parent / 'py-spy'))}; "
            f"[ -x \"$P\" ] || P=py-spy; timeout {DUMP_TIMEOUT_S:g} \"$P\" dump --pid {m.pid} 2>&1; "
            f"echo \"@@V4_RC $?\"" for m in ms)
        try:
            r = node.run(script, timeout=DUMP_TIMEOUT_S * len(ms) + 30)
            out = r.stdout + r.stderr
        except Exception as e:   # noqa: BLE001 - the verdict stands without these stacks; say why
            return {m.rank: f"(no stacks: running py-spy on {node.name} failed: {type(e).__name__}: {e})\n" for m in ms}
        texts, rank, lines = {}, None, []
        for line in out.splitlines():
            if line.startswith("@@V4_RANK "):
                rank, lines = int(line.split()[1]), []
            elif line.startswith("@@V4_RC ") and rank is not None:
                rc = line.split()[1]
                text = "\n".join(lines) + "\n"
                if rc != "0":
                    text += (f"(py-spy exited with {rc}: it needs to ptrace the rank -- root, or CAP_SYS_PTRACE in a "
                             "container; 127: py-spy is not installed beside the rank's Python)\n")
                texts[rank], rank = text, None
            elif rank is not None:
                lines.append(line)
        return texts


def describe(h: Hang) -> str:
    """One paragraph a person reads: the rank that did not arrive, where everyone stood, where the stacks are."""
    def at(r: RankLast) -> str:
        return f"step {r.step} {r.phase!r}" if r.seq is not None else "no heartbeat"
    by_rank = {r.rank: r for r in h.ranks}
    ahead = [r for r in h.ranks if r.rank not in h.behind]
    if h.behind:
        who = ", ".join(str(r) for r in h.behind)
        lead = (f"rank{'s' if len(h.behind) > 1 else ''} {who} did not arrive (last mark: "
                + "; ".join(f"rank {r} {at(by_rank[r])}" for r in h.behind) + ")"
                + (f", the others wait at {_summary(ahead)}" if ahead else ""))
        files = ", ".join(f"rank{r}.txt" for r in h.behind)
    else:
        lead = f"every rank stopped at {_summary(h.ranks)} (a collective none returned from, or between two marks)"
        files = "rank<N>.txt"
    return (f"{lead}; no progress for {h.stalled_s:.0f} s (PRESET_HANG_TIMEOUT={h.timeout_s:g}). Every rank's Python "
            f"stacks: {h.stacks_dir}/ ({files} first)")


def _summary(ranks: list[RankLast]) -> str:
    where: dict[str, list[int]] = {}
    for r in ranks:
        where.setdefault(f"step {r.step} {r.phase!r}" if r.seq is not None else "no heartbeat", []).append(r.rank)
    return "; ".join(f"{k} (rank{'s' if len(v) > 1 else ''} {_ranges(v)})" for k, v in where.items())


def _ranges(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5": 64 ranks stay one line."""
    out, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            out.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ", ".join(out)


def _nodes(cfg) -> list:
    from launcher.nodes import nodes_from_config
    try:
        return nodes_from_config(cfg)
    except Exception:   # noqa: BLE001 - no cluster nodes to reach: this machine's ranks can still be dumped
        return []


def _node_for(nodes, ip: str, host: str):
    """The Node a rank runs on: the cluster's node of that address, else this machine (loopback, our hostname)."""
    for n in nodes:
        if n.name == ip:
            return n
    if ip.startswith("127.") or host == socket.gethostname():
        from launcher.nodes import LocalNode
        return LocalNode(name=host)
    return None


# ---------------------------------------------------------------------------------------------- the hooks
def wait_process(proc: subprocess.Popen, timeout_s: float, dog: Watchdog | None) -> int:
    """`proc.wait(timeout_s)`, polling `dog` meanwhile: the exit code; subprocess.TimeoutExpired past the deadline;
    Hung when the watchdog declares a hang (the caller stops the process group)."""
    if dog is None:
        return proc.wait(timeout=timeout_s)
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise subprocess.TimeoutExpired(proc.args, timeout_s)
        try:
            return proc.wait(timeout=min(left, dog.poll_s))
        except subprocess.TimeoutExpired:
            pass
        hang = dog.poll()
        if hang is not None:
            raise Hung(hang)


def hang_error(step: str, hang: dict):
    """The Timeout (exit 124) a hung step ends the run with."""
    from launcher.errors import Timeout
    h = Hang.model_validate(hang)
    look = (f"{h.stacks_dir}/rank{h.behind[0]}.txt shows where rank {h.behind[0]} is" if h.behind else
            f"the stacks in {h.stacks_dir}/ show which collective every rank is in")
    return Timeout(f"{step}: hung -- {h.message}",
                   fix=f"{look}; if that stretch is legitimately slow (a checkpoint save of a large model), raise "
                       f"PRESET_HANG_TIMEOUT (--set PRESET_HANG_TIMEOUT=SECONDS)")
