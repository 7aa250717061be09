"""Import megatron-core without importing torch's compiler.

megatron-core decorates a dozen fusions (`megatron.core.jit.jit_fuser`, which is `torch.compile`) as its package is
imported, and `torch.compile` imports dynamo and inductor to build each wrapper: about 3 s of the 6 s that
`import megatron.core` takes on a 2-core CPU machine (torch 2.11, megatron-core 0.19; 2.2-3.1 s with this module),
paid again by every training, conversion and NaN-bisect process, though our model calls none of those fusions.

`install()` puts a finder on `sys.meta_path` that, for the one import of `megatron.core`, runs its package code with
`torch.compile` standing as `deferred_compile`: the same call, made by the wrapper the first time the decorated
function runs. A fusion that does run is compiled as before, only later; nothing else in the process sees the
stand-in (torch.compile is itself again once megatron.core's import returns). Measure it with
`python -X importtime -c "import dsv4.megatron, megatron.core"`, with and without the `dsv4.megatron`.
"""
from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys


def deferred_compile(model=None, **kwargs):
    """torch.compile(model, **kwargs), made when the result is first called (a module is compiled at once)."""
    import torch
    if model is None:                       # used as @torch.compile(...) with arguments
        return lambda fn: deferred_compile(fn, **kwargs)
    real = _torch_compile or torch.compile
    if isinstance(model, torch.nn.Module) or not callable(model):
        return real(model, **kwargs)
    compiled = None

    @functools.wraps(model)
    def run(*args, **kw):
        nonlocal compiled
        if compiled is None:
            compiled = real(model, **kwargs)
        return compiled(*args, **kw)
    return run


_torch_compile = None                      # the real torch.compile, while megatron.core's import runs


class _Loader(importlib.abc.Loader):
    def __init__(self, inner):
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        global _torch_compile
        import torch
        _torch_compile, torch.compile = torch.compile, deferred_compile
        try:
            self.inner.exec_module(module)
        finally:
            torch.compile = _torch_compile

    def __getattr__(self, name):            # resources, source: the file loader's
        return getattr(self.inner, name)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "megatron.core":
            return None
        uninstall()
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


_finder = _Finder()


def install() -> None:
    """Until megatron.core is imported (nothing to do where it already is)."""
    if "megatron.core" not in sys.modules and _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)


def uninstall() -> None:
    if _finder in sys.meta_path:
        sys.meta_path.remove(_finder)
