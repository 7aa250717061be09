"""One rank of a parallel layout on one device (dsv4/megatron/rankshape.py, `v4 bench step --rank-of`): the layout's
spelling, the layers a slice stands for, the tokens per local expert, and the TP stand-in against rank 0 of a real
two-process TP2 EP2 world (the same parameters and the same GEMM input shapes)."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from dsv4.config import ModelConfig
from dsv4.megatron.rankshape import RankLayout, rank_shape, slice_layers

ROOT = Path(__file__).resolve().parents[2]
FLASH_SPLIT = (4, 6, 6, 6, 6, 6, 6, 3)        # presets/full.env: FIRST=4 LAST=3 over PP8


def test_the_layout_spelling():
    lay = RankLayout.parse("TP=8 PP=8 EP=8 FIRST=4 LAST=3")
    assert (lay.tp, lay.pp, lay.ep, lay.dp, lay.world, lay.first, lay.last) == (8, 8, 8, 1, 64, 4, 3)
    assert RankLayout.parse("ep=8").dp == 8                          # EP must divide DP x TP: eight data ranks
    assert str(RankLayout.parse("EP=8")) == "TP1 PP1 EP8 (DP8, 8 GPUs)"
    for bad in ("TP8", "XP=2", "TP=0", "TP=two"):
        with pytest.raises(ValueError, match="--rank-of"):
            RankLayout.parse(bad)


def test_a_slice_holds_every_attention_kind_and_both_routings():
    flash = ModelConfig.preset("flash")
    ids, left_out = slice_layers(flash, 6)
    assert ids == [0, 2, 3, 4, 5, 6] and not left_out         # window/hash, csa/hash, hca, then the model's mix
    assert {(flash.attn_kind(i), flash.is_hash_layer(i)) for i in ids} == {
        ("window", True), ("csa", True), ("hca", False), ("csa", False)}
    ids, left_out = slice_layers(flash, 2)
    assert ids == [0, 2] and left_out == [("hca", "score"), ("csa", "score")]


def test_rank_0_of_the_flash_layouts():
    flash = ModelConfig.preset("flash")
    lay = RankLayout.parse("TP=8 PP=8 EP=8 FIRST=4 LAST=3")
    rank = rank_shape(flash, lay, FLASH_SPLIT, seq_len=4096)
    cfg = rank.model_config()
    assert (cfg.n_layers, cfg.n_mtp_layers, cfg.n_routed_experts, cfg.n_hash_layers) == (6, 1, 32, 2)
    assert cfg.compress_ratios == [0, 4, 128, 4, 128, 4, 0]
    assert rank.flops_config().n_routed_experts == 256 and rank.flops_share == 1 / 8
    # TP8 with ETP1: each rank routes its 512 positions; 8 EP ranks x 512 x 6 / 256 rows reach a local expert
    assert rank.tokens_per_expert(4096, 1) == 96
    # the EP-8 rank: 32 local experts, 768 tokens each a 4096-token micro-batch, 1536 at two
    ep8 = rank_shape(flash, RankLayout.parse("EP=8 PP=8 FIRST=4 LAST=3"), FLASH_SPLIT, seq_len=4096)
    assert ep8.tokens_per_expert(4096, 1) == 768 and ep8.tokens_per_expert(4096, 2) == 1536
    last = rank_shape(flash, lay, FLASH_SPLIT, stage="last")
    assert last.layer_ids == (40, 41, 42) and last.mtp
    first = rank_shape(flash, lay, FLASH_SPLIT, stage="first")
    assert first.layer_ids == (0, 1, 2, 3) and not first.mtp and first.model_config().n_hash_layers == 3
    with pytest.raises(ValueError, match="CP=2"):
        rank_shape(flash, RankLayout.parse("CP=2 EP=8 PP=8 FIRST=4 LAST=3"), FLASH_SPLIT, seq_len=4096)
    with pytest.raises(ValueError, match="fewer than top-6"):
        rank_shape(flash, RankLayout.parse("EP=64"), (43,))
    with pytest.raises(ValueError, match="without tensor parallelism"):
        rank_shape(flash, lay, FLASH_SPLIT, train=False)


# ------------------------------------------------------------------------------------------ the TP stand-in
def _shapes(stage, ids) -> tuple[dict, dict]:
    """(parameter shapes, input shape of every Linear and router called in one forward) of a stage."""
    from dsv4 import model as ref
    seen, handles = {}, []

    def hook(name):
        def record(module, args):
            seen.setdefault(name, tuple(args[0].shape))
        return record
    for name, mod in stage.named_modules():
        if isinstance(mod, (ref.Linear, ref.Gate)) and ".experts." not in name:       # expert rows: routing's
            handles.append(mod.register_forward_pre_hook(hook(name)))
    with torch.no_grad():
        stage(ids, ids, torch.ones(ids.shape, dtype=torch.float32))
    for h in handles:
        h.remove()
    params = {n: tuple(p.shape) for n, p in stage.named_parameters() if ".gate." not in n}
    return params, seen


def _real_rank(rank: int, port: int, out: str) -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    from dsv4.megatron.model import Objective, model_provider
    from dsv4.megatron.parallel import Layout, init_parallel
    from dsv4.megatron.train import init_distributed
    init_distributed(rank, 2, "gloo", "cpu", "127.0.0.1", port)
    layout = Layout(tp=2, ep=2)
    init_parallel(layout, 0)
    spec = json.loads(Path(out, "spec.json").read_text())
    cfg = ModelConfig(**spec["cfg"])
    stage = model_provider(cfg, layout, Objective(mtp_coeff=0.3))
    stage.init_weights(0)
    shapes = _shapes(stage, torch.tensor(spec["ids"]))
    if rank == 0:
        torch.save(shapes, Path(out, "real.pt"))


@pytest.mark.slow
def test_the_tp_stand_in_builds_and_runs_rank_0_of_a_real_tp2_ep2_world(tmp_path):
    from dsv4.megatron.launch import free_port

    tiny = ModelConfig.preset("tiny")
    rank = rank_shape(tiny, RankLayout.parse("TP=2 EP=2"), (4,), layers=3, seq_len=32)
    ids = torch.randint(0, tiny.vocab_size, (1, 32), generator=torch.Generator().manual_seed(0))
    (tmp_path / "spec.json").write_text(json.dumps({"cfg": rank.flops_config().to_dict(), "ids": ids.tolist()}))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_real_rank, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    real_params, real_inputs = torch.load(tmp_path / "real.pt")

    script = f"""
