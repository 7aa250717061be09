"""megatron-core imported through dsv4.megatron builds its fusions' torch.compile wrappers only when they first run
(dsv4/megatron/mcore_import.py): the import leaves dynamo unimported and torch.compile itself, and a deferred
function still compiles and computes what the function does."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import sys
import torch
real = torch.compile
import dsv4.megatron
import megatron.core
from megatron.core import jit
from dsv4.megatron.mcore_import import deferred_compile
print("dynamo imported", "torch._dynamo" in sys.modules)
print("torch.compile restored", torch.compile is real)
print("megatron's fuser deferred", jit.jit_fuser is deferred_compile)
f = deferred_compile(lambda x: x * 2 + 1, backend="eager")
print("deferred result", f(torch.ones(3)).tolist(), "torch._dynamo" in sys.modules)
"""


def test_megatron_core_imports_without_torchs_compiler():
    p = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))})
    out = p.stdout
    assert p.returncode == 0, p.stderr[-3000:]
    assert "dynamo imported False" in out and "torch.compile restored True" in out, out
    assert "megatron's fuser deferred True" in out, out
    assert "deferred result [3.0, 3.0, 3.0] True" in out, out       # compiled by dynamo on its first call
