"""Run DSV4 megatron layouts in real process groups (torch.multiprocessing; gloo on the CPU, NCCL with one
GPU a rank on CUDA) and collect what each rank saw: loss, grad norm, reduced gradients (as slices of the
official tensors) and the loss after one optimizer update. Tests compare every layout with one process on
the same global batch, within the tolerances below."""
from __future__ import annotations

import math
import os
import socket
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.multiprocessing as mp


@dataclass
class Spec:
    name: str
    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int = 1
    stage_layers: tuple | None = None
    cp: int = 1
    mtp_coeff: float = 0.3
    indexer_coeff: float = 0.1
    model_overrides: dict = field(default_factory=dict)
    seq_len: int = 32
    micro_batch_size: int = 1
    global_batch_size: int = 2
    distributed_optimizer: bool = False


# fp32 throughout: differences come only from summation order (TP partial sums, DP all-reduce)
LOSS_ATOL = 1e-5
GRAD_ATOL, GRAD_RTOL = 1e-6, 1e-3     # |g - g1| <= ATOL + RTOL * max|g1|, per tensor
NORM_RTOL = 1e-5

WORLD2 = [Spec("tp2", tp=2), Spec("ep2", ep=2), Spec("pp2", pp=2),
          Spec("tp2_ep2_etp1", tp=2, ep=2), Spec("tp2_etp2", tp=2, etp=2)]
WORLD4 = [Spec("tp2_pp2_ep2", tp=2, pp=2, ep=2), Spec("tp2_pp2_distopt", tp=2, pp=2, distributed_optimizer=True)]

