"""Make megatron-core 0.19.2 run on CPU processes joined by gloo.

megatron-core assumes a CUDA device in a handful of places that our training path reaches: buffers
allocated on `torch.cuda.current_device()` or on the literal "cuda", the RNG tracker, stream/event
bookkeeping, and all_to_all-v split sizes. None of it is essential to the math, so on a machine
without a GPU we redirect each one to its CPU equivalent. `install()` applies all patches once per
process and only when no CUDA device is in use; on a GPU it does nothing, so the same training code
runs unchanged on both.

Each patch below says what breaks without it (measured with megatron-core 0.19.2, torch 2.11).
"""
from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode

_installed = False


def cuda_in_use(device: str | None = None) -> bool:
    """True when this process trains on a GPU: `device` ("cpu"/"cuda") when given, else availability."""
    if device is not None:
        return device.startswith("cuda")
    return torch.cuda.is_available()


def install(device: str | None = None) -> bool:
    """Apply every CPU patch (idempotent). Returns True when the shim is active in this process."""
    global _installed
    if cuda_in_use(device):
        return False
    if _installed:
        return True
    _patch_device_queries()
    _patch_rng()
    _patch_streams_and_events()
    _patch_memory_stats()
    _patch_all_to_all_split_sizes()
    _DeviceRedirect().__enter__()   # stays pushed for the life of the process, like set_default_device
    _installed = True
    return True


# 1. Devices. DDP grad buffers, pipeline p2p receive buffers, the global memory buffer and the
#    MoE all_to_all output are allocated with device=torch.cuda.current_device(); the schedules count
#    tokens in torch.zeros(..., device="cuda"). Without a driver both raise "Found no NVIDIA driver".
#    current_device() answers "cpu" (a valid device argument, and it keeps working inside autograd
#    backward, where the engine does not carry Python torch-function modes over), and a
#    torch-function mode turns the remaining CUDA device arguments (the string, an index, a
#    torch.device, `.cuda()`) into "cpu" in the forward and optimizer code.
def _patch_device_queries() -> None:
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.set_device = lambda *a, **k: None
    torch.cuda.device_count = lambda: 0


def _is_cuda(dev) -> bool:
    if isinstance(dev, torch.device):
        return dev.type == "cuda"
    if isinstance(dev, str):
        return dev.startswith("cuda")
    return isinstance(dev, int) and not isinstance(dev, bool)


class _DeviceRedirect(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs = {**kwargs, "device": "cpu"}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        out = func(*args, **kwargs)
        if func is torch.Tensor.type and len(args) == 1 and not kwargs and out.startswith("torch."):
            out = out.replace("torch.", "torch.cuda.", 1)   # see 1b below
        return out


# 1b. The optimizers sort parameters into fp32 / half groups by their type string, accepting only
#     'torch.cuda.FloatTensor', 'torch.cuda.BFloat16Tensor', ... (optimizer.py, distrib_optimizer.py,
#     and an assert in clip_grads.py). A CPU tensor's `.type()` therefore answers with the CUDA
#     spelling of the same dtype.


# 2. RNG. model_parallel_cuda_manual_seed and the tracker's fork() (around dropout, and at init when
#    weights are initialised on the device) read and write the CUDA generator. On CPU the default CPU
#    generator plays its role, so forked regions still draw from their own seeded stream and the
#    caller's stream is restored afterwards. (fork() then logs "CPU RNG state changed within GPU RNG
#    context" when the region drew numbers: expected here, as both generators are the same one.)
def _patch_rng() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    torch.cuda.set_rng_state = lambda new_state, device="cuda": torch.set_rng_state(new_state)
    # The CPU generator itself, not torch.manual_seed: that one also calls torch.cuda.manual_seed_all.
    torch.cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    mrandom._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: (
        torch.get_rng_state().clone() if clone else torch.get_rng_state())
    mrandom._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state)


# 3. Streams and events. The DDP overlap path, the pipeline p2p code and the MoE dispatchers create
#    side streams and record/wait events; CPU ops are synchronous, so ordering is already guaranteed
#    and these become no-ops.
class _NullStream:
    def __init__(self, *a, **k): pass
    def wait_stream(self, *a, **k): pass
    def wait_event(self, *a, **k): pass
    def record_event(self, event=None): return event or _NullEvent()
    def synchronize(self): pass
    def query(self): return True


class _NullEvent:
    def __init__(self, *a, **k): pass
    def record(self, *a, **k): pass
    def wait(self, *a, **k): pass
    def synchronize(self): pass
    def query(self): return True
    def elapsed_time(self, other): return 0.0


def _patch_streams_and_events() -> None:
    torch.cuda.Stream = _NullStream
    torch.cuda.Event = _NullEvent
    torch.cuda.current_stream = lambda *a, **k: _NullStream()
    torch.cuda.default_stream = lambda *a, **k: _NullStream()
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.empty_cache = lambda: None
    torch.cuda.nvtx.range_push = lambda *a, **k: None
    torch.cuda.nvtx.range_pop = lambda *a, **k: None


# 4. Memory statistics. Megatron's memory reports call torch.cuda.memory_*; on CPU they report 0.
#    (Our metrics measure CPU peak memory themselves, see dsv4.megatron.train.peak_memory_gb.)
def _patch_memory_stats() -> None:
    for name in ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved"):
        setattr(torch.cuda, name, lambda *a, **k: 0)
    torch.cuda.reset_peak_memory_stats = lambda *a, **k: None


# 5. all_to_all-v. The NCCL backend takes split sizes as tensors or lists; gloo's all_to_all_single
#    wants plain Python ints, and the MoE dispatcher hands it tensors (on CPU: "split sizes must be a
#    list"). Convert before calling through.
def _patch_all_to_all_split_sizes() -> None:
    import torch.distributed as dist
    orig = dist.all_to_all_single
    if getattr(orig, "_dsv4_cpu_shim", False):
        return

    def _as_list(sizes):
        if sizes is None or isinstance(sizes, list):
            return sizes
        return [int(s) for s in (sizes.tolist() if torch.is_tensor(sizes) else sizes)]

    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, *a, **k):
        return orig(output, input, _as_list(output_split_sizes), _as_list(input_split_sizes), *a, **k)

    all_to_all_single._dsv4_cpu_shim = True
    dist.all_to_all_single = all_to_all_single
