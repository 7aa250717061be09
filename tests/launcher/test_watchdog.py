"""The hang watchdog on real processes writing real heartbeats (dsv4/heartbeat.py): who is named as not arrived,
the py-spy stacks it takes, when it stays quiet. The launcher's clock is a stand-in here, so that "no progress for
the timeout" is a fact of the test, not of the machine's load; the processes and py-spy are real."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from dsv4.heartbeat import Heartbeat, Mark, collective_timeout_s, parse_plant, rank_file
from launcher import watchdog
from launcher.config import Selection, resolve

ROOT = Path(__file__).resolve().parents[2]

# A stand-in rank: passes `marks` marks, then (rank `hang`) sleeps inside the planted hang, or waits as in a
# collective. Prints "ready" once its last mark is written.
RANK = textwrap.dedent("""
    import sys, time
    from dsv4.heartbeat import Heartbeat
    d, rank, world, marks, hang = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    hb = Heartbeat(d, rank, world, "127.0.0.1", plant=hang)
    hb.mark(0, "start")
    for step in range(1, marks):
        hb.mark(step, "step")
    print("ready", flush=True)
    hb.mark(marks, "reduce_losses")          # the planted rank never gets past this
    def waiting_in_a_collective():
        time.sleep(600)
    waiting_in_a_collective()
""")


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


@pytest.fixture
def cfg(tmp_path):
    return resolve(Selection(cluster="local", hw="cpu", sets=(f"V4_WORK={tmp_path / 'work'}",
                                                              "PRESET_HANG_TIMEOUT=30")))


@pytest.fixture
def ranks(tmp_path):
    procs = []

    def start(rank, world, marks, hang=""):
        p = subprocess.Popen([sys.executable, "-c", RANK, str(tmp_path / "heartbeat"), str(rank), str(world),
                              str(marks), hang], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))})
        procs.append(p)
        assert p.stdout.readline().strip() == "ready", p.stderr.read()
        return p
    yield start
    for p in procs:
        p.kill()
        p.wait()


def settled(run_dir, seqs: dict[int, int], timeout=30.0):
    """Wait until each rank's heartbeat shows its last mark (a rank writes it after saying "ready")."""
    deadline = time.monotonic() + timeout
    while {r: m.seq for r, m in watchdog.read_marks(run_dir).items()} != seqs:
        assert time.monotonic() < deadline, watchdog.read_marks(run_dir)
        time.sleep(0.02)


def declared(cfg, run_dir, clock, timeout_s=30.0):
    """Poll as the wait loops do: once to see the heartbeats, then past the timeout."""
    dog = watchdog.Watchdog(cfg, run_dir, timeout_s, clock=clock)
    assert dog.poll() is None
    clock.t += timeout_s / 2
    assert dog.poll() is None                 # no progress, but not for the whole timeout yet
    clock.t += timeout_s / 2 + 1
    return dog.poll()


def test_the_rank_that_did_not_arrive_is_named_with_its_stacks(cfg, tmp_path, ranks):
    ranks(0, 2, 4)                             # waits in the collective (mark 5: reduce_losses of step 4)
    ranks(1, 2, 4, hang="1:4")                 # sleeps before it: last mark 4, step 3
    settled(tmp_path, {0: 5, 1: 4})
    hang = declared(cfg, tmp_path, Clock())
    assert hang is not None and hang.behind == [1] and hang.missing == []
    assert "rank 1 did not arrive" in hang.message and "rank1.txt" in hang.message
    stacks = (tmp_path / "hang" / "rank1.txt").read_text()
    assert "planted_hang" in stacks and "Heartbeat.mark" in stacks and "step 3 'step'" in stacks
    assert "waiting_in_a_collective" in (tmp_path / "hang" / "rank0.txt").read_text()
    record = json.loads((tmp_path / "hang" / "hang.json").read_text())
    assert record["behind"] == [1] and [r["phase"] for r in record["ranks"]] == ["reduce_losses", "step"]
    assert watchdog.Hang.model_validate(record) == hang


