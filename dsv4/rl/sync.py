"""Weight sync between the trainer and a rollout engine (the engine's side, for now: joining a weight-update
group and receiving broadcast tensors).

A weight-update group is a process group of its own, not torch.distributed's default one: the trainer already
owns a default group (its data/tensor/pipeline ranks), and the engine may live in another process or on
another node. Rank 0 is the trainer's sender and hosts the rendezvous store; engine ranks start at
`rank_offset`, as in SGLang's `init_weights_update_group`.

Where the group listens: torch's TCPStore binds its port on every interface whatever address it is given, and
gloo listens on the address the host name resolves to. With a loopback `master_address` both are bound to
loopback here instead, so a group between processes of one host opens nothing another host can reach (the
store has no authentication). Any other address keeps torch's behaviour. NCCL's own bootstrap socket follows
NCCL_SOCKET_IFNAME, which this module does not set.
"""
from __future__ import annotations

import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from dsv4.megatron.launch import listen_socket, loopback_address, served_store
from dsv4.rl.api import WEIGHT_DTYPES

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16,
          "float8_e4m3fn": torch.float8_e4m3fn, "float8_e8m0fnu": torch.float8_e8m0fnu, "int32": torch.int32,
          "int64": torch.int64, "uint8": torch.uint8}
assert tuple(DTYPES) == WEIGHT_DTYPES       # the request schema's names (dsv4.rl.api) and these are one list


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def weight_group(master_address: str, master_port: int, rank: int, world_size: int, backend: str = "gloo",
                 group_name: str = "weight_update_group", timeout_s: float = 300.0,
                 listener: socket.socket | None = None):
    """Join (rank > 0) or host (rank 0) a process group of `world_size` ranks outside the default group.
    listener: rank 0's socket from `listen_socket(master_address)`, bound before its port was told to the other
    members, so that nothing took the port in between (dsv4/megatron/launch.py)."""
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend {backend!r}: gloo (CPU tensors) or nccl (CUDA tensors)")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside [0, world_size={world_size})")
    timeout = timedelta(seconds=timeout_s)
    local = loopback_address(master_address)
    if rank == 0:
        store = served_store(listener or listen_socket(master_address, int(master_port), world_size), world_size,
                             timeout_s)
    else:
        store = dist.TCPStore(master_address, int(master_port), world_size, is_master=False, timeout=timeout)
    store = dist.PrefixStore(group_name, store)
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=local) if local is not None
                         else dist.ProcessGroupGloo.create_default_device()]
        return dist.ProcessGroupGloo(store, rank, world_size, opts)
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, world_size, opts)


def broadcast(group, tensor: torch.Tensor, src: int = 0) -> None:
    """Broadcast in place. FP8 tensors travel as their bytes (gloo has no float8 type; the view shares storage,
    so the receiver's tensor is filled all the same)."""
    if tensor.dtype in (torch.float8_e4m3fn, torch.float8_e8m0fnu):
        tensor = tensor.view(torch.uint8)
    opts = dist.BroadcastOptions()
    opts.rootRank = src
    group.broadcast([tensor], opts).wait()


def receive_broadcast(group, names: list[str], dtypes: list[str], shapes: list[list[int]], device):
    """The engine's side of one bucket: receive each tensor from rank 0, in order -> [(name, tensor)]."""
    out = []
    for name, dt, shape in zip(names, dtypes, shapes):
        if dt not in DTYPES:
            raise ValueError(f"{name}: dtype {dt!r} is not one of {', '.join(DTYPES)}")
        # gloo moves CPU tensors only: receive on the host, the engine copies them to its device
        where = "cpu" if isinstance(group, dist.ProcessGroupGloo) else device
        t = torch.empty(shape, dtype=DTYPES[dt], device=where)
        broadcast(group, t)
        out.append((name, t))
    return out
