"""Run Triton kernels on the CPU in Triton's interpreter, in a subprocess: TRITON_INTERPRET=1 must be set before
Triton is imported. `interpret(code, case)` runs `code` (which reads json `case` from sys.argv[1] and prints a json
line last) and returns that line, parsed.

Triton 3.6's interpreter turns a runtime scalar into a Python int with int() of a one-element array, which
numpy >= 2.3 refuses; a loop with runtime bounds needs it. Patched here, for the interpreter only."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_PATCH = r"""
from triton.runtime import interpreter as _it
_orig = _it._patch_lang_tensor
def _patched(tensor, scope):
    _orig(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))
_it._patch_lang_tensor = _patched
"""


def interpret(code: str, case: dict) -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}
    out = subprocess.run([sys.executable, "-c", _PATCH + code, json.dumps(case)], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])
