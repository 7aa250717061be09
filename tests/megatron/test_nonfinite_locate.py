"""How a non-finite step names its first module (TrainConfig.nonfinite_locate), on the tiny model in one gloo
process. By default the hooks on every module are attached only to run a bad step again, before any update: a
fault that repeats is named as before; one that does not repeat (here a test hook that poisons a module's output
the first time only) is reported as such, and `every_step` names it. The weights are the step's own afterwards."""
from __future__ import annotations

import os
import warnings
from pathlib import Path

import torch
import torch.multiprocessing as mp

from mt_harness import Spec, free_port, global_batch

MODULE = "layers.1.attn"


def _once(module):
    """A forward hook that makes `module`'s output NaN on its first call only (a fault that does not repeat)."""
    calls = []

    def hook(mod, args, out):
        calls.append(1)
        return out + float("nan") if len(calls) == 1 else None
    # before the monitor's own hook on the module (every_step attaches it when the trainer is built)
    return module.register_forward_hook(hook, prepend=True), calls


def _worker(rank: int, port: int, out_dir: str) -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    from dsv4.config import ModelConfig
    from dsv4.megatron.parallel import Layout, init_parallel
    from dsv4.megatron.train import TrainConfig, Trainer, init_distributed, split_micro_batches
    init_distributed(0, 1, "gloo", "cpu", "127.0.0.1", port)
    spec = Spec("one")
    cfg = ModelConfig.preset("tiny")
    mbs = split_micro_batches(global_batch(spec, cfg.vocab_size), 1)
    out = {}
    for mode in ("rerun", "every_step", "off"):
        tc = TrainConfig(model=cfg, layout=Layout(), seq_len=spec.seq_len, global_batch_size=2, lr=1e-3,
                         num_steps=2, nonfinite_locate=mode)
        init_parallel(tc.layout, tc.seed)
        tr = Trainer(tc)
        before = {k: v.detach().clone() for k, v in tr.stage.state_dict().items() if torch.is_tensor(v)}
        handle, calls = _once(dict(tr.stage.named_modules())[MODULE])
        res = tr.step(mbs)
        handle.remove()
        after = tr.stage.state_dict()
        out[mode] = {"finite": res.finite, "nonfinite": {k: v for k, v in res.nonfinite.items() if k != "per_rank"},
                     "calls": len(calls), "attached": tr.monitor.attached, "iteration": tr.iteration,
                     "unchanged": all(torch.equal(before[k], after[k]) for k in before)}
        again = tr.step(mbs)                           # the fault is gone: the same step now trains
        out[mode]["then"] = {"finite": again.finite, "loss": again.loss, "iteration": tr.iteration}
        tr.close()
        del tr
    torch.save(out, Path(out_dir) / "result.pt")


def test_a_bad_step_is_located_by_running_it_again(tmp_path):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_worker, args=(free_port(), str(tmp_path)), nprocs=1, join=True)
    r = torch.load(tmp_path / "result.pt")
    for mode, res in r.items():
        assert res["finite"] is False and res["unchanged"] and res["iteration"] == 0, (mode, res)
        assert not res["attached"] or mode == "every_step", (mode, res)
        assert res["then"]["finite"] and res["then"]["iteration"] == 1, (mode, res)
        assert torch.isfinite(torch.tensor(res["then"]["loss"])), (mode, res)
    # rerun: the step ran twice; the fault did not come back, and the report says so instead of naming a module
    rerun = r["rerun"]
    assert rerun["calls"] > r["off"]["calls"], r
    assert rerun["nonfinite"]["module"] is None and rerun["nonfinite"]["located_by"] == "rerun"
    assert "did not repeat" in rerun["nonfinite"]["note"] and "every_step" in rerun["nonfinite"]["note"]
    # every_step watched the first run: it names the module, and the step ran once
    every = r["every_step"]
    assert every["calls"] == r["off"]["calls"]
    assert (every["nonfinite"]["module"], every["nonfinite"]["phase"]) == (MODULE, "forward")
    assert every["nonfinite"]["located_by"] == "every_step"
    assert r["off"]["nonfinite"]["module"] is None and "hooks off" in r["off"]["nonfinite"]["note"]


def test_the_config_key_offers_the_trainers_modes():
    """PRESET_NONFINITE_LOCATE's choices are written in the (torch-free) schema; they must be the trainer's."""
    from dsv4.megatron.train import NONFINITE_LOCATE, TrainConfig
    from launcher.config.schema import SCHEMA
    key = SCHEMA["PRESET_NONFINITE_LOCATE"]
    assert key.choices == NONFINITE_LOCATE and key.default == TrainConfig.nonfinite_locate
