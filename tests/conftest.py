"""Shared by every test directory: each test leaves the process environment as it found it, and GPU tests that run
in the pytest process give their cached GPU memory back when they end, so that a later GPU test's subprocess (a
`v4 run`, whose preflight refuses a GPU that another process holds memory on) finds the device free."""
from __future__ import annotations

import gc
import os
import signal
import sys

import pytest

# A shell starts a background command with SIGINT ignored, and an ignored signal stays ignored across exec: every
# launcher a test interrupts with SIGINT (as Ctrl-C) would then never see it. The tests' processes start from Python's
# own handler whatever started pytest.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(autouse=True)
def _restore_environment():
    """os.environ as it was before the test, whatever the test (or the code it calls in this process) set: every
    subprocess a later test starts inherits it. dsv4.procenv called here sets OMP_NUM_THREADS and the compile-cache
    variables, a harness sets OMP_NUM_THREADS before it spawns ranks; left behind, OMP_NUM_THREADS=2 made each rank
    of every later two-rank run use two threads (dsv4/megatron/train.py gives a CPU rank one where the variable is
    unset), and those runs ~1.6 times slower than alone."""
    before = dict(os.environ)
    yield
    for key in [k for k in os.environ if k not in before]:
        del os.environ[key]
    for key, value in before.items():
        if os.environ.get(key) != value:
            os.environ[key] = value


@pytest.fixture(autouse=True)
def _release_gpu_memory(request):
    yield
    torch = sys.modules.get("torch")
    if request.node.get_closest_marker("gpu") and torch is not None and torch.cuda.is_initialized():
        gc.collect()
        torch.cuda.empty_cache()