def test_a_rank_without_a_heartbeat_is_the_one_missing(cfg, tmp_path, ranks):
    ranks(0, 3, 2)
    ranks(2, 3, 2)
    settled(tmp_path, {0: 3, 2: 3})
    hang = declared(cfg, tmp_path, Clock())
    assert hang.behind == [1] and hang.missing == [1]
    assert "never reached its first mark" in (tmp_path / "hang" / "rank1.txt").read_text()


def test_every_rank_at_the_same_mark_names_none(cfg, tmp_path, ranks):
    ranks(0, 2, 3)
    ranks(1, 2, 3)
    settled(tmp_path, {0: 4, 1: 4})
    hang = declared(cfg, tmp_path, Clock())
    assert hang.behind == [] and "every rank stopped at step 3 'reduce_losses' (ranks 0-1)" in hang.message
    assert all("waiting_in_a_collective" in (tmp_path / "hang" / f"rank{r}.txt").read_text() for r in (0, 1))
    err = watchdog.hang_error("train", hang.model_dump())
    assert err.code == 124 and "which collective" in err.fix


def test_progress_resets_the_clock_and_no_heartbeat_never_fires(cfg, tmp_path):
    clock = Clock()
    dog = watchdog.Watchdog(cfg, tmp_path, 30.0, clock=clock)
    clock.t += 100
    assert dog.poll() is None                  # a job that never writes heartbeats (prepare_data...) is not judged
    hb = Heartbeat(tmp_path / "heartbeat", 0, 1, "127.0.0.1")
    hb.mark(1, "step")
    clock.t += 1
    assert dog.poll() is None
    for _ in range(3):                         # a mark every 20 s: slow, never stalled for 30
        clock.t += 20
        hb.mark(1, "reduce_losses")
        assert dog.poll() is None
    clock.t += 31
    assert dog.poll() is not None


def test_heartbeat_records_and_plants(tmp_path):
    a = Heartbeat(tmp_path, 3, 4, "127.0.0.1")
    a.mark(0, "start")
    b = Heartbeat(tmp_path, 3, 4, "127.0.0.1")       # a second writer in the same process (a fresh Trainer)
    b.mark(7, "save")
    m = Mark.model_validate_json(rank_file(tmp_path, 3).read_bytes())
    assert (m.rank, m.world, m.seq, m.step, m.phase, m.pid, m.ip) == (3, 4, 2, 7, "save", os.getpid(), "127.0.0.1")
    assert Path(m.python) == Path(sys.executable)
    Heartbeat("", 0, 1).mark(1, "step")               # no directory: nothing written, nothing raised
    assert parse_plant("1:2") == (1, 2, "reduce_losses") and parse_plant("0:5:save") == (0, 5, "save")
    for bad in ("1", "a:2", "1:2:nowhere"):
        with pytest.raises(ValueError, match="RANK:STEP|phase"):
            parse_plant(bad)
    assert collective_timeout_s("nccl", 0) is None
    assert collective_timeout_s("nccl", 1800) == 3600 and collective_timeout_s("gloo", 60) == 1800


def test_for_job_is_off_without_a_timeout_and_clears_old_heartbeats(tmp_path):
    Heartbeat(tmp_path / "heartbeat", 0, 1, "127.0.0.1").mark(1, "step")
    off = resolve(Selection(cluster="local", hw="cpu", sets=("PRESET_HANG_TIMEOUT=0",)))
    assert watchdog.for_job(off, tmp_path) is None
    on = resolve(Selection(cluster="local", hw="cpu", sets=("PRESET_HANG_TIMEOUT=5",)))
    assert watchdog.for_job(on, None) is None
    dog = watchdog.for_job(on, tmp_path, fresh=True)
    assert dog.timeout_s == 5 and not list((tmp_path / "heartbeat").iterdir())


def test_a_resume_may_change_the_hang_timeout():
    """The hang timeout is operational, like PRESET_JOB_TIMEOUT: a run that hung resumes with a longer one."""
    from launcher.registry import RESUME_SAME
    assert "PRESET_HANG_TIMEOUT" not in RESUME_SAME and "PRESET_JOB_TIMEOUT" not in RESUME_SAME
    assert "PRESET_PLANT_HANG" in RESUME_SAME         # a fault injection changes what the run does, as PLANT_NAN
