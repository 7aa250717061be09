"""torch's fused Adam, which the trainer puts in place of the foreach kernels megatron builds on CUDA
(`train._fuse_adam`), makes the same updates: the tiny model trained three steps each way in one gloo process
(torch's fused kernels run on the CPU too, so the swap itself is exercised here): the first update agrees to
round-off and the losses of three steps to 1e-5, and a fused run saved after one
step and loaded into a fresh trainer continues exactly as the uninterrupted one."""
from __future__ import annotations

import math
import os
import warnings
from pathlib import Path

import torch
import torch.multiprocessing as mp

from mt_harness import Spec, free_port, global_batch


def _worker(rank: int, port: int, out_dir: str) -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    from dsv4.config import ModelConfig
    from dsv4.megatron.parallel import Layout, init_parallel
    from dsv4.megatron.train import TrainConfig, Trainer, _fuse_adam, init_distributed, split_micro_batches
    init_distributed(0, 1, "gloo", "cpu", "127.0.0.1", port)
    cfg = ModelConfig.preset("tiny")
    spec = Spec("one")
    mbs = split_micro_batches(global_batch(spec, cfg.vocab_size), 1)

    def trainer(fused: bool) -> Trainer:
        tc = TrainConfig(model=cfg, layout=Layout(), seq_len=spec.seq_len, global_batch_size=2, lr=1e-3,
                         num_steps=3)
        init_parallel(tc.layout, tc.seed)
        tr = Trainer(tc)
        if fused:
            _fuse_adam(tr.optimizer)
        return tr

    def inner(tr: Trainer) -> list:
        return [o.optimizer for o in getattr(tr.optimizer, "chained_optimizers", [tr.optimizer])]

    out = {}
    for fused in (False, True):
        tr = trainer(fused)
        groups = [g for o in inner(tr) for g in o.param_groups]
        losses = [tr.step(mbs).loss]
        params = {k: v.detach().float().clone() for k, v in tr.stage.state_dict().items()
                  if torch.is_tensor(v) and v.is_floating_point()}
        losses += [tr.step(mbs).loss for _ in range(2)]
        out[fused] = {"losses": losses, "fused": all(g["fused"] for g in groups), "params": params}
        if fused:
            tr.close()
            del tr
            tr = trainer(True)
            tr.step(mbs)
            tr.save(Path(out_dir) / "ckpt")
            again = trainer(False)
            again.load(Path(out_dir) / "ckpt" / f"iter_{1:07d}")
            _fuse_adam(again.optimizer)
            out["steps_on_device"] = all(torch.is_tensor(s["step"]) and s["step"].dtype == torch.float32
                                         for o in inner(again) for s in o.state.values())
            out["resumed"] = [again.step(mbs).loss for _ in range(2)]
            again.close()
        tr.close()
        del tr
    torch.save(out, Path(out_dir) / "result.pt")


def test_fused_adam_trains_as_foreach_and_resumes(tmp_path):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_worker, args=(free_port(), str(tmp_path)), nprocs=1, join=True)
    r = torch.load(tmp_path / "result.pt")
    foreach, fused = r[False], r[True]
    assert fused["fused"] and not foreach["fused"]
    assert all(math.isfinite(x) for x in foreach["losses"] + fused["losses"] + r["resumed"]), r
    for a, b in zip(foreach["losses"], fused["losses"]):
        assert abs(a - b) <= 1e-5 * max(1.0, abs(a)), (foreach["losses"], fused["losses"])
    # the first update agrees to fp32 round-off (later ones drift apart as any two orders of summation do)
    for k, p in foreach["params"].items():
        q = fused["params"][k]
        assert torch.isfinite(q).all(), k
        assert torch.allclose(p, q, rtol=1e-6, atol=1e-7), (k, (p - q).abs().max())
    # the fused run saved after step 1 and reloaded: steps 2 and 3 as the uninterrupted fused run's
    assert r["steps_on_device"]
    for a, b in zip(fused["losses"][1:], r["resumed"]):
        assert abs(a - b) <= 1e-6 * max(1.0, abs(a)), (fused["losses"], r["resumed"])