import json, torch, warnings
warnings.filterwarnings("ignore")
from tests.megatron.test_rankshape import _shapes
from dsv4.config import ModelConfig
from dsv4.megatron import rankshape
from dsv4.megatron.launch import free_port
from dsv4.megatron.model import Objective, model_provider
from dsv4.megatron.parallel import Layout, init_parallel
from dsv4.megatron.train import init_distributed
from dsv4.megatron.rankshape import RankLayout, rank_shape
rank = rank_shape(ModelConfig.preset("tiny"), RankLayout.parse("TP=2 EP=2"), (4,), layers=3, seq_len=32)
spec = json.load(open({str(tmp_path / 'spec.json')!r}))
init_distributed(0, 1, "gloo", "cpu", "127.0.0.1", free_port())
init_parallel(Layout(), 0)
with rankshape.standin(2):
    stage = model_provider(rank.model_config(), Layout(), Objective(mtp_coeff=0.3))
    stage.init_weights(0)
    shapes = _shapes(stage, torch.tensor(spec["ids"]))
torch.save(shapes, {str(tmp_path / 'standin.pt')!r})
"""
    r = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))})
    assert r.returncode == 0, r.stderr[-3000:]
    params, inputs = torch.load(tmp_path / "standin.pt")
    assert params == real_params                    # heads, groups, shared expert and vocabulary: rank 0's slices
    assert inputs == real_inputs                    # every GEMM and router sees rank 0's token counts
    assert inputs["layers.0.ffn.gate"] == (16, tiny.dim)           # the router on the rank's 32 / 2 positions
    assert inputs["layers.0.attn.wq_a"] == (1, 32, tiny.dim)       # the replicated projections on all 32


@pytest.mark.slow
def test_bench_step_times_a_rank_and_records_it(tmp_path):
    """`v4 bench step --rank-of` on a CPU: the report says which rank of which layout the row stands for, the
    tokens its local experts saw, that communication is absent, and the record it appends carries all of it."""
    r = subprocess.run([sys.executable, "-m", "launcher", "bench", "step", "--rank-of", "TP=2 PP=2 EP=2",
                        "--layers", "3", "--steps", "1", "--warmup", "1", "--record", "rank_test",
                        "--records-dir", str(tmp_path), "--json"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads(r.stdout)
    rank = rep["rank"]
    assert rank["layout"] == "TP2 PP2 EP2 (DP1, 4 GPUs)" and rank["stage"] == "mixed" and rank["mtp"]
    assert rank["layer_kinds"] == ["window/hash", "csa/score", "hca/score"]
    assert (rank["heads"], rank["local_experts"], rank["routed_tokens"]) == (2, 4, 32)
    assert rank["communication"] == "absent" and rank["flops_share"] == 0.5
    assert rep["routing"]["tokens_per_expert_mean"] == rank["tokens_per_expert"] == 16
    row = rep["rows"][0]
    assert math.isfinite(row["loss"]) and row["tokens_per_s"] > 0
    wall = row["profiled_wall_s"] * 1e3
    assert abs(row["parts_ms"] - wall) <= 0.02 * wall
    assert "communication absent" in r.stderr
    records = [json.loads(line) for line in (tmp_path / "train_step.jsonl").read_text().splitlines()]
    assert [x["benchmark"] for x in records] == ["rank_test"]
    rec = records[0]
    assert rec["rank"]["layout"] == rank["layout"] and rec["profile"]["parts"]["expert GEMMs"] > 0
    assert rec["command"].startswith("v4 bench step --rank-of") and rec["date"]
    assert "communication absent" in rec["note"]
    assert math.isfinite(rec["metrics"]["loss_fixed_batch"])