# Context parallelism. The tiny model has window 8 and ratios 4 (overlapping, indexer) and 16. At 72 tokens
# CP2 cuts 4 chunks of 18: every window and every ratio-16 block crosses a chunk edge somewhere, and so do
# ratio-4 blocks (18 is not a multiple of 4). At 24 tokens (chunks of 6) a window and a ratio-16 block reach
# back over several chunks, and one rank owns no compressed entry of the ratio-16 layer at all.
CP_SEQ_LONG, CP_SEQ_SHORT = 72, 24
CP_BASE = [Spec(f"w1_s{n}", seq_len=n) for n in (CP_SEQ_LONG, CP_SEQ_SHORT)]
CP_WORLD2 = [Spec(f"cp2_s{n}", cp=2, seq_len=n) for n in (CP_SEQ_LONG, CP_SEQ_SHORT)]
CP_WORLD4 = [Spec("cp2_tp2", cp=2, tp=2, seq_len=CP_SEQ_LONG), Spec("cp2_pp2", cp=2, pp=2, seq_len=CP_SEQ_LONG),
             Spec("cp2_ep2", cp=2, ep=2, seq_len=CP_SEQ_LONG), Spec("cp4", cp=4, seq_len=CP_SEQ_LONG)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def global_batch(spec: Spec, vocab: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    n, S = spec.global_batch_size, spec.seq_len
    tokens = torch.randint(0, vocab, (n, S + 1), generator=g)
    mask = (torch.rand(n, S, generator=g) > 0.25).float()
    mask[:, 0] = 1.0                                                 # every row has a loss token
    return {"tokens": tokens, "loss_mask": mask}


def _worker(rank: int, world: int, port: int, specs: list[Spec], out_dir: str, device: str) -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    os.environ["LOCAL_RANK"] = str(rank)            # init_distributed's GPU for this rank
    from dsv4.config import ModelConfig
    from dsv4.megatron.model import Objective
    from dsv4.megatron.parallel import Layout, init_parallel
    from dsv4.megatron.train import TrainConfig, Trainer, init_distributed, split_micro_batches
    init_distributed(rank, world, "nccl" if device == "cuda" else "gloo", device, "127.0.0.1", port)
    if world == 1 and device == "cpu":
        _reference_check(out_dir)
    for spec in specs:
        cfg = ModelConfig.preset("tiny", indexer_loss_coeff=spec.indexer_coeff, **spec.model_overrides)
        layout = Layout(spec.tp, spec.pp, spec.ep, spec.etp, spec.stage_layers, cp=spec.cp)
        tc = TrainConfig(model=cfg, layout=layout, objective=Objective(spec.mtp_coeff, spec.indexer_coeff),
                         seq_len=spec.seq_len, micro_batch_size=spec.micro_batch_size,
                         global_batch_size=spec.global_batch_size, lr=1e-3, num_steps=2,
                         distributed_optimizer=spec.distributed_optimizer, device=device)
        init_parallel(layout, tc.seed)
        tr = Trainer(tc)
        batch = global_batch(spec, cfg.vocab_size)
        per = spec.global_batch_size // tr.ranks.dp
        mine = {k: v[tr.ranks.dp_rank * per:(tr.ranks.dp_rank + 1) * per] for k, v in batch.items()}
        grads = {}
        # the distributed optimizer leaves each rank only its shard of the reduced gradients: compare losses only
        read = None if spec.distributed_optimizer else (lambda: grads.update(tr.full_grads()))
        first = tr.step(split_micro_batches(mine, spec.micro_batch_size), on_grads=read)
        second = tr.step(split_micro_batches(mine, spec.micro_batch_size))
        torch.save({"rank": rank, "loss": first.loss, "mtp_loss": first.mtp_loss, "grad_norm": first.grad_norm,
                    "finite": first.finite, "loss_after_update": second.loss, "grads": grads},
                   Path(out_dir) / f"{spec.name}.rank{rank}.pt")
        tr.close()
        del tr


def run(specs: list[Spec], world: int, out_dir: Path, device: str = "cpu") -> dict[str, dict]:
    """Run `specs` one after another in `world` processes (one GPU each on cuda); returns {spec name:
    assembled result}."""
    unset = "OMP_NUM_THREADS" not in os.environ
    if unset:                      # for the spawned ranks (they inherit this process's environment), not for later tests
        os.environ["OMP_NUM_THREADS"] = "1"
    try:
        mp.spawn(_worker, args=(world, free_port(), specs, str(out_dir), device), nprocs=world, join=True)
    finally:
        if unset:
            del os.environ["OMP_NUM_THREADS"]
    return {s.name: assemble(out_dir, s.name, world) for s in specs}


def assemble(out_dir: Path, name: str, world: int) -> dict:
    """Merge every rank's gradient slices into whole tensors; replicas must agree exactly."""
    from dsv4.config import ModelConfig
    parts = [torch.load(Path(out_dir) / f"{name}.rank{r}.pt", weights_only=False) for r in range(world)]
    shapes = ModelConfig.preset("tiny").param_shapes()
    grads: dict[str, torch.Tensor] = {}
    filled: dict[str, torch.Tensor] = {}
    for p in parts:
        for key, (index, g) in p["grads"].items():
            if key not in grads:
                grads[key] = torch.zeros(shapes[key])
                filled[key] = torch.zeros(shapes[key], dtype=torch.bool)
            region, seen = grads[key][index], filled[key][index]
            if seen.any():
                assert torch.equal(region[seen], g[seen]), f"{name}: replicas of {key} disagree"
            grads[key][index] = g
            filled[key][index] = True
    for key, f in filled.items():
        assert f.all(), f"{name}: no rank holds part of {key}"
    losses = {(p["loss"], p["grad_norm"], p["loss_after_update"]) for p in parts}
    assert len(losses) == 1, f"{name}: ranks disagree on loss/grad norm: {losses}"
    return {"loss": parts[0]["loss"], "mtp_loss": parts[0]["mtp_loss"], "grad_norm": parts[0]["grad_norm"],
            "loss_after_update": parts[0]["loss_after_update"], "finite": all(p["finite"] for p in parts),
            "grads": grads}


def compare(result: dict, base: dict) -> dict:
    """Largest absolute and relative (to the tensor's max magnitude) gradient differences, and loss diffs."""
    worst_abs, worst_rel, worst_key = 0.0, 0.0, None
    assert set(result["grads"]) == set(base["grads"]), set(result["grads"]) ^ set(base["grads"])
    for key, g0 in base["grads"].items():
        g = result["grads"][key]
        d = (g - g0).abs().max().item()
        rel = d / max(g0.abs().max().item(), 1e-12)
        if d > worst_abs:
            worst_abs = d
        if rel > worst_rel:
            worst_rel, worst_key = rel, key
    return {"loss_abs": abs(result["loss"] - base["loss"]),
            "grad_norm_rel": abs(result["grad_norm"] - base["grad_norm"]) / base["grad_norm"],
            "after_update_abs": abs(result["loss_after_update"] - base["loss_after_update"]),
            "grad_max_abs": worst_abs, "grad_max_rel": worst_rel, "grad_worst_key": worst_key}


def _reference_check(out_dir: str) -> None:
    """World size 1, TP = PP = EP = 1: the megatron stage against dsv4.model.Transformer on the same
    weights and tokens. Records parameter, loss and gradient differences (bitwise expected) in
    reference.pt (run by every world-1 `run`)."""
    import torch.nn.functional as F
    from dsv4 import model as ref
    from dsv4.config import ModelConfig
    from dsv4.megatron.model import Objective, model_provider
    from dsv4.megatron.parallel import Layout, init_parallel
    init_parallel(Layout(), 1)
    cfg = ModelConfig.preset("tiny")
    stage = model_provider(cfg, Layout(), Objective())
    stage.init_weights(cfg.seed)
    R = ref.Transformer(cfg)
    batch = global_batch(Spec("ref", global_batch_size=2, seq_len=64), cfg.vocab_size)
    ids, labels, mask = batch["tokens"][:, :-1], batch["tokens"][:, 1:], batch["loss_mask"]
    ours = stage(ids, labels, mask)[0]
    ours.backward()
    o = R(ids)
    theirs = (F.cross_entropy(o.logits.flatten(0, 1), labels.flatten(), reduction="none").view(ids.shape) * mask).sum()
    theirs.backward()
    rp = dict(R.named_parameters())
    result = {"loss": (ours.item(), theirs.item()), "param_mismatch": [], "grad_mismatch": [], "n_grads": 0}
    for name, p in stage.named_parameters():
        if not torch.equal(p, rp[name]):
            result["param_mismatch"].append(name)
        if p.grad is not None:
            result["n_grads"] += 1
            if not torch.equal(p.grad, rp[name].grad):
                result["grad_mismatch"].append((name, (p.grad - rp[name].grad).abs().max().item()))
    result["finite"] = bool(torch.isfinite(ours)) and all(torch.isfinite(p.grad).all() for p in stage.parameters()
                                                           if p.grad is not None)
    torch.save(result, Path(out_dir) / "reference.pt")


def reference_result(out_dir: Path) -> dict:
    """What _reference_check recorded during a world-1 `run` into `out_dir`."""
    return torch.load(Path(out_dir) / "reference.pt", weights_only=False)


def _roundtrip_worker(rank: int, world: int, port: int, tp: int, ckpt: str, bf16: str, out_dir: str,
                      dtype: str) -> None:
    """Load a converted checkpoint at TP = `tp` and compare every local shard with the BF16 source."""
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    from dsv4.checkpoint import load_state_dict
    from dsv4.config import ModelConfig
    from dsv4.megatron.parallel import Layout, init_parallel, shard_index
    from dsv4.megatron.train import TrainConfig, Trainer, init_distributed
    init_distributed(rank, world, "gloo", "cpu", "127.0.0.1", port)
    cfg = ModelConfig.preset("tiny", dtype=dtype)
    tc = TrainConfig(model=cfg, layout=Layout(tp=tp), seq_len=32, global_batch_size=world // tp)
    init_parallel(tc.layout, tc.seed)
    tr = Trainer(tc, init=None)
    tr.load(Path(ckpt), with_optimizer=False)
    src = load_state_dict(bf16, cfg)
    shapes = cfg.param_shapes()
    bad, n = [], 0
    for key, p, _ in tr.stage.checkpoint_params():
        want = src[key][shard_index(p, shapes[key], tr.ranks)].to(p.dtype)
        n += 1
        if not torch.equal(p.detach(), want):
            bad.append(key)
    torch.save({"checked": n, "mismatch": bad}, Path(out_dir) / f"roundtrip.rank{rank}.pt")


def run_roundtrip(ckpt: Path, bf16: Path, tp: int, out_dir: Path, dtype: str = "fp32") -> list[dict]:
    mp.spawn(_roundtrip_worker, args=(tp, free_port(), tp, str(ckpt), str(bf16), str(out_dir), dtype),
             nprocs=tp, join=True)
    return [torch.load(Path(out_dir) / f"roundtrip.rank{r}.pt") for r in range(tp)]


def check_finite(r: dict) -> None:
    assert r["finite"] and math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) \
        and math.isfinite(r["loss_after_update"])
    assert all(torch.isfinite(g).all() for g in r["grads"].values())


def assert_matches(r: dict, base: dict, name: str) -> dict:
    """Layout `name`'s result against world size 1 within the tolerances above; returns the figures."""
    check_finite(base)
    check_finite(r)
    if r["grads"]:
        figures = compare(r, base)
        for key, g1 in base["grads"].items():
            bound = GRAD_ATOL + GRAD_RTOL * g1.abs().max().item()
            assert (r["grads"][key] - g1).abs().max().item() <= bound, f"{name}: gradient of {key} differs"
    else:   # the distributed optimizer keeps only a shard of each gradient: losses and norm only
        figures = {"loss_abs": abs(r["loss"] - base["loss"]),
                   "grad_norm_rel": abs(r["grad_norm"] - base["grad_norm"]) / base["grad_norm"],
                   "after_update_abs": abs(r["loss_after_update"] - base["loss_after_update"])}
    assert figures["loss_abs"] <= LOSS_ATOL, (name, figures)
    assert figures["grad_norm_rel"] <= NORM_RTOL, (name, figures)
    assert figures["after_update_abs"] <= LOSS_ATOL, (name, figures)
    return figures
