"""Shared by every test directory: GPU tests that run in the pytest process give their cached GPU memory back
when they end, so that a later GPU test's subprocess (a `v4 run`, whose preflight refuses a GPU that another
process holds memory on) finds the device free."""
from __future__ import annotations

import gc
import signal
import sys

import pytest

# A shell starts a background command with SIGINT ignored, and an ignored signal stays ignored across exec: every
# launcher a test interrupts with SIGINT (as Ctrl-C) would then never see it. The tests' processes start from Python's
# own handler whatever started pytest.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(autouse=True)
def _release_gpu_memory(request):
    yield
    torch = sys.modules.get("torch")
    if request.node.get_closest_marker("gpu") and torch is not None and torch.cuda.is_initialized():
        gc.collect()
        torch.cuda.empty_cache()
