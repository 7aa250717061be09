"""The CPU shim: what megatron-core needs from "CUDA" answered by the CPU, in a fresh process each
(the patches are process-wide, so they never touch the pytest process)."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import torch
import torch.multiprocessing as mp

import mt_harness as H

ROOT = Path(__file__).resolve().parents[2]


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})


def test_install_patches_devices_types_and_rng():
    p = _python("""
        import torch, torch.distributed as dist
        from dsv4.megatron import cpu_shim
        assert cpu_shim.install("cuda") is False            # a GPU run is left alone
        assert torch.cuda.current_device is torch.cuda.current_device
        assert cpu_shim.install() is True and cpu_shim.install() is True
        assert getattr(dist.all_to_all_single, "_dsv4_cpu_shim", False)
        assert not getattr(dist.all_to_all_single.__wrapped__ if hasattr(dist.all_to_all_single, "__wrapped__") else None, "_dsv4_cpu_shim", False)
        assert torch.zeros(2, device="cuda").device.type == "cpu"
        assert torch.empty(3, device=torch.cuda.current_device()).device.type == "cpu"
        x = torch.ones(2)
        assert x.cuda() is x and x.to("cuda").device.type == "cpu" and x.new_zeros(2, device=0).device.type == "cpu"
        assert x.type() == "torch.cuda.FloatTensor" and x.bfloat16().type() == "torch.cuda.BFloat16Tensor"
        assert x.type(torch.float64).dtype == torch.float64
        torch.cuda.manual_seed(5); a = torch.rand(4)
        torch.cuda.manual_seed(5); b = torch.rand(4)
        assert torch.equal(a, b)
        s = torch.cuda.get_rng_state(); c = torch.rand(4); torch.cuda.set_rng_state(s)
        assert torch.equal(c, torch.rand(4))
        with torch.cuda.stream(torch.cuda.Stream()):
            torch.cuda.current_stream().wait_stream(torch.cuda.Stream())
        e = torch.cuda.Event(); e.record(); e.synchronize()
        print("ok")
    """)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr[-3000:]


def _megatron_smoke(rank: int, world: int, port: int, out: str) -> None:
    """The megatron-core pieces our model uses, on gloo: RNG tracker, SP mappings, all_to_all-v."""
    import warnings
    warnings.filterwarnings("ignore")
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel as tpl
    from dsv4.megatron.train import init_distributed
    init_distributed(rank, world, "gloo", "cpu", "127.0.0.1", port)
    ps.initialize_model_parallel(tensor_model_parallel_size=world, expert_model_parallel_size=world,
                                 expert_tensor_parallel_size=1)
    tpl.model_parallel_cuda_manual_seed(7)
    with tpl.get_cuda_rng_tracker().fork():
        drawn = torch.rand(3)
    x = torch.full((2, 3), float(rank + 1), requires_grad=True)
    g = tpl.gather_from_sequence_parallel_region(x)                     # [2 * world, 3]
    y = tpl.reduce_scatter_to_sequence_parallel_region(g * (rank + 1))  # sum over ranks of (r+1) * g
    y.sum().backward()
    sizes = torch.tensor([rank + 1] * world)                            # tensor split sizes, as MoE code passes
    recv = torch.empty(sum(r + 1 for r in range(world)), dtype=torch.float32)
    torch.distributed.all_to_all_single(recv, torch.full((int(sizes.sum()),), float(rank)),
                                        output_split_sizes=torch.tensor([r + 1 for r in range(world)]),
                                        input_split_sizes=sizes, group=ps.get_expert_model_parallel_group())
    torch.save({"drawn": drawn, "g": g.detach(), "y": y.detach(), "grad": x.grad, "recv": recv},
               f"{out}/smoke{rank}.pt")


def test_megatron_core_smoke_world_2(tmp_path):
    for world in (2,):
        mp.spawn(_megatron_smoke, args=(world, H.free_port(), str(tmp_path)), nprocs=world, join=True)
        r = [torch.load(tmp_path / f"smoke{k}.pt") for k in range(world)]
        s = sum(k + 1 for k in range(world))
        for k, d in enumerate(r):
            assert torch.isfinite(d["drawn"]).all() and torch.isfinite(d["grad"]).all()
            assert torch.equal(d["g"], torch.cat([torch.full((2, 3), float(j + 1)) for j in range(world)]))
            assert torch.equal(d["y"], torch.full((2, 3), float(s * (k + 1))))
            assert torch.equal(d["grad"], torch.full((2, 3), float(s)))   # d/dx sum_r (r+1) sum(gather(x))
            assert torch.equal(d["recv"], torch.cat([torch.full((j + 1,), float(j)) for j in range(world)]))
