"""Predicted memory and step time of a DeepSeek-V4 training layout, before any GPU is spent on it.

One function, `predict(shape, layout, workload, hardware)`, says what the fullest GPU of a layout holds (by part)
and how long a step takes (by part), from the model config and rates measured on the GPU we have (and
`predict_bench`, the same for the one process `v4 bench step` builds, which it asks before building):

* **Memory per rank.** Weights, gradients (fp32, megatron's main grads), Adam state (fp32 master copy and two
  moments; sharded over the data-parallel ranks with the distributed optimizer, or on the host with offload), each
  parameter placed as `dsv4.megatron` places it (heads, output groups, shared expert and vocabulary split over TP;
  the query/KV projections, compressors, indexer, router, norms and hyper-connections whole on every TP rank;
  experts over EP x ETP; layers over PP stages; MTP and the head on the last stage, the embedding on the first).
  Activations are an inventory of the tensors a block keeps for its backward (the 4 hyper-connection streams and
  their fp32 flattening, the attention's q/o at heads/TP, the compressors' fp32 projections, the MoE dispatch rows
  and expert hidden states, the LM head's fp32 logits or the fused loss's bf16 softmax), sized from the config at a
  rank's shape (sequence over CP, sequence-parallel shards over TP), times the micro-batches the pipeline schedule
  keeps in flight (1F1B: stage s holds PP - s; interleaved more), the grouped GEMM's stacked copy of the local
  experts (one for the step since 80eff6b, one a micro-batch in flight before and on the QAT path; at EP > 1 since
  f338075, where the code before ran one GEMM an expert and stacked nothing), plus the
  largest transient (the indexer's fp32 [S/CP, S/4] scores, which only CP divides; the logits' gradient; one block's
  backward); under FP8 QAT (RL with FP8 sync) the bf16 weight copies out of the QAT point (one for the step since
  c60489a; one a micro-batch in flight before). After the backward, with the activations freed, a finite check of
  the gradient buffers that allocates (torch.isfinite, 7 bytes an element of the largest: the trainer before
  e352e77; today's allocates nothing) is a phase of its own; the peak is the fuller phase. One factor on the
  inventory and one constant workspace are fitted to the measured peaks of the H200 smoke at micro-batch 1 and 2
  (`benchmarks/records/plan_calibration.jsonl`): the inventory is first principles, its scale is measured; so is
  what the process holds outside torch's allocator, which with 3 % fragmentation is what a GPU does not leave
  usable.
* **Time per step.** Compute per rank at rates derived from the H200 smoke's timed step and its profile by part
  (GEMM parts as TFLOP/s, the sparse attention from the TileLang kernels' own records, elementwise work per token
  and layer, a fixed cost per layer and micro-batch from the micro-batch 1 / 2 pair, gradient accumulation and the
  optimizer step as bytes a parameter at the bandwidths their kernels reached, the fused Adam's from a 32-expert
  profile, which also times the split GEMM's halves of the fp32 weights, the experts' wgrad epilogue, the grouped
  GEMM's stacking copy and the LM loss's passes over the logits; eager ops, FP8 QAT (once a step since c60489a) and
  the sync's quantisation, at the host's time an op, or their bytes at the streaming rate where the device is the
  slower, as in the quantisers' 2^24-element chunks on a GPU since 3fd1ccf); TP's sequence-parallel gathers
  and reduce-scatters, EP's all-to-alls (bytes = tokens x top-k x dim x 2, over NVLink within a node and the network
  across), CP's gathers of halo rows and compressed entries, pipeline p2p and bubble (1F1B, interleaved), and the
  data-parallel gradient reduction (exposed: the trainer runs megatron's DDP with overlap_grad_reduce off; `overlap`
  models megatron's overlap).
* **RL.** The rollout engine's memory (its weights in the sync format, KV cache), decode time per step from the
  measured decode rows (bytes a step reads over the bandwidth the embedded engine reached), weight-sync time by
  method and format for the bytes the model syncs, colocated or on separate nodes, and the trainer's side of the
  sync (the FP8 quantisation, the read-back) and its FP8 QAT of the weights (once a step) as eager ops at the host's
  time an op (their bytes where the device is the slower); the embedded engine's update from an FP8 sync is its own
  eager dequantisation, the measured update less the launches larger chunks remove.

Every figure that is not calibrated here is an assumption with its source (`Hardware.assumptions`, the hw files,
the calibration rows' notes): on the one H200 no network is measured, so NVLink beyond two GPUs and every
multi-node figure (IB, all-to-all across nodes) are assumptions. docs/plan.md has the calibration table.

Pure arithmetic over `dsv4.config` (torch-free): `launcher` imports this module lazily, and `config validate`
answers in well under a second.
"""
from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CALIBRATION_FILE = ROOT / "benchmarks" / "records" / "plan_calibration.jsonl"
GiB = 2 ** 30
BLOCK = 128                      # FP8 weight blocks (128 x 128, e8m0 scales): shards must hold whole blocks
MODEL_TOLERANCE = {"memory": 0.10, "step_time": 0.15}    # what the calibration table holds the model to
SCHEDULES = ("1f1b", "interleaved")
OPTIMIZERS = ("adam", "dist", "offload")
ATTN_IMPLS = ("tilelang", "torch", "dense")
ADAM_KERNELS = ("fused", "foreach")
# bytes a trained parameter moves, the rates' unit for the memory-bound steps of megatron's mixed-precision update:
# the accumulation of a micro-batch's bf16 gradient into the fp32 main grad reads 2 + 4 and writes 4 (the fp32
# parameters' own accumulation, the head's above all, runs in the head's part and the fitted per-micro-batch costs);
# the optimizer step reads the gradient, the fp32 master weight and the two moments and writes the last three (28),
# reads the gradient again for its norm (4) and writes the bf16 weight from the master copy (6, none for an fp32
# parameter, which is its own master)
GRAD_ACCUM_BYTES = 10
ADAM_BYTES = {"bf16": 38, "fp32": 32}
STACKED = "activations: stacked expert weights"
QAT_COPIES = "activations: FP8 QAT copies of the weights"
# bytes an element of a gradient buffer that the trainer's finite check allocates at once, after the backward.
# This trainer's check (dsv4.megatron.train.all_finite: each buffer's min and max) allocates none. Before e352e77 it
# was torch.isfinite on each of DDP's flat fp32 buffers, `(g == g) * (g.abs() != inf)`, whose temporaries all live
# until the product: an fp32 copy (4) and three bools (3), ISFINITE_CHECK_BYTES. Where the activations are small and
# the local experts many that was a step's peak: the TP8 rank shape's 5.6 G expert gradients made it 36.8 GiB, its
# OOM's 21 GiB allocation (ad6970e) is the copy (the validation rows of that code keep the 7)
GRAD_CHECK_BYTES = 0
ISFINITE_CHECK_BYTES = 7
GRAD_CHECK = "transient: gradient finite check"
# the fp32 weights the split GEMM multiplies as bf16 halves (dsv4/kernels/split_gemm.py: the head, the compressors'
# kv and gate projections). split() moves 30 bytes an element: hi = w.to(bf16) reads 4 and writes 2, hi.float()
# reads 2 and writes 4, w - hi reads 8 and writes 4, lo = that.to(bf16) reads 4 and writes 2; where the halves are
# not kept, the backward (fp32_gemm=bf16x3_fwd) casts the weight again, w.to(bf16): 6 more. FP32_SPLITS: "step",
# split_gemm.weight_halves under stepmemo.weights_fixed() (the trainer since 76ff1a9): each weight split once a step, at the first micro-batch's
# forward; "micro_batch", the code before: split at every forward, cast at every backward
SPLIT_BYTES = 30
SPLIT_BACKWARD_BYTES = 6
FP32_SPLITS = ("step", "micro_batch")
# the routed experts' weight gradients (the grouped GEMM, no QAT point: EP = 1, and EP > 1 since f338075, EP_EXPERTS):
# "main_grad", moe_impl=grouped since
# 76ff1a9 (dsv4.megatron.layers._ExpertGemm): one GEMM an expert accumulating into megatron's fp32 main_grad in its
# epilogue (cuBLAS beta = 1), which reads and writes the fp32 gradient (8 bytes an element) where the grouped GEMM
# wrote a bf16 one (2): EPILOGUE_BYTES more, and no main_grad += grad; "hook", moe_impl=grouped_autograd and the code
# before: the bf16 gradient, then megatron's hook adds it (GRAD_ACCUM_BYTES); "triton", moe_impl=grouped_triton
# (dsv4/kernels/triton_grouped_wgrad.py): one Triton grouped GEMM a weight and micro-batch over all the local experts,
# each output tile added into its expert's main_grad in the epilogue. NOT YET TIMED on a GPU: the model gives it the
# grouped GEMM's rate that it has for the experts' forward and dgrad (the fitted "experts" TFLOP/s) and the fp32
# main_grad read and written once an element and micro-batch (8 bytes) where that fitted GEMM wrote a bf16 gradient
# (2): EPILOGUE_BYTES at the streaming rate, what it charges the cuBLAS loop too, whose GEMMs it also takes at the
# grouped rate (the H200 measured that loop at ~314 TFLOP/s, 768 rows an expert: 124.8 ms in 3,033 launches of the
# 32-expert step, where the model's rate and epilogue give it 105; docs/plan.md). So the model predicts "triton" as
# "main_grad" until a timed row says otherwise: at most those ~20 ms a step are there for it to gain
EPILOGUE_BYTES = 6
EXPERT_WGRADS = ("main_grad", "hook", "triton")
# how often the grouped GEMM stacks a layer's local experts into its one [E, out, in] bf16 operand (EP = 1, and
# EP > 1 since f338075: EP_EXPERTS). "step",
# dsv4.megatron.layers._ExpertGemm since 80eff6b: under dsv4.stepmemo.weights_fixed() the stack of
# the step's first forward is kept (the memo) and every later micro-batch's forward, and a recompute, reuses it, so a
# stage holds one copy of its blocks' experts for the whole step whatever the micro-batches in flight or the
# recompute; "micro_batch", the code before (every record so far): every forward stacks afresh and autograd keeps the
# copy to the block's backward, one a micro-batch in flight (under full recompute only the block being recomputed).
# The QAT path (a QAT point on the expert weights: RL with FP8 sync) and moe_impl=grouped_autograd stack at every
# call whatever this says; moe_impl=loop (and EP > 1 before f338075) stack nothing. The copy reads and writes the
# stacked bytes once
# (STACK_PASSES; the H200's 32-expert profile: CatArrayBatchedCopy 23.6 ms a step for 32 copies of 1.61 GB, 4.4 TB/s)
EXPERT_STACKS = ("step", "micro_batch")
STACK_PASSES = 2
STACKING = "expert weight stacking"
# how a rank's local routed experts run at EP > 1, after the all-to-all (dsv4.megatron.layers.ParallelMoE._run_local;
# EP_EXPERTS). "grouped", since f338075: on CUDA with moe_impl grouped, grouped_triton or grouped_autograd and bf16
# rows, the rows sorted by local expert go through GroupedExperts exactly as EP = 1's do (_run_grouped): one grouped
# GEMM a weight over the E/EP local experts, so the stack of their weights (EXPERT_STACKS: once a step under
# weights_fixed() for grouped and grouped_triton with no QAT point, at every call on the QAT path and for
# grouped_autograd) and the weight gradients into main_grad (EXPERT_WGRADS) are EP = 1's, at E/EP experts.
# "loop", the code before (every record so far: `unnamed_as_before`, the 2 x H200 EP2 rows of 2026-11-30 among them):
# _run_loop, one reference Expert an expert (three GEMMs each, a host sync for the counts), no stack, bf16 weight
# gradients that megatron's hook adds (GRAD_ACCUM_BYTES). The model has no rate of its own for that loop: its GEMMs
# are at the fitted grouped "experts" rate either way, and its launches and host sync are not counted (the one
# per-expert GEMM loop timed here, _ExpertGemm's wgrad at 768 rows an expert, took 124.8 ms where that rate and the
# epilogue give 105: EXPERT_WGRADS); so "grouped" and "loop" differ by the stack (memory, and its copy's time) and the
# wgrad's path, not by the GEMMs' rate: the launches the grouped GEMMs save are not predicted
EP_EXPERTS = ("grouped", "loop")
# the LM head's loss (ModelConfig.head_loss): bytes an element of the [tokens, vocab / TP] fp32 logits that the loss's
# memory-bound passes move beyond the head's GEMMs (their output writes and operand reads are in the head's rate),
# fwd + bwd: DERIVED from what the code does, not measured apart. "eager", split_gemm's fp32 logits, then
# F.cross_entropy: the log-softmax reads them three times (max, sum of exponentials, the write pass) and writes its
# fp32 output, which it keeps (16); the backward writes the nll's dense fp32 gradient (4), the log-softmax backward
# reads that twice and its output once and writes the logits' gradient (16), and split_gemm's bf16x3_fwd backward
# casts it to bf16 (6): 42. "fused" (dsv4/kernels/head_loss.py, linear_cross_entropy: TP = 1 on CUDA with the
# bf16x3_fwd head GEMM, RL's scored log-probabilities and the MTP heads included): one compiled kernel a chunk reads
# the chunk's fp32 logits twice (the online max and sum of exponentials, then for the softmax) and writes the softmax
# p in bf16, which it keeps (10); the backward reads p and writes the bf16 gradient in its place (4): 14. The fit
# takes the eager bytes out of the profiled "LM head and loss" part at the streaming rate, so an eager prediction at
# the fit's dimensions is what it was before the term. Memory (_head_activations): at most FUSED_LOSS_ROWS rows of
# fp32 logits at a time (head_loss.py's two fp32 buffers of 1024 rows, the split GEMM's accumulator and output)
LOSS_BYTES = {"eager": 42, "fused": 14}
HEAD_LOSSES = tuple(LOSS_BYTES)
FUSED_LOSS_ROWS = 2048
# dsv4.quant's FP8 weight quantisation runs in eager torch over chunks of rows (quant._row_chunks, whole 128-row
# blocks): 15 ops a chunk and 2 cats where there is more than one chunk; the fp32 dequantisation 3 ops a chunk (its
# own chunking) and an empty; a QAT point's straight-through sum 3 (test_costmodel counts them in torch). How large
# a chunk is (QUANT_CHUNKS, quant.CHUNK_ELEMS of the tensor's device): "gpu", 2^24 elements on CUDA since 3fd1ccf;
# "cpu_sized", 2^19 everywhere, the code before (every record so far: `unnamed_as_before`), where every op on a GPU
# was a kernel launch of ~2 MB of work and the host's time an op (Rates.host_op_s) was what a chain cost. A weight
# of fewer elements than a chunk is one chunk (no cat). An eager chain costs the longer of its ops at the host's
# time an op and the bytes its ops read and write at the streaming rate (eager_seconds): at 2^19 elements the host's
# time is 10x the bytes' or more, at 2^24 the two are alike (64 MB of fp32 an op: ~30 us of HBM against ~9 of
# launch). The bytes an element, DERIVED from the ops (test_costmodel counts them in torch, not timed apart): the
# quantisation of a bf16 weight 47 (the fp32 copy 6, the pad's copy 8, abs 8, the block amax 4, the division 8, the
# clamp 8, the e4m3 cast 5; the scales' ops are 1/16384 of that) and 2 more for the cat of several chunks; the fp32
# dequantisation 21 (widen 5, scale 8, the copy into its output 8); a QAT point's straight-through value in bf16 18
QUANT_CHUNK_ELEMS = {"gpu": 1 << 24, "cpu_sized": 1 << 19}
QUANT_CHUNKS = tuple(QUANT_CHUNK_ELEMS)
QUANT_CHUNK_OPS = 15
QUANT_CAT_OPS = 2
DEQUANT_CHUNK_OPS = 3
QDQ_EXTRA_OPS = 4
QUANT_BYTES = 47
QUANT_CAT_BYTES = 2
DEQUANT_BYTES = 21
QDQ_EXTRA_BYTES = 18
# the embedded engine's update from an FP8 sync (dsv4.rl.engine.EmbeddedEngine.load_named, on its CUDA device): a
# quantised weight dequantised to fp32 (weight_dequant_fp8: an empty, 3 ops a chunk), cast to the parameter's bf16
# and copied in (2 ops, 6 + 4 bytes an element beyond the dequantisation's 21); a tensor sent as it is, one copy
LOAD_CAST_OPS = 2
LOAD_CAST_BYTES = 10
# how often the trainer's weight QAT points quantise (WEIGHT_QDQS). "step", the trainer since c60489a: while the
# trainer holds dsv4.stepmemo.weights_fixed() open around the forward/backward schedule, dsv4.quant._weight_qdq
# computes each weight's straight-through value once, at the first forward that uses it (fp8_qdq_ops, the same ops
# as before), and keeps it to the end of the step's backward; every micro-batch gets a view of it through a
# straight-through autograd function, so the micro-batches in flight share one copy. A micro-batch's look-up of a
# stored value dispatches no kernel (a view) and is taken as QDQ_LOOKUP_OPS of the host's time an op (the key, the
# memo, the Function's apply: 7.7 us on the CPU here, where a small eager add takes 1.1; test_costmodel counts the
# ops in torch). "micro_batch", the code before: every forward quantises every weight, each micro-batch in flight
# saving its own copy. (Every weight QAT point reuses, fp8_gemm_inputs' and mxfp4_experts' too; the model counts
# the one it models, qat_rollout_fp8's. The activation points stay per micro-batch.)
WEIGHT_QDQS = ("step", "micro_batch")
QDQ_LOOKUP_OPS = 1
QAT_OPS = "FP8 QAT of the weights (eager ops)"
QAT_LOOKUPS = "FP8 QAT of the weights: stored-value look-ups"
# the sync's read-back (dsv4.rl.loop._read_back) of one tensor from the embedded engine: ops, host syncs included,
# of a quantised weight (compared against its FP8 bound) and of one sent as it is (compared exactly)
READBACK_OPS = {"quantized": 28, "exact": 14}


# ================================================================================================ inputs
@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 1
    dp: int = 1
    stages: tuple[int, ...] = ()       # transformer layers per pipeline stage (empty: all on one)
    micro_batch: int = 1
    vpp: int = 1                       # virtual stages per pipeline rank (interleaved 1F1B when > 1)

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    @property
    def schedule(self) -> str:
        return "interleaved" if self.vpp > 1 else "1f1b"

    def name(self) -> str:
        split = ""
        if self.pp > 1 and self.stages:
            s = self.stages
            mid = s[1:-1]
            split = (f" {s[0]}/{mid[0]}x{len(mid)}/{s[-1]}" if mid and len(set(mid)) == 1
                     else " " + "/".join(map(str, s)))
        v = f" vpp{self.vpp}" if self.vpp > 1 else ""
        return (f"TP{self.tp} PP{self.pp} CP{self.cp} EP{self.ep} ETP{self.etp} DP{self.dp}{split}{v} "
                f"mb{self.micro_batch}")

    def to_json(self) -> dict:
        return {"tp": self.tp, "pp": self.pp, "cp": self.cp, "ep": self.ep, "etp": self.etp, "dp": self.dp,
                "stages": list(self.stages), "micro_batch": self.micro_batch, "vpp": self.vpp,
                "schedule": self.schedule, "world": self.world, "name": self.name()}


@dataclass(frozen=True)
class RLWorkload:
    samples: int                       # sequences per RL step (prompts x group)
    response_tokens: int               # tokens each response decodes
    minibatches: int = 1               # optimizer updates per step
    engine: str = "embedded"           # embedded | sglang
    colocated: bool = True             # the engine on the trainer's GPUs
    rollout_gpus: int = 0              # GPUs of separate rollout nodes (not colocated)
    rollout_tp: int = 1
    rollout_ep: int = 1
    mem_fraction: float = 0.7          # SGLang --mem-fraction-static
    sync: str = "inproc"               # inproc | broadcast | disk
    sync_format: str = "full"          # full | fp8


@dataclass(frozen=True)
class Workload:
    seq_len: int = 4096
    global_batch: int = 8              # sequences per optimizer step
    recompute: str = "none"            # none | full
    mtp: bool = False                  # the MTP loss is on: MTP runs and trains
    indexer_loss: bool = False         # the indexer trains (its KL loss)
    attn_impl: str = "tilelang"        # tilelang | torch (gather reference) | dense (masked dense scores)
    optimizer: str = "adam"            # adam (this trainer) | dist (megatron's distributed optimizer) | offload
    adam_kernel: str = "fused"         # torch's Adam kernels: fused (this trainer on CUDA since 1853ac7) | foreach
    overlap_grad_reduce: bool = False  # megatron DDP's overlap (this trainer: off)
    rl: RLWorkload | None = None
    # bytes an element of the largest gradient buffer that the finite check after the backward allocates at once:
    # this trainer's and megatron's own (a norm a bucket: other stacks' runs) 0; torch.isfinite's 7 (the trainer
    # before e352e77, ISFINITE_CHECK_BYTES)
    grad_check_bytes: int = GRAD_CHECK_BYTES
    fp32_split: str = "step"           # FP32_SPLITS: the fp32 weights split once a step (76ff1a9 on) or each micro-batch
    expert_wgrad: str = "main_grad"    # EXPERT_WGRADS: the experts' weight gradients into main_grad (76ff1a9 on) or hook
    weight_qdq: str = "step"           # WEIGHT_QDQS: the QAT weights quantised once a step (c60489a on) or at
                                       # every micro-batch
    expert_stack: str = "step"         # EXPERT_STACKS: the grouped GEMM's expert stack once a step (80eff6b on)
                                       # or at every forward (every record so far: `unnamed_as_before`)
    head_loss: str = "fused"           # HEAD_LOSSES: the LM head's loss, ModelConfig.head_loss (fused: cccd6ba's
                                       # records on; eager before, every earlier record: `unnamed_as_before`)
    quant_chunk: str = "gpu"           # QUANT_CHUNKS: the eager FP8 quantisers' chunks, 2^24 elements on a GPU
                                       # (3fd1ccf on) or 2^19 (every record so far: `unnamed_as_before`)
    ep_experts: str = "grouped"        # EP_EXPERTS: at EP > 1 the local experts through the grouped GEMMs (f338075
                                       # on) or one GEMM an expert (every record so far: `unnamed_as_before`)


@dataclass(frozen=True)
class Rates:
    """Per GPU kind, derived from a calibration row (`derive_rates`)."""
    gpu: str
    source: str                        # measured | scaled
    note: str
    tflops: dict                       # part -> effective TFLOP/s of fwd+bwd (indexer: forward only)
    sparse_fwd_tflops: float
    sparse_bwd_tflops: float
    elementwise_ns: float              # per token per block at dim x hc = 16384, fwd + bwd
    layer_mb_s: float                  # fixed cost per block and micro-batch (kernel launches, small kernels)
    grad_accum_gbps: float             # main_grad += grad of the bf16 parameters: GRAD_ACCUM_BYTES at this GB/s
    optimizer_gbps: dict               # Adam kernel -> GB/s of the optimizer step's ADAM_BYTES a parameter
    act_scale: float                   # measured / inventory of the activations
    workspace_gib: float               # constant allocations beyond weights, state and activations
    decode_gbps: dict                  # batch -> effective bytes/s of the embedded engine's decode step (GB/s)
    sync_gbps: dict                    # method -> GB/s of a weight update, where measured
    calibration: dict                  # the fit's own check: predicted vs measured at the calibration shape
    reserve_gib: float = 0.0           # measured device memory a training process holds outside torch's allocator
    stream_gbps: float = 0.0           # a vectorised memory-bound pass (the fused Adam's measured rate): the split
                                       # GEMM's casts, the experts' wgrad epilogue
    host_op_s: float = 0.0             # host time of one eager torch op where the step is launch-bound (FP8 QAT, the
                                       # sync's quantisation and read-back)
    sync_quant_chunk: str = "cpu_sized"  # the quantisers' chunks (QUANT_CHUNKS) of the run whose sync_gbps were
                                         # measured: the embedded engine's update dequantises in them


@dataclass(frozen=True)
class Hardware:
    name: str                          # the hw layer (h200, h20, cpu)
    gpu: str                           # HW_GPU_NAME
    memory_gib: float
    peak_tflops: float
    gpus_per_node: int
    nvlink_gbps: float                 # per-GPU bus bandwidth of collectives inside a node
    ib_gbps: float                     # per-GPU bandwidth across nodes
    rates: Rates | None = None
    reserve_gib: float = 2.0           # held outside torch's allocator (CUDA context, kernel modules, NCCL): the
                                       # calibration row's measurement where it has one (reserve_of), else this
    fragmentation: float = 0.03        # reserved over allocated with expandable segments
    assumptions: tuple[str, ...] = ()

    @property
    def usable_gib(self) -> float:
        return max(0.0, (self.memory_gib - self.reserve_gib) / (1 + self.fragmentation))


# ================================================================================================ the model's shape
@dataclass(frozen=True)
class Block:
    key: str                           # layers.3 | mtp.0
    layer_id: int
    ratio: int
    hash_routed: bool
    params: tuple                      # ((shard, fp32, group), elements): shard tp|rep|exp, group main|indexer|mtp|frozen
    flops: tuple                       # ((part, forward FLOPs per token, share of it replicated over TP), ...)
    fp8: tuple = ()                    # (((shard, TP-split dim, rows, cols), count), ...): its FP8/FP4-stored linears
    split_elems: int = 0               # elements of its fp32 split-GEMM weights (the compressors' kv and gate)

    @property
    def kind(self) -> tuple:
        """Blocks of one kind hold the same parameters and do the same work: MTP or not, ratio, hash routing."""
        return (self.key.startswith("mtp."), self.ratio, self.hash_routed)


@dataclass(frozen=True)
class ModelShape:
    name: str
    cfg: object                        # dsv4.config.ModelConfig
    blocks: tuple[Block, ...]          # main layers, then MTP blocks
    top: tuple                         # params outside the blocks: ((where, shard, fp32, group), elements)
    head_flops: float                  # forward FLOPs per token of the LM head (one set of logits)
    seq_len: int
    train_flops: tuple                 # model FLOPs per trained token (dsv4.flops): (without MTP, with MTP)

    @property
    def layers(self) -> tuple[Block, ...]:
        return tuple(b for b in self.blocks if b.key.startswith("layers."))

    @property
    def mtp_blocks(self) -> tuple[Block, ...]:
        return tuple(b for b in self.blocks if b.key.startswith("mtp."))

    def n_params(self) -> int:
        return sum(n for b in self.blocks for _, n in b.params) + sum(n for _, n in self.top)


_FP32_LEAVES = ("attn_sink", "ape")


def _param_kind(name: str, cfg) -> tuple[str, bool, str]:
    """(shard, fp32, group) of an official parameter name, as dsv4.megatron holds it."""
    leaf = name.rsplit(".", 1)[-1]
    if ".shared_experts." in name or any(f".attn.{p}." in name for p in ("wq_b", "wo_a", "wo_b")) \
            or leaf == "attn_sink" or name in ("embed.weight", "head.weight"):
        shard = "tp"
    elif ".experts." in name:
        shard = "exp"
    else:
        shard = "rep"
    fp32 = cfg.dtype == "fp32" or leaf in _FP32_LEAVES or leaf.startswith("hc_") or name.endswith("norm.weight") \
        or ".compressor.wkv." in name or ".compressor.wgate." in name or name == "head.weight" \
        or name.endswith("gate.bias") or leaf == "tid2eid"
    if leaf == "tid2eid" or name.endswith("gate.bias"):
        group = "frozen"                 # the hash table and the router bias are not trained
    elif name.startswith("mtp."):
        group = "mtp"
    elif ".indexer." in name:
        group = "indexer"
    else:
        group = "main"
    return shard, fp32, group


def _fp8_linear(name: str, shape, cfg, shard: str) -> tuple | None:
    """(shard, the dim TP / ETP splits, rows, cols) of a linear the release stores in FP8 or FP4 (the head is not
    one), which the trainer's FP8 QAT point quantises and the FP8 sync sends as e4m3; None for anything else.
    Row-parallel weights (wo_b, the experts' w2) split their input features, the others their outputs."""
    if len(shape) != 2 or name == "head.weight" or cfg.storage_format(name) not in ("fp8", "fp4"):
        return None
    dim = 1 if name.endswith((".wo_b.weight", ".w2.weight")) else 0
    return (shard, dim, shape[0], shape[1])


def _row_chunks(n_rows: int, row_elems: int, multiple: int = 1, target: int = 1 << 19) -> int:
    """dsv4.quant._row_chunks: rows a chunk (a multiple of `multiple`) of about `target` elements (QUANT_CHUNK_ELEMS
    of the code and device)."""
    rows = max(1, target // max(row_elems, 1)) // multiple * multiple
    return max(rows, multiple)


def _quant_chunks(n: int, k: int, chunk: str = "gpu") -> int:
    """Chunks dsv4.quant.weight_quant_fp8 splits an [n, k] weight into (whole 128-row blocks each; 1: no split)."""
    step = _row_chunks(n, k, BLOCK, QUANT_CHUNK_ELEMS[chunk])
    return math.ceil(n / step) if n > step else 1


def _dequant_chunks(n: int, k: int, chunk: str = "gpu") -> int:
    """Chunks dsv4.quant.weight_dequant_fp8 works an [n, k] weight in (whole block rows, or a divisor of the block)."""
    step = _row_chunks(n, k, 1, QUANT_CHUNK_ELEMS[chunk])
    step = step // BLOCK * BLOCK if step >= BLOCK else max(d for d in range(1, step + 1) if BLOCK % d == 0)
    return math.ceil(n / step)


def fp8_quant_ops(n: int, k: int, chunk: str = "gpu") -> int:
    """Eager torch ops of dsv4.quant.weight_quant_fp8 on an [n, k] weight (a multiple of 128 each way), in the
    chunks of `chunk` (QUANT_CHUNKS)."""
    parts = _quant_chunks(n, k, chunk)
    return parts * QUANT_CHUNK_OPS + QUANT_CAT_OPS if parts > 1 else QUANT_CHUNK_OPS


def fp8_quant_bytes(n: int, k: int, chunk: str = "gpu") -> float:
    """Bytes those ops read and write on a bf16 [n, k] weight (QUANT_BYTES an element, the cat's where it splits)."""
    return n * k * (QUANT_BYTES + (QUANT_CAT_BYTES if _quant_chunks(n, k, chunk) > 1 else 0))


def fp8_qdq_ops(n: int, k: int, chunk: str = "gpu") -> int:
    """Eager torch ops of the FP8 weight QAT point (dsv4.quant.fp8_weight_qdq: quantise, dequantise to fp32 in its
    own chunks, the straight-through sum) on an [n, k] weight: what one forward pays a weight under FP8 QAT."""
    return fp8_quant_ops(n, k, chunk) + _dequant_chunks(n, k, chunk) * DEQUANT_CHUNK_OPS + QDQ_EXTRA_OPS


def fp8_qdq_bytes(n: int, k: int, chunk: str = "gpu") -> float:
    """Bytes the QAT point's ops read and write on a bf16 [n, k] weight."""
    return fp8_quant_bytes(n, k, chunk) + n * k * (DEQUANT_BYTES + QDQ_EXTRA_BYTES)


def eager_seconds(ops: float, nbytes: float, rates: "Rates") -> float:
    """An eager chain on a GPU: the host launches its ops at host_op_s each while the device runs them at the
    streaming rate, so the slower of the two (ops of 2^19-element chunks: the host's; of 2^24, either)."""
    device = nbytes / (rates.stream_gbps * 1e9) if rates.stream_gbps else 0.0
    return max(ops * rates.host_op_s, device)


def _rank_linear(lin: tuple, lay: "Layout") -> tuple[int, int, float]:
    """(rows, cols, how many a rank holds per block-wide copy) of an FP8 linear on one rank: TP (ETP for experts)
    splits its dim, EP divides the experts' count."""
    shard, dim, n, k = lin
    split = lay.tp if shard == "tp" else lay.etp if shard == "exp" else 1
    if dim == 0:
        n //= split
    else:
        k //= split
    return n, k, (1.0 / lay.ep if shard == "exp" else 1.0)


def _split_gemm(name: str) -> bool:
    """An fp32 weight that dsv4.model.fp32_linear multiplies through the split GEMM: the compressors' kv and gate
    projections (the head is counted apart: it sits outside the blocks)."""
    return ".compressor.wkv." in name or ".compressor.wgate." in name


@functools.lru_cache(maxsize=32)
def model_shape(preset: str, overrides: tuple[str, ...] = (), seq_len: int = 4096) -> ModelShape:
    """The model's parameter placement and FLOPs by block (cached: planning asks for thousands of layouts)."""
    from dsv4.config import ModelConfig
    from dsv4.flops import _part, block_flops_per_token

    cfg = ModelConfig.preset(preset).with_overrides(*overrides)
    per_block: dict[str, dict] = {}
    top: dict[tuple, int] = {}
    rep_flops: dict[str, dict[str, float]] = {}
    expert_kind: dict = {}
    fp8: dict[str, dict] = {}
    splits: dict[str, int] = {}
    for name, shape in cfg.param_shapes().items():
        n = math.prod(shape)
        head, sep, rest = name.partition(".experts.")
        if sep and not head.endswith(".shared"):
            # 256-384 experts x 3 weights a block: classify one, reuse it (the names differ only in the expert id)
            e_key = (head, rest.split(".", 1)[1])
            kind = expert_kind.get(e_key)
            if kind is None:
                kind = expert_kind[e_key] = (_param_kind(name, cfg), _fp8_linear(name, shape, cfg, "exp"))
            kind, lin = kind
            blk = head.rsplit(".", 1)[0]
            d = per_block.setdefault(blk, {})
            d[kind] = d.get(kind, 0) + n
            if lin:
                f = fp8.setdefault(blk, {})
                f[lin] = f.get(lin, 0) + 1
            continue
        kind = _param_kind(name, cfg)
        if name.startswith(("layers.", "mtp.")):
            key = ".".join(name.split(".")[:2])
            d = per_block.setdefault(key, {})
            d[kind] = d.get(kind, 0) + n
            lin = _fp8_linear(name, shape, cfg, kind[0])
            if lin:
                f = fp8.setdefault(key, {})
                f[lin] = f.get(lin, 0) + 1
            if _split_gemm(name):
                splits[key] = splits.get(key, 0) + n
            if len(shape) == 2 and kind[0] == "rep" and not name.endswith(("tid2eid", ".ape")):
                part = _part(name)
                rep_flops.setdefault(key, {}).setdefault(part, 0.0)
                rep_flops[key][part] += 2.0 * n
        else:
            where = "first" if name == "embed.weight" else "last"
            top[(where, *kind)] = top.get((where, *kind), 0) + n
    flops = block_flops_per_token(cfg, seq_len, mtp=True)
    blocks = []
    for i in range(cfg.n_layers + cfg.n_mtp_layers):
        key = f"layers.{i}" if i < cfg.n_layers else f"mtp.{i - cfg.n_layers}"
        parts = []
        for part, f in flops.get(key, {}).items():
            rep = rep_flops.get(key, {}).get(part, 0.0)
            if part in ("sparse attention",):
                share = 0.0
            elif part == "indexer":
                share = 1.0               # the indexer's projections and its scoring run whole on every TP rank
            else:
                share = min(1.0, rep / f) if f else 0.0
            parts.append((part, f, share))
        blocks.append(Block(key, i, cfg.layer_ratio(i), cfg.is_hash_layer(i),
                            tuple(sorted(per_block[key].items())), tuple(parts),
                            tuple(sorted(fp8.get(key, {}).items())), splits.get(key, 0)))
    head = 2.0 * cfg.dim * cfg.vocab_size
    # forward FLOPs with MTP, and without: less the MTP blocks and their logits (what block_flops_per_token(mtp=False)
    # leaves out); training is 3 x the forward (dsv4.flops.train_flops_per_token)
    with_mtp = sum(sum(v.values()) for v in flops.values())
    without = with_mtp - sum(sum(v.values()) for k, v in flops.items() if k.startswith("mtp.")) \
        - head * cfg.n_mtp_layers
    return ModelShape(preset + ("+" + " ".join(overrides) if overrides else ""), cfg, tuple(blocks),
                      tuple(sorted(top.items())), head, seq_len, (3.0 * without, 3.0 * with_mtp))


# ================================================================================================ checks
def layout_problems(shape: ModelShape, lay: Layout, wl: Workload, gpus_per_node: int) -> list[str]:
    """Why a layout cannot run at all, one reason each (divisibility, splits, placement); empty if it can."""
    cfg, out = shape.cfg, []
    if lay.tp > gpus_per_node:
        out.append(f"TP across nodes: TP={lay.tp} spans nodes ({gpus_per_node} GPUs a node): its 8 collectives a layer and "
                   "micro-batch would cross the network")
    if cfg.n_heads % lay.tp or cfg.o_groups % lay.tp:
        out.append(f"heads/TP: TP={lay.tp} must divide the {cfg.n_heads} heads and {cfg.o_groups} output groups")
    if cfg.vocab_size % lay.tp:
        out.append(f"vocab/TP: TP={lay.tp} must divide the vocabulary of {cfg.vocab_size}")
    if (cfg.moe_inter_dim // max(lay.tp, 1)) % BLOCK or cfg.moe_inter_dim % lay.tp:
        out.append(f"shared expert dim/TP: {cfg.moe_inter_dim}/{lay.tp} is not a multiple of the {BLOCK}-wide FP8 "
                   "blocks its weights are stored and synced in")
    if cfg.n_routed_experts % lay.ep:
        out.append(f"experts/EP: EP={lay.ep} must divide the {cfg.n_routed_experts} routed experts")
    if lay.etp not in (1, lay.tp):
        out.append(f"ETP: ETP={lay.etp}; dsv4.megatron runs ETP=1 (whole experts) or ETP=TP={lay.tp}")
    if cfg.moe_inter_dim % lay.etp or (cfg.moe_inter_dim // lay.etp) % BLOCK:
        out.append(f"expert dim/ETP: {cfg.moe_inter_dim}/{lay.etp} is not a multiple of the {BLOCK}-wide FP8 "
                   "blocks the expert weights are stored and synced in")
    if (lay.dp * lay.cp * lay.tp) % (lay.ep * lay.etp):
        out.append(f"expert grid: EP*ETP={lay.ep}*{lay.etp} must divide DP*CP*TP={lay.dp}*{lay.cp}*{lay.tp} "
                   "(megatron's expert grid)")
    if lay.cp > 1:
        if wl.seq_len % (2 * lay.cp):
            out.append(f"CP: sequence {wl.seq_len} is not a multiple of 2*CP={2 * lay.cp}")
        if wl.rl is not None:
            out.append("CP: RL scores whole sequences; the trainer refuses CP > 1 in RL")
    if (wl.seq_len // lay.cp) % lay.tp:
        out.append(f"SP: {wl.seq_len}/CP={wl.seq_len // lay.cp} positions do not split over TP={lay.tp}")
    stages = lay.stages or (cfg.n_layers,)
    if not lay.stages and lay.pp * lay.vpp > 1:
        out.append(f"layers/PP split: the model's {cfg.n_layers} layers cannot fill {lay.pp * lay.vpp} stages "
                   "(PP x virtual stages) of one layer or more")
    elif len(stages) != lay.pp * lay.vpp or sum(stages) != cfg.n_layers or min(stages) < 1:
        out.append(f"layers/PP split: {list(stages)} is not {lay.pp * lay.vpp} stages of >= 1 layer adding up to "
                   f"the model's {cfg.n_layers}")
    elif lay.pp > 1 and stages[0] < cfg.n_hash_layers:
        out.append(f"hash-routed layers on stage 0: layers 0-{cfg.n_hash_layers - 1} route by token id and must "
                   f"sit on the first stage (megatron's schedule hands later stages only the residual streams), "
                   f"but it holds {stages[0]}")
    batch = wl.rl.samples if wl.rl else wl.global_batch
    mbs = wl.rl.minibatches if wl.rl else 1
    if batch % (lay.micro_batch * lay.dp * mbs):
        out.append(f"batch: {batch} sequences a step do not split into DP={lay.dp} x micro-batches of "
                   f"{lay.micro_batch}" + (f" x {mbs} minibatches" if mbs > 1 else ""))
    if wl.attn_impl not in ATTN_IMPLS or wl.optimizer not in OPTIMIZERS or wl.recompute not in ("none", "full") \
            or wl.adam_kernel not in ADAM_KERNELS or wl.fp32_split not in FP32_SPLITS \
            or wl.expert_wgrad not in EXPERT_WGRADS or wl.weight_qdq not in WEIGHT_QDQS \
            or wl.expert_stack not in EXPERT_STACKS or wl.head_loss not in HEAD_LOSSES \
            or wl.quant_chunk not in QUANT_CHUNKS or wl.ep_experts not in EP_EXPERTS:
        out.append(f"workload: attn_impl {wl.attn_impl!r}, optimizer {wl.optimizer!r}, recompute {wl.recompute!r}, "
                   f"adam_kernel {wl.adam_kernel!r}, fp32_split {wl.fp32_split!r}, expert_wgrad {wl.expert_wgrad!r}, "
                   f"weight_qdq {wl.weight_qdq!r}, expert_stack {wl.expert_stack!r}, head_loss {wl.head_loss!r}, "
                   f"quant_chunk {wl.quant_chunk!r}, ep_experts {wl.ep_experts!r}")
    return out


def split_layers(n_layers: int, pp: int, n_hash: int, head_layers: float = 1.5, vpp: int = 1) -> tuple[int, ...]:
    """Layers per stage in the form the config takes (first / even middle / last): the split whose slowest stage is
    fastest, counting the head (and its logits) as `head_layers` layers on the last stage; stage 0 keeps the
    hash-routed layers; ties go to fewer layers on stage 0, which holds the most micro-batches in flight."""
    stages = pp * vpp
    if stages == 1:
        return (n_layers,)
    if n_layers < stages:
        return ()
    best, best_key = (), None
    if n_layers % stages == 0:
        even = (n_layers // stages,) * stages
        best, best_key = even, (max(even[0], even[-1] + head_layers), even[0])
    if stages == 2:
        for first in range(1, n_layers):
            s = (first, n_layers - first)
            key = (max(s[0], s[1] + head_layers), s[0])
            if s[0] >= n_hash and (best_key is None or key < best_key):
                best, best_key = s, key
        return best
    for first in range(1, n_layers):
        for last in range(1, n_layers - first):
            rest = n_layers - first - last
            if rest < stages - 2 or rest % (stages - 2):
                continue
            mid = rest // (stages - 2)
            key = (max(first, mid, last + head_layers), first)
            if first >= min(n_hash, n_layers) and (best_key is None or key < best_key):
                best, best_key = (first,) + (mid,) * (stages - 2) + (last,), key
    return best


# ================================================================================================ memory
@dataclass
class Memory:
    stage: int
    parts: dict                        # GiB by part on this stage's rank at its peak: the forward-backward phase, or
                                       # the gradient check after it (activations freed), whichever is fuller
    host_gib: float = 0.0              # optimizer state on the host (offload)
    in_flight: int = 1
    detail: dict = field(default_factory=dict)

    @property
    def total(self) -> float:
        return sum(self.parts.values())


def _memo(ctx: dict | None, key: tuple, fn):
    """fn() once per key within one planning pass (`ctx` shared by its predictions; None: no memo)."""
    if ctx is None:
        return fn()
    if key not in ctx:
        ctx[key] = fn()
    return ctx[key]


def _stage_kinds(shape: ModelShape, lay: Layout, stage: int, wl: Workload, ctx: dict | None) -> list:
    """[(a block of each kind, how many)] on pipeline rank `stage`."""
    def count():
        out: dict[tuple, list] = {}
        for b in stage_blocks(shape, lay, stage, wl):
            out.setdefault(b.kind, [b, 0])[1] += 1
        return [tuple(v) for v in out.values()]
    return _memo(ctx, ("kinds", lay.stages, lay.pp, lay.vpp, stage, wl.mtp), count)


def _trained(group: str, wl: Workload) -> bool:
    return group == "main" or (group == "mtp" and wl.mtp) or (group == "indexer" and wl.indexer_loss)


def _on_rank(shard: str, n: float, lay: Layout) -> float:
    """Elements of a parameter group one rank holds: split over TP, experts over EP x ETP, the rest whole."""
    return n / (lay.tp if shard == "tp" else lay.ep * lay.etp if shard == "exp" else 1)


def _param_bytes(items, lay: Layout, wl: Workload, expert_shard: int, dense_shard: int) -> tuple[dict, float, float]:
    """(bytes by part, host bytes, trained params on the rank) of parameter groups held on one rank."""
    w = g = o = host = trained = 0.0
    for (shard, fp32, group), n in items:
        n_rank = _on_rank(shard, n, lay)
        w += n_rank * (4 if fp32 else 2)
        if _trained(group, wl):
            trained += n_rank
            g += n_rank * 4
            state = n_rank * (8 if fp32 else 12)
            if wl.optimizer == "dist":
                state /= expert_shard if shard == "exp" else dense_shard
            if wl.optimizer == "offload":
                host += state
            else:
                o += state
    return {"weights": w, "gradients": g, "optimizer": o}, host, trained


def _trained_by_dtype(items, lay: Layout, wl: Workload) -> dict:
    """Trained parameters held on one rank, by the dtype they are kept in ({"bf16": n, "fp32": n})."""
    out = {"bf16": 0.0, "fp32": 0.0}
    for (shard, fp32, group), n in items:
        if _trained(group, wl):
            out["fp32" if fp32 else "bf16"] += _on_rank(shard, n, lay)
    return out


def grad_buffers(items, lay: Layout, wl: Workload) -> dict:
    """Elements of each of megatron DDP's flat fp32 gradient buffers on one rank ({("expert" | "dense", "bf16" |
    "fp32"): elements}): DDP keeps one contiguous `grad_data` per parameter dtype of the trained parameters, the
    experts' (allreduce=False) apart from the rest, and every main_grad is a view into it."""
    out: dict = {}
    for (shard, fp32, group), n in items:
        if _trained(group, wl):
            key = ("expert" if shard == "exp" else "dense", "fp32" if fp32 else "bf16")
            out[key] = out.get(key, 0.0) + _on_rank(shard, n, lay)
    return out


def stacked_expert_bytes(blk: Block, lay: Layout) -> float:
    """The bf16 copy of a block's local routed experts (E/EP of them, each 1/ETP) that the grouped GEMM stacks
    (dsv4.megatron.layers.GroupedExperts: w1, w3 and w2 of every local expert as one [E/EP, out, in] operand, which
    autograd keeps for the backward), where a stack is made: whether, and how often (so how many copies are held),
    is expert_stacking's."""
    return sum(_on_rank(shard, n, lay) for (shard, _, _), n in blk.params if shard == "exp") * 2


def grouped_experts(shape: ModelShape, lay: Layout, wl: Workload) -> bool:
    """A rank's local routed experts run through GroupedExperts (the grouped GEMMs): moe_impl grouped* at EP = 1
    (ParallelMoE._routed_grouped), and at EP > 1 since f338075 (_run_local -> _run_grouped; Workload.ep_experts
    "grouped") unless a QAT point changes the expert weights (fp8_qat: _run_local keeps the loop, whose GEMMs read
    the step's stored QAT values where the grouped form would stack them at every forward); not under
    moe_impl=loop, nor at EP > 1 in the code before (ep_experts "loop": one GEMM an expert)."""
    if not shape.cfg.moe_impl.startswith("grouped"):
        return False
    return lay.ep == 1 or (wl.ep_experts == "grouped" and not fp8_qat(shape, wl))


def expert_stacking(shape: ModelShape, lay: Layout, wl: Workload) -> str:
    """How the trainer stacks the local experts for the grouped GEMM (EXPERT_STACKS): "step" where _ExpertGemm runs
    (moe_impl grouped or grouped_triton, plain bf16 weights: no QAT point) under today's code, "micro_batch" where
    the stack is made at every call (the code before, the QAT path, grouped_autograd), "" where nothing is stacked
    (moe_impl=loop; EP > 1 before f338075: grouped_experts). At EP > 1 as at EP = 1, over the E/EP local experts."""
    impl = shape.cfg.moe_impl
    if not grouped_experts(shape, lay, wl):
        return ""
    if wl.expert_stack == "step" and impl in ("grouped", "grouped_triton") and not fp8_qat(shape, wl):
        return "step"
    return "micro_batch"


def stage_stacked_bytes(shape: ModelShape, lay: Layout, stage: int, wl: Workload, ctx: dict | None = None) -> float:
    """The stacked copies of pipeline rank `stage`'s blocks that run (MTP with its loss only), one each."""
    return sum(stacked_expert_bytes(b, lay) * count for b, count in _stage_kinds(shape, lay, stage, wl, ctx)
               if wl.mtp or not b.key.startswith("mtp."))


def fp8_qat(shape: ModelShape, wl: Workload) -> bool:
    """The trainer's forward runs every FP8- or FP4-stored linear through the FP8 weight QAT point (dsv4.quant.
    fp8_weight_qdq, eager): RL with FP8 sync (dsv4.rl.loop.run_grpo sets ModelConfig.qat_rollout_fp8, so that the
    policy trained is the one the engine samples), or a model that sets it; once a step or at every micro-batch as
    Workload.weight_qdq says. (fp8_gemm_inputs' and mxfp4_experts' points are not modelled.)"""
    return bool(shape.cfg.qat_rollout_fp8) or (wl.rl is not None and wl.rl.sync_format == "fp8")


def qat_copy_bytes(blk: Block, lay: Layout, weight_qdq: str = "step", grouped: bool = True) -> float:
    """The bf16 copies of a block's FP8 linears out of the QAT point on one rank. weight_qdq="micro_batch" (the code
    before c60489a): what each forward makes and the GEMMs save for the backward (F.linear keeps its weight
    argument, which is now a new tensor, not the parameter); the routed experts, where they run grouped
    (grouped_experts: `grouped`), are stacked anyway (stacked_expert_bytes), their QAT'd copies freed once stacked.
    "step": the step's stored values (WEIGHT_QDQS), which every forward views; the routed experts included, as the
    store keeps theirs past the stacking."""
    total = 0.0
    for lin, count in blk.fp8:
        if lin[0] == "exp" and grouped and weight_qdq == "micro_batch":
            continue
        n, k, share = _rank_linear(lin, lay)
        total += n * k * count * share * 2
    return total


def qat_ops(blk: Block, lay: Layout, chunk: str = "gpu") -> float:
    """Eager ops of quantising a block's FP8 linears on one rank through the FP8 QAT point once (fp8_qdq_ops each, in
    the quantisers' `chunk`s): what every forward paid before c60489a, and what a step pays now."""
    total = 0.0
    for lin, count in blk.fp8:
        n, k, share = _rank_linear(lin, lay)
        total += fp8_qdq_ops(n, k, chunk) * count * share
    return total


def qat_bytes(blk: Block, lay: Layout, chunk: str = "gpu") -> float:
    """Bytes those ops read and write (fp8_qdq_bytes each)."""
    total = 0.0
    for lin, count in blk.fp8:
        n, k, share = _rank_linear(lin, lay)
        total += fp8_qdq_bytes(n, k, chunk) * count * share
    return total


def qat_weights(blk: Block, lay: Layout) -> float:
    """FP8 linears of a block on one rank: the stored values a forward looks up under weight_qdq="step"."""
    return sum(count * _rank_linear(lin, lay)[2] for lin, count in blk.fp8)


def stage_qat(shape: ModelShape, lay: Layout, stage: int, wl: Workload, ctx: dict | None = None,
              per=None) -> float:
    """`per` (qat_ops, the default, and qat_bytes in the workload's quant_chunk; qat_weights) over the blocks of
    pipeline rank `stage` that run (MTP with its loss only)."""
    per = per or qat_ops
    fn = (lambda b: per(b, lay, wl.quant_chunk)) if per in (qat_ops, qat_bytes) else (lambda b: per(b, lay))
    return sum(fn(b) * count for b, count in _stage_kinds(shape, lay, stage, wl, ctx)
               if wl.mtp or not b.key.startswith("mtp."))


def stage_qat_seconds(shape: ModelShape, lay: Layout, stage: int, wl: Workload, rates: "Rates",
                      ctx: dict | None = None) -> float:
    """One pass of the QAT point over pipeline rank `stage`'s FP8 linears: its ops at the host's time an op, or its
    bytes at the streaming rate where the device is the slower (eager_seconds)."""
    return eager_seconds(stage_qat(shape, lay, stage, wl, ctx), stage_qat(shape, lay, stage, wl, ctx, qat_bytes), rates)


def stage_blocks(shape: ModelShape, lay: Layout, stage: int, wl: Workload) -> list[Block]:
    """The blocks of pipeline rank `stage` (all its virtual chunks), MTP with the last stage when it trains."""
    stages = lay.stages or (shape.cfg.n_layers,)
    layers = shape.layers
    out, start = [], 0
    for chunk, count in enumerate(stages):
        if chunk % lay.pp == stage:
            out += layers[start:start + count]
        start += count
    if stage == lay.pp - 1:
        out += shape.mtp_blocks         # present (weights) even when MTP does not run
    return out


def stage_params(shape: ModelShape, lay: Layout, stage: int, wl: Workload, ctx: dict | None = None) -> list:
    """((shard, fp32, group), elements) of every parameter pipeline rank `stage` holds: its blocks, the embedding on
    the first stage, the head, final norm and hc head on the last (and, when MTP trains, its copy of the embedding)."""
    items = [(kind, n * count) for b, count in _stage_kinds(shape, lay, stage, wl, ctx) for kind, n in b.params]
    first, last = stage == 0, stage == lay.pp - 1
    for (where, *kind), n in shape.top:
        if (where == "first" and first) or (where == "last" and last) or (where == "first" and last and wl.mtp):
            items.append((tuple(kind), n))
    return items


def kernel_slots(cfg, ratio: int, seq_len: int) -> int:
    """KV slots the sparse attention kernel visits a query, padded to its 64-blocks: the window, plus the indexer's
    top-k (ratio 4) or every compressed entry (heavily compressed layers)."""
    window = min(cfg.window_size, seq_len)
    K = window + (min(cfg.index_topk, seq_len // 4) if ratio == 4 else seq_len / ratio if ratio else 0)
    return math.ceil(K / 64) * 64


def block_activations(shape: ModelShape, blk: Block, lay: Layout, wl: Workload) -> tuple[dict, float, float]:
    """(bytes a block keeps for its backward by part, its transient workspace, its indexer workspace) for one
    micro-batch. The inventory of the tensors autograd saves in dsv4.megatron's block (bf16 = 2 bytes)."""
    c = shape.cfg
    t, cp, S = lay.tp, lay.cp, wl.seq_len
    N = lay.micro_batch * S / cp                      # this CP rank's positions of the micro-batch
    Ns = N / t                                        # its sequence-parallel shard between sublayers
    d, hc, H, D = c.dim, c.hc_mult, c.n_heads / t, c.head_dim
    r = blk.ratio
    out = {}
    # hyper-connections, both sublayers: the streams (bf16), their fp32 flattening for the mixes GEMM, the mixed
    # input and the sublayer's output for hc_post
    out["hyper-connections"] = 2 * Ns * (hc * d * 2 + hc * d * 4 + d * 2 + d * 2)
    # attention on the gathered sequence: x, the q low-rank pair, q (projected, normed/rotated), the latent kv
    # (projected, normed, rotated), kv rows with the compressed entries, indices, o (and de-rotated), lse, wo_a out
    entries = S / r if r else 0
    K_pad = kernel_slots(c, r, S)
    attn = N * (d * 2 + 2 * c.q_lora_rank * 2 + 3 * D * 2 + K_pad * 4) + N * H * (4 * D * 2 + 4) \
        + (N + entries) * D * 2 + N * (c.o_groups / t) * c.o_lora_rank * 2
    if wl.attn_impl == "torch":        # the gather reference: rows per slot (bf16 and its fp32 copy), scores, probs
        attn += N * K_pad * D * (2 + 4) + N * H * K_pad * 4 * 3
    elif wl.attn_impl == "dense":      # masked dense scores against every row (window layers: S, others S + S/m)
        attn += N * H * (S + entries) * 4 * 2
    out["attention"] = attn
    idx_ws = 0.0
    if r:
        coff = 2 if r == 4 else 1
        out["compressors"] = N * 2 * coff * D * 4     # fp32 kv and gate projections
    if r == 4:
        idx_ws = N * (S / 4) * 4                      # fp32 scores of every query against every entry: only CP divides
        if wl.indexer_loss:
            out["indexer"] = N * (c.index_n_heads * c.index_head_dim * 2 * 2 + c.index_topk * 4 * 3) \
                + (S / 4) * c.index_head_dim * 2 * 2
    k, inter = c.n_activated_experts, c.moe_inter_dim
    n_moe = Ns if lay.etp == 1 else N                 # ETP = 1: each rank routes its own shard
    out["router and dispatch"] = Ns * (d * 4 + c.n_routed_experts * 4 * 2) + n_moe * k * d * 2
    out["routed experts"] = n_moe * k * 3 * (inter / lay.etp) * 2
    out["shared expert"] = (0 if lay.etp > 1 else N * d * 2) + N * 3 * (inter / t) * 2
    if wl.recompute == "full":
        full = sum(out.values())
        return {"recompute (block inputs)": Ns * hc * d * 2}, full, idx_ws
    return out, 0.0, idx_ws


def _head_activations(shape: ModelShape, lay: Layout, wl: Workload) -> tuple[float, float]:
    """(saved, transient) bytes of the last stage's head for one micro-batch: hc_head, the gathered norm output,
    the fp32 vocab-parallel logits kept for the cross-entropy; transient: their gradient and the split GEMM's two
    bf16 halves of the fp32 head weight. The halves are what the trainer holds at the head's backward since
    76ff1a9 (split_gemm.weight_halves under stepmemo.weights_fixed() keeps them from the first micro-batch's forward to the end of the backward);
    the code before made them at each forward and only the hi half again for the backward. The fit is of that code
    (plan_calibration.jsonl, 1272d54) and its scale and workspace absorbed the lo half it did not hold; today's
    code measured 1.0 GiB more at the 32-expert shape (108.2 -> 109.2 GiB: the lo half, 0.99 GiB, and the
    compressors' halves, 0.05), which the model does not separate (docs/plan.md).

    head_loss (head_loss_of) "fused", derived from dsv4/kernels/head_loss.py's reads and writes, not measured: for
    the backward a bf16 [N, V] softmax and one fp32 a row (p_label - 1) in place of the fp32 log-softmax, the
    logits' gradient written in place of the softmax, and at most FUSED_LOSS_ROWS rows of fp32 logits at a time:
    the transient is those rows with the halves."""
    c = shape.cfg
    N = lay.micro_batch * wl.seq_len / lay.cp
    V = c.vocab_size / lay.tp
    heads = 1 + (c.n_mtp_layers if wl.mtp else 0)
    fused = head_loss_of(shape, lay, wl) == "fused"
    logits = N * V * 2 + N * 4 if fused else N * V * 4
    saved = heads * (N / lay.tp * c.hc_mult * c.dim * 6 + N * c.dim * 2 + logits)
    gradient = min(N, FUSED_LOSS_ROWS) * V * 4 if fused else N * V * 4
    transient = gradient + 2 * V * c.dim * 2
    return saved, transient


def head_loss_of(shape: ModelShape, lay: Layout, wl: Workload) -> str:
    """The LM head's loss that runs (HEAD_LOSSES): "fused" where the workload or the model config asks for it and
    dsv4.megatron.model.DSV4Stage.fused_head_loss runs it, at TP = 1 with the bf16x3_fwd head GEMM (RL's scored
    log-probabilities and the MTP heads too); "eager" otherwise (the vocab-parallel cross-entropy at TP > 1)."""
    c = shape.cfg
    return "fused" if wl.head_loss == "fused" and lay.tp == 1 and c.fp32_gemm == "bf16x3_fwd" else "eager"


def in_flight(lay: Layout, stage: int, n_micro: int) -> float:
    """Micro-batches whose activations pipeline rank `stage` holds at its peak (in units of a whole stage's)."""
    if lay.pp == 1:
        return 1.0
    if lay.vpp == 1:
        return float(min(lay.pp - stage, n_micro))
    # megatron's interleaved schedule: warm-up (pp - rank - 1) * 2 + (vpp - 1) * pp chunk forwards, plus one
    chunks = min((lay.pp - stage - 1) * 2 + (lay.vpp - 1) * lay.pp + 1, n_micro * lay.vpp)
    return chunks / lay.vpp


def micro_batches(lay: Layout, wl: Workload) -> int:
    if wl.rl:
        return max(1, wl.rl.samples // (wl.rl.minibatches * lay.micro_batch * lay.dp))
    return max(1, wl.global_batch // (lay.micro_batch * lay.dp))


def stage_memory(shape: ModelShape, lay: Layout, wl: Workload, rates: Rates | None, stage: int,
                 ctx: dict | None = None) -> Memory:
    expert_shard = max(1, lay.dp * lay.cp * lay.tp // (lay.ep * lay.etp))
    dense_shard = lay.dp * lay.cp
    last = stage == lay.pp - 1
    static, host, _ = _param_bytes(stage_params(shape, lay, stage, wl, ctx), lay, wl, expert_shard, dense_shard)
    n_micro = micro_batches(lay, wl)
    flight = in_flight(lay, stage, n_micro)
    saved: dict[str, float] = {}
    transient_blocks, idx_ws, stacked, stacked_one, qat, qat_one = 0.0, 0.0, 0.0, 0.0, 0.0, 0.0
    qat_on = fp8_qat(shape, wl)
    grouped = grouped_experts(shape, lay, wl)
    for b, count in _stage_kinds(shape, lay, stage, wl, ctx):
        if b.key.startswith("mtp.") and not wl.mtp:
            continue                                  # MTP neither runs nor trains without its loss
        stacked += stacked_expert_bytes(b, lay) * count
        stacked_one = max(stacked_one, stacked_expert_bytes(b, lay))
        if qat_on:
            q = qat_copy_bytes(b, lay, wl.weight_qdq, grouped)
            qat += q * count
            qat_one = max(qat_one, q)
        acts, trans, iws = _memo(ctx, ("acts", b.kind, lay.tp, lay.cp, lay.etp, lay.micro_batch),
                                 lambda b=b: block_activations(shape, b, lay, wl))
        for p, v in acts.items():
            saved[p] = saved.get(p, 0.0) + v * count
        transient_blocks = max(transient_blocks, trans or sum(acts.values()))
        idx_ws = max(idx_ws, iws)
    head_trans = head_saved = 0.0
    if last:
        head_saved, head_trans = _head_activations(shape, lay, wl)
    scale = rates.act_scale if rates else 1.0
    parts = {k: v / GiB for k, v in static.items()}
    if wl.optimizer == "offload":
        parts.pop("optimizer")
    # the forward-backward phase: what the schedule keeps for the backward, at its fullest
    backward: dict[str, float] = {}
    for p, v in saved.items():
        backward[f"activations: {p}"] = v * flight * scale / GiB
    if head_saved:
        # the head runs once a micro-batch, at the end of its forward: one micro-batch's logits at a time
        backward["activations: lm head"] = head_saved * scale / GiB
    stacking = expert_stacking(shape, lay, wl)
    if stacked and stacking:
        # a copy of weights, not an activation: its size is exact, so the inventory's fitted scale does not apply.
        # Once a step: one copy of every block's experts, from its first forward to the end of the step (the memo
        # keeps it, under full recompute too); at every forward: one a micro-batch in flight, or under full recompute
        # only the block being recomputed (the checkpointed forward's copy is not saved)
        if stacking == "step":
            backward[STACKED] = stacked / GiB
        else:
            backward[STACKED] = (stacked_one if wl.recompute == "full" else stacked * flight) / GiB
    if qat:
        # the bf16 weights out of the FP8 QAT point: exact sizes too. Once a step (c60489a on): one stored value a
        # weight, from the first micro-batch's forward to the end of the step's backward, whatever the micro-batches
        # in flight or the recompute; before, the copy each GEMM saved, one a micro-batch in flight (under full
        # recompute only the block being recomputed)
        if wl.weight_qdq == "step":
            backward[QAT_COPIES] = qat / GiB
        else:
            backward[QAT_COPIES] = (qat_one if wl.recompute == "full" else qat * flight) / GiB
    transient = {"one block's backward": transient_blocks, "indexer fp32 scores": idx_ws,
                 "logits gradient and head halves": head_trans}
    big = max(transient, key=transient.get)
    if transient[big]:
        backward[f"transient: {big}"] = transient[big] * scale / GiB
    # the gradient check after the schedule, when every activation is freed: its temporaries are exact sizes
    buffers = {f"{'routed experts' if a == 'expert' else 'dense parameters'} ({b} weights)": n * 4 / GiB
               for (a, b), n in grad_buffers(stage_params(shape, lay, stage, wl, ctx), lay, wl).items()}
    check = wl.grad_check_bytes / 4 * max(buffers.values(), default=0.0)
    phases = {"forward-backward": sum(backward.values()), "gradient check": check}
    if check > phases["forward-backward"]:
        parts[GRAD_CHECK] = check
    else:
        parts.update(backward)
    if rates:
        parts["workspace"] = rates.workspace_gib
    return Memory(stage, parts, host / GiB, int(round(flight)) if lay.vpp == 1 else flight,
                  {"transients_gib": {k: v * scale / GiB for k, v in transient.items()}, "phases_gib": phases,
                   "backward_gib": backward, "grad_buffers_gib": buffers})


# ================================================================================================ time
class UnknownBandwidth(Exception):
    """A collective crosses a link whose bandwidth the hw layer does not state (HW_NVLINK_GBPS / HW_IB_GBPS = 0)."""


def _bw(gbps: float) -> float:
    if gbps <= 0:
        raise UnknownBandwidth
    return gbps


def _a2a_seconds(nbytes: float, group: int, peers_per_node: int, hw: Hardware) -> float:
    """All-to-all of `nbytes` a rank sends (uniformly to its `group` peers, itself included; routing assumed
    balanced) over NVLink to the peers of its node and the network to the others, both at once."""
    if group <= 1:
        return 0.0
    local = min(group, peers_per_node)
    on = nbytes * (local - 1) / group
    off = nbytes * (group - local) / group
    return max(on / (_bw(hw.nvlink_gbps) * 1e9) if on else 0.0, off / (_bw(hw.ib_gbps) * 1e9) if off else 0.0)


def _ring_seconds(nbytes: float, group: int, contiguous: int, gpus_per_node: int, hw: Hardware,
                  passes: float = 1.0) -> float:
    """A ring all-gather or reduce-scatter (passes=1) or all-reduce (passes=2) of `nbytes` over `group` ranks laid
    `contiguous` apart: within one node when the group fits in it, else across nodes at the network's bandwidth."""
    if group <= 1:
        return 0.0
    bw = hw.nvlink_gbps if contiguous * group <= gpus_per_node else hw.ib_gbps
    return passes * nbytes * (group - 1) / group / (_bw(bw) * 1e9)


_GEMM_PART = {"attention projections": "attention", "compressors": "compressors", "indexer": "indexer",
              "router": "experts", "routed experts": "experts", "shared expert": "experts",
              "hyper-connections": None, "mtp projections": "attention"}


def block_time(shape: ModelShape, b: Block, lay: Layout, wl: Workload, hw: Hardware) -> dict:
    """Seconds one micro-batch costs one block on its rank (forward + backward, recompute's forward), by part."""
    R, c = hw.rates, shape.cfg
    t, cp, S = lay.tp, lay.cp, wl.seq_len
    N = lay.micro_batch * S / cp
    Ns = N / t
    fwd_passes = 3.0 + (1.0 if wl.recompute == "full" else 0.0)
    out: dict[str, float] = {}

    def add(k, v):
        out[k] = out.get(k, 0.0) + v

    for part, f, rep in b.flops:
        gemm = _GEMM_PART.get(part)
        if gemm is None:
            continue
        if part in ("router", "routed experts", "mtp projections"):
            work = Ns * f * fwd_passes                # the rank's own shard (ETP=1), or 1/ETP of the gathered rows
        elif part == "indexer":
            # whole on every TP rank; frozen (no loss) it runs forward only
            work = N * f * (fwd_passes if wl.indexer_loss else 1.0)
        else:
            work = N * f * (rep + (1 - rep) / t) * fwd_passes
        add("routed experts" if part == "router" else part, work / (R.tflops[gemm] * 1e12))
    # the sparse attention kernels over the slots they visit (padded to their 64-blocks)
    per = N * (c.n_heads / t) * kernel_slots(c, b.ratio, S) * c.head_dim
    fwd = 4 * per / (R.sparse_fwd_tflops * 1e12)
    bwd = 10 * per / (R.sparse_bwd_tflops * 1e12)
    slow = ATTN_SLOWDOWN[wl.attn_impl]
    add("sparse attention", slow * (fwd * (2 if wl.recompute == "full" else 1) + bwd))
    add("elementwise (hc, norms, routing)",
        R.elementwise_ns * 1e-9 * Ns * (c.dim * c.hc_mult / 16384) * fwd_passes / 3.0)
    add("fixed per layer", R.layer_mb_s)
    gpn = hw.gpus_per_node
    # TP: the attention and the shared expert (or ETP's MoE) gather the sequence and reduce-scatter their output,
    # forward and backward
    add("TP collectives", 8 * _ring_seconds(N * c.dim * 2, t, 1, gpn, hw))
    # EP: dispatch and combine, forward and backward: the rank's tokens x top-k rows of dim (bf16)
    # (ETP = TP: every rank of the TP group dispatches the gathered tokens to its peers, which sit ETP ranks apart)
    n_moe = Ns if lay.etp == 1 else N
    add("EP all-to-all", 4 * _a2a_seconds(n_moe * c.n_activated_experts * c.dim * 2, lay.ep, max(1, gpn // lay.etp),
                                          hw))
    if cp > 1:
        # halo rows of x, every chunk's compressed entries (and the indexer's keys): gathered forward,
        # reduce-scattered backward, over the CP group (ranks TP apart)
        reach = max(c.window_size - 1, (2 * b.ratio - 1 if b.ratio == 4 else b.ratio - 1) if b.ratio else 0)
        L = S / (2 * cp)
        halo = 2 * min(reach, L) * c.dim * 2 * lay.micro_batch
        entries = (S / b.ratio * c.head_dim * 2 if b.ratio else 0) * lay.micro_batch
        keys = (S / 4 * c.index_head_dim * 2 if b.ratio == 4 else 0) * lay.micro_batch
        add("CP gathers", 2 * (_ring_seconds(halo * cp, cp, t, gpn, hw) + _ring_seconds(entries + keys, cp, t, gpn, hw)))
    return out


ATTN_SLOWDOWN = {"tilelang": 1.0, "torch": 20.0, "dense": 10.0}   # kernels.jsonl: the torch fallback is 15-38x slower


def stage_time(shape: ModelShape, lay: Layout, wl: Workload, hw: Hardware, stage: int, ctx: dict | None = None) -> dict:
    """Seconds one micro-batch costs pipeline rank `stage` (forward + backward), by part."""
    c = shape.cfg
    t = lay.tp
    N = lay.micro_batch * wl.seq_len / lay.cp
    out: dict[str, float] = {}

    def add(k, v):
        out[k] = out.get(k, 0.0) + v

    for b, count in _stage_kinds(shape, lay, stage, wl, ctx):
        if b.key.startswith("mtp.") and not wl.mtp:
            continue
        per = _memo(ctx, ("time", b.kind, lay.tp, lay.cp, lay.ep, lay.etp, lay.micro_batch),
                    lambda b=b: block_time(shape, b, lay, wl, hw))
        for k, v in per.items():
            add(k, v * count)
    if stage == lay.pp - 1:
        heads = 1 + (c.n_mtp_layers if wl.mtp else 0)
        passes = 3.0 + (1.0 if wl.recompute == "full" else 0.0)
        add("lm head", heads * passes * N * shape.head_flops / t / (hw.rates.tflops["head"] * 1e12))
        # the loss's memory-bound passes over the [N, V/TP] logits (LOSS_BYTES: derived, not measured), which the
        # fit took out of the head's rate; the head is outside the recomputed blocks, so once a micro-batch
        add("lm head", heads * N * c.vocab_size / t * LOSS_BYTES[head_loss_of(shape, lay, wl)]
            / (hw.rates.stream_gbps * 1e9))
        add("TP collectives", 2 * heads * _ring_seconds(N * c.dim * 2, t, 1, hw.gpus_per_node, hw))
    if lay.pp > 1:
        # the residual streams to the next stage forward and their gradient back, per virtual chunk
        act = N / t * c.hc_mult * c.dim * 2
        across = lay.tp * lay.cp * lay.dp >= hw.gpus_per_node
        add("PP p2p", 2 * lay.vpp * act / (_bw(hw.ib_gbps if across else hw.nvlink_gbps) * 1e9))
    R = hw.rates
    if expert_stacking(shape, lay, wl) == "micro_batch":
        # every forward (a recompute's too) stacks the experts again: the stacked bytes read and written
        fwds = 2.0 if wl.recompute == "full" else 1.0
        add(STACKING, fwds * stage_stacked_bytes(shape, lay, stage, wl, ctx) * STACK_PASSES / (R.stream_gbps * 1e9))
    items = stage_params(shape, lay, stage, wl, ctx)
    bf16 = _trained_by_dtype(items, lay, wl)["bf16"]
    if fused_expert_wgrad(shape, lay, wl):
        experts = _trained_by_dtype([(k, n) for k, n in items if k[0] == "exp"], lay, wl)["bf16"]
        bf16 -= experts
        add("experts' wgrad into main_grad", experts * EPILOGUE_BYTES / (R.stream_gbps * 1e9))
    add("gradient accumulation", bf16 * GRAD_ACCUM_BYTES / (R.grad_accum_gbps * 1e9))
    if wl.fp32_split == "micro_batch":
        add("fp32 weight splits", split_elements(shape, lay, stage, wl, ctx, per="micro_batch")
            * (SPLIT_BYTES + SPLIT_BACKWARD_BYTES) / (R.stream_gbps * 1e9))
    if fp8_qat(shape, wl):
        if wl.weight_qdq == "micro_batch":
            # the code before c60489a: every forward quantises every weight
            add(QAT_OPS, stage_qat_seconds(shape, lay, stage, wl, R, ctx))
        else:
            # today's: a forward looks each weight's stored value up (the quantisation is once a step: _step_time)
            add(QAT_LOOKUPS, stage_qat(shape, lay, stage, wl, ctx, qat_weights) * QDQ_LOOKUP_OPS * R.host_op_s)
    return out


def expert_wgrad_path(shape: ModelShape, lay: Layout, wl: Workload) -> str:
    """Where the routed experts' weight gradients go (EXPERT_WGRADS): "main_grad" (dsv4.megatron.layers._ExpertGemm,
    one cuBLAS GEMM an expert accumulating into main_grad) or "triton" (one Triton grouped GEMM a weight doing the
    same: moe_impl=grouped_triton, or the workload's expert_wgrad) for the grouped GEMM (grouped_experts: EP = 1,
    and EP > 1 since f338075) of plain bf16 weights (no QAT point) under today's code; "hook" (a bf16 gradient that
    megatron's hook adds) otherwise: EP > 1 before f338075 (ep_experts "loop"), FP8 QAT, moe_impl grouped_autograd
    or loop, the code before 76ff1a9."""
    impl = shape.cfg.moe_impl
    if wl.expert_wgrad == "hook" or not grouped_experts(shape, lay, wl) or fp8_qat(shape, wl) \
            or impl == "grouped_autograd":
        return "hook"
    return "triton" if wl.expert_wgrad == "triton" or impl == "grouped_triton" else "main_grad"


def fused_expert_wgrad(shape: ModelShape, lay: Layout, wl: Workload) -> bool:
    """The routed experts' weight gradients go straight into main_grad (expert_wgrad_path "main_grad" or "triton")."""
    return expert_wgrad_path(shape, lay, wl) != "hook"


def split_elements(shape: ModelShape, lay: Layout, stage: int, wl: Workload, ctx: dict | None = None,
                   per: str = "step") -> float:
    """Elements of the fp32 weights rank `stage` splits into bf16 halves (split_gemm), per step (each once) or per
    micro-batch (each at every call: the head once a set of logits, MTP's included)."""
    c = shape.cfg
    total = sum(b.split_elems * count for b, count in _stage_kinds(shape, lay, stage, wl, ctx)
                if wl.mtp or not b.key.startswith("mtp."))
    if stage == lay.pp - 1:
        heads = 1 + (c.n_mtp_layers if wl.mtp and per == "micro_batch" else 0)
        total += heads * c.vocab_size / lay.tp * c.dim
    return total


@dataclass
class Prediction:
    shape: str
    layout: Layout
    workload: Workload
    hardware: str
    memory: Memory                     # the fullest rank's
    stage_memory_gib: list             # total per stage
    usable_gib: float
    fits: bool
    overflow: str                      # why not, by part ("" when it fits)
    time: dict                         # seconds per step by part (empty without rates)
    step_s: float | None
    tokens_per_s_gpu: float | None
    mfu: float | None
    bottleneck: str
    notes: list
    rates: str = ""                    # where the step-time rates come from

    @property
    def peak_gib(self) -> float:
        return self.memory.total

    def to_json(self) -> dict:
        return {"layout": self.layout.to_json(), "model": self.shape, "hardware": self.hardware,
                "peak_gib": round(self.peak_gib, 2), "usable_gib": round(self.usable_gib, 2), "fits": self.fits,
                "overflow": self.overflow, "memory_stage": self.memory.stage, "in_flight": self.memory.in_flight,
                "memory_gib": {k: round(v, 3) for k, v in self.memory.parts.items()},
                "host_gib": round(self.memory.host_gib, 2),
                "stage_memory_gib": [round(x, 2) for x in self.stage_memory_gib],
                "step_s": None if self.step_s is None else round(self.step_s, 4),
                "time_s": {k: round(v, 5) for k, v in self.time.items()},
                "tokens_per_s_gpu": None if self.tokens_per_s_gpu is None else round(self.tokens_per_s_gpu, 1),
                "mfu": None if self.mfu is None else round(self.mfu, 4), "bottleneck": self.bottleneck,
                "rates": self.rates, "notes": self.notes}


def predict(shape: ModelShape, lay: Layout, wl: Workload, hw: Hardware, ctx: dict | None = None,
            time_if_oom: bool = True) -> Prediction:
    """Memory of the fullest rank and the step's time by part (time only where the hardware has rates). `ctx`:
    a memo shared by the predictions of one planning pass."""
    R = hw.rates
    mems = [stage_memory(shape, lay, wl, R, s, ctx) for s in range(lay.pp)]
    usable = hw.usable_gib
    notes: list[str] = []
    rl_mem = rollout_memory(shape, lay, wl, hw) if wl.rl else {}
    for m in mems:
        m.parts.update(rl_mem)
    worst = max(mems, key=lambda m: m.total)
    fits = worst.total <= usable or not hw.memory_gib
    overflow = "" if fits else _overflow(shape, lay, wl, hw, worst, usable)
    if expert_wgrad_path(shape, lay, wl) == "triton":
        notes.append("moe_impl=grouped_triton: the Triton grouped wgrad is not yet timed; taken at the experts' "
                     "grouped GEMM rate with the fp32 main_grad read and written once a micro-batch (as the cuBLAS loop)")
    if head_loss_of(shape, lay, wl) == "fused":
        notes.append(f"head_loss=fused: its memory (a bf16 softmax kept, {FUSED_LOSS_ROWS} rows of fp32 logits at a "
                     f"time) and its loss passes ({LOSS_BYTES['fused']} bytes an element of the logits against "
                     f"eager's {LOSS_BYTES['eager']}) are derived from the code, not measured")
    elif wl.head_loss == "fused":
        notes.append("head_loss=fused runs at TP = 1 with fp32_gemm=bf16x3_fwd only: the eager loss is modelled here")
    if wl.quant_chunk == "gpu" and (fp8_qat(shape, wl) or (wl.rl and wl.rl.sync_format == "fp8")):
        notes.append("FP8 QAT and sync in the quantisers' 2^24-element chunks (3fd1ccf): not yet timed; each eager "
                     "chain charged the longer of its ops at the host's time an op and its bytes (derived from the "
                     "ops) at the streaming rate")
    if wl.rl and wl.rl.engine == "sglang":
        notes.append("SGLang's decode is timed at the embedded engine's measured bandwidth (SGLang is not measured "
                     "here)")
    if wl.rl and wl.rl.engine == "sglang" and hw.memory_gib:
        need, room = sglang_engine_gib(shape, wl), wl.rl.mem_fraction * hw.memory_gib
        notes.append(f"an SGLang rank needs {need:.1f} GiB of weights and KV cache (TP {wl.rl.rollout_tp}, EP "
                     f"{wl.rl.rollout_ep}) in its {room:.1f} GiB reservation")
        if need > room:
            fits = False
            overflow = (f"memory, rollout engine weights: an SGLang rank needs {need:.1f} GiB of weights and KV "
                        f"cache, more than its {room:.1f} GiB (V4_ROLLOUT_MEM_FRACTION={wl.rl.mem_fraction:g}): raise "
                        "V4_ROLLOUT_TP / V4_ROLLOUT_EP") + ("; " + overflow if overflow else "")
    time: dict[str, float] = {}
    step = tps = mfu = None
    bottleneck = ""
    if R is None:
        notes.append(f"no step-time rates for {hw.gpu or hw.name} (benchmarks/records/plan_calibration.jsonl): "
                     "memory only")
    elif fits or time_if_oom:
        try:
            time = _step_time(shape, lay, wl, hw, ctx)
        except UnknownBandwidth:
            notes.append("a collective crosses a link of unknown bandwidth (HW_NVLINK_GBPS / HW_IB_GBPS = 0): "
                         "no step time")
    if time:
        step = sum(time.values())
        seqs = wl.rl.samples if wl.rl else wl.global_batch
        gpus = lay.world + (wl.rl.rollout_gpus if wl.rl and not wl.rl.colocated else 0)
        tps = seqs * wl.seq_len / step / gpus
        mfu = shape.train_flops[1 if wl.mtp else 0] * tps / (hw.peak_tflops * 1e12) if hw.peak_tflops else None
        name = max(time, key=time.get)
        bottleneck = f"{name} ({time[name] / step:.0%})"
    rates = "" if R is None else (f"rates measured on the {R.gpu}" if R.source == "measured"
                                  else f"{R.gpu} rates scaled from a measured GPU's (an assumption)")
    return Prediction(shape.name, lay, wl, hw.name, worst, [m.total for m in mems], usable, fits, overflow, time,
                      step, tps, mfu, bottleneck, notes, rates)


def pipeline_seconds(stage_seconds: list[float], n_micro: int, vpp: int = 1) -> float:
    """One pass of `n_micro` micro-batches through stages that take `stage_seconds` each a micro-batch (forward +
    backward). 1F1B: the first micro-batch passes every stage, the others follow at the slowest stage's pace, so
    uniform stages give (M + PP - 1) t and a bubble of (PP - 1) / (M + PP - 1); interleaving with V virtual stages a
    rank divides the fill and drain by V: (PP - 1) / (V M + PP - 1)."""
    slowest = max(stage_seconds)
    return n_micro * slowest + (sum(stage_seconds) - slowest) / vpp


def _step_time(shape: ModelShape, lay: Layout, wl: Workload, hw: Hardware, ctx: dict | None) -> dict:
    """Seconds a step by part: the pipeline over the slowest stage (1F1B: the first micro-batch passes every stage,
    the rest follow at the slowest stage's pace; interleaving divides the fill and drain by its virtual stages),
    then the data-parallel gradient reduction, the TP all-reduce of the replicated parameters' gradients and the
    optimizer; RL adds the rollout and the weight sync."""
    n_micro = micro_batches(lay, wl)
    per_stage = [stage_time(shape, lay, wl, hw, s, ctx) for s in range(lay.pp)]
    totals = [sum(p.values()) for p in per_stage]
    slow = max(range(lay.pp), key=lambda s: totals[s])
    pipe = pipeline_seconds(totals, n_micro, lay.vpp)
    time = {k: v * n_micro for k, v in per_stage[slow].items()}
    time["PP bubble"] = pipe - n_micro * totals[slow]
    dp_t, tp_grad = _grad_sync_seconds(shape, lay, wl, hw, slow, ctx)
    if wl.overlap_grad_reduce:
        # megatron reduces each bucket as the last micro-batch's backward produces it
        dp_t = max(0.0, dp_t - 2.0 / 3.0 * totals[slow])
    time["DP gradient sync"] = dp_t
    time["TP replicated-grad all-reduce"] = tp_grad
    time["optimizer"] = _optimizer_seconds(shape, lay, wl, hw, slow, ctx)
    if wl.fp32_split == "step":
        # split_gemm.weight_halves under stepmemo.weights_fixed(): each fp32 weight split once, at the first micro-batch's forward
        time["fp32 weight splits"] = split_elements(shape, lay, slow, wl, ctx) * SPLIT_BYTES / (
            hw.rates.stream_gbps * 1e9)
    if expert_stacking(shape, lay, wl) == "step":
        # _ExpertGemm's stack under weights_fixed(): each block's experts stacked once, at the first micro-batch's
        # forward on the slowest stage
        time[STACKING] = stage_stacked_bytes(shape, lay, slow, wl, ctx) * STACK_PASSES / (hw.rates.stream_gbps * 1e9)
    if fp8_qat(shape, wl) and wl.weight_qdq == "step":
        # dsv4.quant._weight_qdq inside weights_fixed() (c60489a): each weight quantised once a step, at the first
        # micro-batch's forward on its stage. That forward is the first micro-batch's path through the pipeline, so
        # every stage's pass adds up (at PP 1 the one stage's)
        time[QAT_OPS] = sum(stage_qat_seconds(shape, lay, s, wl, hw.rates, ctx) for s in range(lay.pp))
    updates = wl.rl.minibatches if wl.rl else 1
    if updates > 1:
        time = {k: v * updates for k, v in time.items()}
    if wl.rl:
        time.update(rollout_time(shape, lay, wl, hw))
    return {k: v for k, v in time.items() if v}


def _overflow(shape: ModelShape, lay: Layout, wl: Workload, hw: Hardware, m: Memory, usable: float) -> str:
    """Why a layout does not fit, by part: "memory, <cause>: <figures>; <what to do>"."""
    parts = sorted(m.parts.items(), key=lambda kv: -kv[1])
    top = ", ".join(f"{k} {v:.1f}" for k, v in parts[:4])
    figures = (f"{m.total:.1f} GiB on stage {m.stage} > {usable:.1f} usable of {hw.memory_gib:g} "
               f"({top}; {m.in_flight} micro-batch(es) in flight)")
    state = m.parts.get("weights", 0) + m.parts.get("gradients", 0) + m.parts.get("optimizer", 0)
    opt = m.parts.get("optimizer", 0)
    dense = m.parts.get("activations: attention", 0) if wl.attn_impl == "dense" else 0
    idx = m.detail.get("transients_gib", {}).get("indexer fp32 scores", 0)
    rollout = sum(v for k, v in m.parts.items() if k.startswith("rollout engine"))
    if state > usable:
        return (f"memory, state alone: {figures}; weights, gradients and Adam state do not fit before the first "
                "activation: spread the model wider (EP, PP, TP) or shard the optimizer (dist) / offload it")
    if rollout and m.total - rollout <= usable:
        return (f"memory, rollout engine: {figures}; the colocated engine takes {rollout:.1f} GiB: give it its own "
                "nodes (V4_ROLLOUT_NODES) or a smaller share")
    also = f"; the colocated engine adds {rollout:.1f} GiB (V4_ROLLOUT_NODES moves it off)" if rollout else ""
    check = m.parts.get(GRAD_CHECK, 0)
    if check and m.total - check + m.detail["phases_gib"]["forward-backward"] <= usable:
        # the check is what tips it over: the forward-backward alone would fit
        buf, n = max(m.detail.get("grad_buffers_gib", {}).items(), key=lambda kv: kv[1], default=("", 0.0))
        return (f"memory, gradient check: {figures}; after the backward, the finite check of the {n:.1f} "
                f"GiB fp32 gradient buffer of the {buf} ({wl.grad_check_bytes} bytes an element: torch.isfinite's "
                f"fp32 copy and three bools, Trainer._grads_finite before e352e77; today's all_finite allocates "
                f"nothing) tops the state: fewer local experts (more EP) or fewer layers a rank{also}")
    if opt and m.total - opt - rollout <= usable:
        return (f"memory, Adam state: {figures}; the first step's backward would fit, but the Adam state its "
                "optimizer step creates overflows the second backward (the DSV4 OOM of radixark/miles#3142): shard "
                f"it (dist) or offload it{also}")
    if dense > 0.25 * usable:
        return (f"memory, dense attention: {figures}; the dense fallback's scores take {dense:.1f} GiB (the OOM of "
                f"verl#6943 with CP > 1): use the sparse kernel{also}")
    if idx > 0.1 * usable:
        return (f"memory, indexer scores: {figures}; the indexer's fp32 [S/CP, S/4] scores take {idx:.1f} GiB a "
                f"layer, which only CP divides (radixark/miles#1766): raise CP{also}")
    return (f"memory, activations: {figures}; fewer micro-batches in flight (more PP stages, smaller micro-batch), "
            f"more CP or TP, or recompute{also}")


def _grad_sync_seconds(shape: ModelShape, lay: Layout, wl: Workload, hw: Hardware, stage: int,
                       ctx: dict | None = None) -> tuple[float, float]:
    """(data-parallel gradient reduction, TP all-reduce of the replicated parameters' gradients) of one step."""
    dense = exp = rep = 0.0
    for (shard, fp32, group), n in stage_params(shape, lay, stage, wl, ctx):
        if not _trained(group, wl):
            continue
        if shard == "exp":
            exp += n / (lay.ep * lay.etp)
        else:
            dense += n / (lay.tp if shard == "tp" else 1)
            rep += n if shard == "rep" else 0
    n_dense, n_exp = lay.dp * lay.cp, max(1, lay.dp * lay.cp * lay.tp // (lay.ep * lay.etp))
    gpn = hw.gpus_per_node
    if wl.optimizer == "dist":      # reduce-scatter fp32 grads, all-gather bf16 params
        dp = (_ring_seconds(dense * 4, n_dense, lay.tp, gpn, hw) + _ring_seconds(dense * 2, n_dense, lay.tp, gpn, hw)
              + _ring_seconds(exp * 4, n_exp, lay.ep * lay.etp, gpn, hw)
              + _ring_seconds(exp * 2, n_exp, lay.ep * lay.etp, gpn, hw))
    else:
        dp = (_ring_seconds(dense * 4, n_dense, lay.tp, gpn, hw, 2)
              + _ring_seconds(exp * 4, n_exp, lay.ep * lay.etp, gpn, hw, 2))
    tp = _ring_seconds(rep * 4, lay.tp, 1, gpn, hw, 2)
    return dp, tp


OFFLOAD_PCIE_GBPS = 25.0           # assumption: effective host<->GPU copy per GPU (PCIe Gen5 x16 ~ 50 GB/s, shared)
OFFLOAD_ADAM_S_PER_PARAM = 1.0e-9  # assumption: host Adam over one GPU's share of the node's cores


def _optimizer_seconds(shape: ModelShape, lay: Layout, wl: Workload, hw: Hardware, stage: int,
                       ctx: dict | None = None) -> float:
    expert_shard = max(1, lay.dp * lay.cp * lay.tp // (lay.ep * lay.etp))
    items = stage_params(shape, lay, stage, wl, ctx)
    _, _, trained = _param_bytes(items, lay, wl, expert_shard, lay.dp * lay.cp)
    if wl.optimizer == "offload":
        return trained * (4 + 2) / (OFFLOAD_PCIE_GBPS * 1e9) + trained * OFFLOAD_ADAM_S_PER_PARAM
    share = 1.0
    if wl.optimizer == "dist":
        share = 1.0 / max(1, lay.dp * lay.cp)
    return _adam_bytes(_trained_by_dtype(items, lay, wl)) * share / (hw.rates.optimizer_gbps[wl.adam_kernel] * 1e9)


def _adam_bytes(trained: dict) -> float:
    return sum(n * ADAM_BYTES[dtype] for dtype, n in trained.items())


# ================================================================================================ RL
def kv_bytes_per_sequence(cfg, length: int) -> float:
    """The decode cache of one sequence: per layer a 128-row window ring of the latent, the compressed entries, and on
    ratio-4 layers the indexer's keys (bf16)."""
    total = 0.0
    for i in range(cfg.n_layers):
        r = cfg.layer_ratio(i)
        total += cfg.window_size * cfg.head_dim * 2
        if r:
            total += length / r * cfg.head_dim * 2
        if r == 4:
            total += length / 4 * cfg.index_head_dim * 2
    return total


_SYNC: dict = {}


def _sync_items(shape: ModelShape, fmt: str) -> list:
    """(name, elements, bytes an element) of every weight a sync sends: in the trainer's dtype, or with fmt=fp8 the
    release's FP8/FP4 linears as e4m3 (1 byte) with a 128x128 block's scale."""
    key = (shape.name, fmt)
    if key not in _SYNC:
        cfg, out = shape.cfg, []
        for name, s in cfg.param_shapes().items():
            store = cfg.storage_format(name)
            if fmt == "fp8" and store in ("fp8", "fp4"):
                out.append((name, math.prod(s), 1 + 1 / (BLOCK * BLOCK)))
            else:
                out.append((name, math.prod(s), 4 if _param_kind(name, cfg)[1] else 2))
        _SYNC[key] = out
    return _SYNC[key]


def _sync_bytes(shape: ModelShape, fmt: str) -> float:
    return sum(n * b for _, n, b in _sync_items(shape, fmt))


def rollout_memory(shape: ModelShape, lay: Layout, wl: Workload, hw: Hardware) -> dict:
    """GiB the rollout engine takes on a trainer GPU (colocated only)."""
    rl = wl.rl
    if rl is None or not rl.colocated:
        return {}
    if rl.engine == "sglang":
        # SGLang reserves its fraction of the GPU for weights and KV cache up front, whatever they need
        return {"rollout engine (SGLang --mem-fraction-static)": rl.mem_fraction * hw.memory_gib}
    cfg = shape.cfg
    # the embedded engine holds a whole model in its process, a second copy of the routed experts stacked for its
    # decode GEMMs, the head's bf16 halves, and the KV cache of its share of the samples
    weights = _sync_bytes(shape, rl.sync_format)
    experts = sum(n * 2 for b in shape.blocks for (sh, _, _), n in b.params if sh == "exp")
    halves = 2 * cfg.vocab_size * cfg.dim * 2
    kv = rl.samples / max(1, lay.dp) * kv_bytes_per_sequence(cfg, wl.seq_len)
    return {"rollout engine: weights": weights / GiB, "rollout engine: stacked experts": experts / GiB,
            "rollout engine: head halves": halves / GiB, "rollout engine: KV cache": kv / GiB}


def sglang_engine_gib(shape: ModelShape, wl: Workload) -> float:
    """GiB of weights and KV cache one SGLang rank needs: dense weights over its TP, experts over its EP (SGLang splits
    the experts inside a TP group), the KV of its share of the samples (the latent KV head is not split by TP)."""
    rl = wl.rl
    dense = experts = 0.0
    for name, n, fmt in _sync_items(shape, rl.sync_format):
        if ".experts." in name and ".shared_experts." not in name:
            experts += n * fmt
        else:
            dense += n * fmt
    servers = max(1, rl.rollout_gpus // rl.rollout_tp) if not rl.colocated and rl.rollout_gpus else 1
    kv = rl.samples / servers * kv_bytes_per_sequence(shape.cfg, wl.seq_len)
    return (dense / rl.rollout_tp + experts / rl.rollout_ep + kv) / GiB


def _decode_bytes(cfg, batch: int, length: int, tp: int = 1, ep: int = 1) -> float:
    """Bytes one decode step reads on one engine rank: every weight but the embedding and the routed experts, the
    experts the batch's routes activate (uniform routing), the batch's KV rows (window, attended entries, every
    indexer key)."""
    E, k = cfg.n_routed_experts, cfg.n_activated_experts
    active = E * (1 - (1 - k / E) ** batch)
    expert = 3 * cfg.moe_inter_dim * cfg.dim * 2
    key = ("decode", json.dumps(cfg.to_dict(), sort_keys=True))
    if key not in _SYNC:
        _SYNC[key] = sum(math.prod(s) * (4 if name == "head.weight" else 2) for name, s in cfg.param_shapes().items()
                         if name != "embed.weight" and ".experts." not in name and not name.endswith("tid2eid"))
    non_expert = _SYNC[key]
    kv = 0.0
    for i in range(cfg.n_layers):
        r = cfg.layer_ratio(i)
        kv += cfg.window_size * cfg.head_dim * 2
        if r == 4:
            kv += min(cfg.index_topk, length // 4) * cfg.head_dim * 2 + length / 4 * cfg.index_head_dim * 2
        elif r:
            kv += length / r * cfg.head_dim * 2
    return non_expert / tp + cfg.n_layers * active * expert / ep + batch * kv


def decode_step_seconds(cfg, batch: int, length: int, rates: Rates, tp: int = 1, ep: int = 1) -> float:
    bw = _interp_log(rates.decode_gbps, batch) * 1e9
    return _decode_bytes(cfg, batch, length, tp, ep) / bw


def _interp_log(table: dict, x: float) -> float:
    pts = sorted((float(k), float(v)) for k, v in table.items())
    if x <= pts[0][0]:
        return pts[0][1]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x <= x1:
            f = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
            return y0 + f * (y1 - y0)
    return pts[-1][1]


SYNC_DISK_GBPS = 2.0   # assumption: a shared filesystem's write then read per node


def sync_seconds(shape: ModelShape, wl: Workload, hw: Hardware, gpus: int) -> float:
    """The engine's update (push_weights' sync_s): in process at the measured rate; broadcast over NVLink or the
    network; through a disk. The embedded engine's update from an FP8 sync is eager ops too (engine_load): the
    measured rate holds them in the chunks of the run that measured it (Rates.sync_quant_chunk; at 76ff1a9 its
    10,359 ops at the host's time an op are 0.095 s of the 0.094 measured), so another chunking takes the host's
    time of the ops it adds or removes off the measured update, down to no less than the update's bytes at the
    streaming rate."""
    rl, R = wl.rl, hw.rates
    nbytes = _sync_bytes(shape, rl.sync_format)
    if rl.sync == "inproc":
        key = f"inproc_{rl.sync_format}"
        t = nbytes / (R.sync_gbps.get(key, 30.0) * 1e9)
        if (key in R.sync_gbps and rl.engine == "embedded" and rl.sync_format == "fp8"
                and wl.quant_chunk != R.sync_quant_chunk):
            ops, moved = engine_load(shape, wl.quant_chunk)
            then, _ = engine_load(shape, R.sync_quant_chunk)
            t = max(t + (ops - then) * R.host_op_s, moved / (R.stream_gbps * 1e9) if R.stream_gbps else 0.0)
        return t
    if rl.sync == "disk":
        return 2 * nbytes / (SYNC_DISK_GBPS * 1e9)
    # broadcast from the trainer to the engines: within a node over NVLink, to separate nodes over the network
    bw = hw.nvlink_gbps if rl.colocated and gpus <= hw.gpus_per_node else hw.ib_gbps
    return nbytes / (bw * 1e9)


def rollout_time(shape: ModelShape, lay: Layout, wl: Workload, hw: Hardware) -> dict:
    """Seconds of the rollout (prefill + decode) and of the weight sync in one RL step."""
    rl, R, cfg = wl.rl, hw.rates, shape.cfg
    if rl.engine == "embedded":
        engines, tp, ep = max(1, lay.dp), 1, 1
    else:
        gpus = lay.world if rl.colocated else rl.rollout_gpus
        engines, tp, ep = max(1, gpus // max(1, rl.rollout_tp)), rl.rollout_tp, rl.rollout_ep
    batch = max(1, math.ceil(rl.samples / engines))
    prompt = max(1, wl.seq_len - rl.response_tokens)
    decode = sum(decode_step_seconds(cfg, batch, prompt + i, R, tp, ep)
                 for i in range(0, rl.response_tokens, max(1, rl.response_tokens // 16)))
    decode *= rl.response_tokens / len(range(0, rl.response_tokens, max(1, rl.response_tokens // 16)))
    from dsv4.flops import forward_flops_per_token
    fwd = sum(forward_flops_per_token(cfg, prompt).values())
    prefill = batch * prompt * fwd / tp / (R.tflops["attention"] * 1e12)
    out = {"rollout decode": decode, "rollout prefill": prefill, "weight sync": sync_seconds(shape, wl, hw, lay.world)}
    out["weight sync: quantisation and read-back (eager ops)"] = sync_host_seconds(shape, rl, R, wl.quant_chunk)
    return out


def _sync_host(shape: ModelShape, rl: RLWorkload, chunk: str = "gpu") -> tuple[float, float, float]:
    """(ops, bytes) of the trainer's FP8 quantisation of one weight sync in the quantisers' `chunk`s, and the
    read-back's ops (sync_host_ops)."""
    readback = rl.engine == "embedded"
    key = ("host ops", shape.name, rl.sync_format, readback, chunk)
    if key not in _SYNC:
        cfg, ops, nbytes, back = shape.cfg, 0.0, 0.0, 0.0
        for name, s in cfg.param_shapes().items():
            quantized = rl.sync_format == "fp8" and len(s) == 2 and cfg.storage_format(name) in ("fp8", "fp4")
            if quantized:
                ops += fp8_quant_ops(*s, chunk)
                nbytes += fp8_quant_bytes(*s, chunk)
            if readback:
                back += READBACK_OPS["quantized" if quantized else "exact"]
        _SYNC[key] = (ops, nbytes, back)
    return _SYNC[key]


def sync_host_ops(shape: ModelShape, rl: RLWorkload, chunk: str = "gpu") -> float:
    """Eager torch ops the trainer's side of one weight sync runs on rank 0 besides sending (dsv4.rl.loop.
    push_weights): the FP8 quantisation of every FP8- or FP4-stored linear (sync_tensors, on the trainer's device:
    dsv4.rl.loop.full_weights moves the gathered weights there) in the quantisers' `chunk`s and, with the embedded
    engine, the read-back of every tensor (_read_back, no chunks: a probe of 4,096 values and the tensor's amax, with
    host syncs; SGLang's names are not read back)."""
    ops, _, back = _sync_host(shape, rl, chunk)
    return ops + back


def sync_host_seconds(shape: ModelShape, rl: RLWorkload, rates: Rates, chunk: str = "gpu") -> float:
    """Those ops' time: the quantisation's at the host's time an op or its bytes at the streaming rate where the
    device is the slower (eager_seconds), the read-back's at the host's time an op (it waits on the device at each
    of its syncs)."""
    ops, nbytes, back = _sync_host(shape, rl, chunk)
    quantise = eager_seconds(ops, nbytes, rates)
    return (ops + back) * rates.host_op_s if quantise == ops * rates.host_op_s else quantise + back * rates.host_op_s


def engine_load(shape: ModelShape, chunk: str = "gpu") -> tuple[float, float]:
    """(eager ops, bytes read and written) of the embedded engine's update from an FP8 sync (EmbeddedEngine.
    load_named on its CUDA device): each FP8- or FP4-stored linear dequantised to fp32 in the quantisers' `chunk`s,
    cast to bf16 and copied into its parameter; every other tensor copied in as sent."""
    key = ("engine load", shape.name, chunk)
    if key not in _SYNC:
        cfg, ops, nbytes = shape.cfg, 0.0, 0.0
        for name, s in cfg.param_shapes().items():
            n = math.prod(s)
            if len(s) == 2 and cfg.storage_format(name) in ("fp8", "fp4"):
                ops += 1 + _dequant_chunks(*s, chunk) * DEQUANT_CHUNK_OPS + LOAD_CAST_OPS
                nbytes += n * (DEQUANT_BYTES + LOAD_CAST_BYTES)
            else:
                ops += 1
                nbytes += 2 * n * (4 if _param_kind(name, cfg)[1] else 2)
        _SYNC[key] = (ops, nbytes)
    return _SYNC[key]


# ================================================================================================ calibration
def _msgspec_types():
    import msgspec

    class Row(msgspec.Struct, forbid_unknown_fields=True):
        gpu: str                                    # HW_GPU_NAME
        source: str                                 # measured | scaled
        note: str
        date: str = ""
        commit: str = ""
        records: list[str] = []                     # the bench rows it comes from
        model: str = "4layer"
        overrides: list[str] = []
        seq_len: int = 4096
        global_batch: int = 8
        step_s: dict[str, float] = {}               # micro-batch -> measured s/step
        peak_gib: dict[str, float] = {}             # micro-batch -> measured peak (max_memory_allocated)
        profile_ms: dict[str, float] = {}           # part -> ms of the profiled step (stepprof.PARTS)
        grad_accum_ms: float = 0.0                  # the profile's main_grad accumulation (bf16 grads), a step
        adam_kernel: str = "foreach"                # the Adam kernel of the timed steps and the profile
        fused_adam_ms: float = 0.0                  # the optimizer part of a profile with the fused Adam ...
        fused_adam_overrides: list[str] = []        # ... of this shape (model overrides; the row's model)
        sparse_fwd_tflops: float = 0.0
        sparse_bwd_tflops: float = 0.0
        decode_ms: dict[str, float] = {}            # batch -> ms a decode step (graph mode)
        decode_prompt: int = 256
        sync_gbps: dict[str, float] = {}            # method_format -> GB/s measured
        scale_from: str = ""                        # source=scaled: the measured row it derives from
        compute_ratio: float = 1.0                  # GEMM rates x this
        memory_ratio: float = 1.0                   # memory-bound rates x this
        outside_allocator_gib: float = 0.0          # device memory the process holds beyond torch's reserved pool
        outside_allocator_source: str = ""          # ... where that was read
        fp32_split: str = "step"                    # the code of the timed steps and the profile (Workload's)
        expert_wgrad: str = "main_grad"
        expert_stack: str = "micro_batch"           # (unnamed: the code before the memo, as every row so far)
        head_loss: str = "eager"
        quant_chunk: str = "cpu_sized"              # (unnamed: the quantisers' 2^19-element chunks, 3fd1ccf's
                                                    # before, as every row so far: its sync's eager ops and update)
        sync_host_s: float = 0.0                    # an RL step's in-process FP8 sync of the row's model, less the
                                                    # engine's update (time_sync_s - sync_s): the eager ops' time
        sync_host_source: str = ""
    return msgspec, Row


@functools.lru_cache(maxsize=4)
def calibration_rows(path: str = str(CALIBRATION_FILE)) -> tuple:
    msgspec, Row = _msgspec_types()
    rows = []
    for no, line in enumerate(Path(path).read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(msgspec.json.decode(line, type=Row))
            except msgspec.ValidationError as e:
                raise ValueError(f"{path}:{no}: {e}") from None
    return tuple(rows)


@functools.lru_cache(maxsize=8)
def rates_for(gpu: str, path: str = str(CALIBRATION_FILE)) -> Rates | None:
    """The rates of the GPU whose HW_GPU_NAME is `gpu` (None: no row for it)."""
    rows = {r.gpu: r for r in calibration_rows(path)}
    row = rows.get(gpu)
    if row is None:
        return None
    if row.source == "scaled":
        base = derive_rates(rows[row.scale_from])
        return replace(base, gpu=row.gpu, source="scaled", note=row.note,
                       tflops={k: v * row.compute_ratio for k, v in base.tflops.items()},
                       sparse_fwd_tflops=base.sparse_fwd_tflops * row.compute_ratio,
                       sparse_bwd_tflops=base.sparse_bwd_tflops * row.compute_ratio,
                       elementwise_ns=base.elementwise_ns / row.memory_ratio,
                       grad_accum_gbps=base.grad_accum_gbps * row.memory_ratio,
                       optimizer_gbps={k: v * row.memory_ratio for k, v in base.optimizer_gbps.items()},
                       stream_gbps=base.stream_gbps * row.memory_ratio,
                       decode_gbps={k: v * row.memory_ratio for k, v in base.decode_gbps.items()},
                       sync_gbps={k: v * row.memory_ratio for k, v in base.sync_gbps.items()})
    return derive_rates(row)


def derive_rates(row) -> Rates:
    """Rates from one measured calibration row: the two timed steps (micro-batch 1 and 2 of the same shape), the
    profile's split of the first, the kernel records, and the two measured peaks.

    The profile's parts are kernel time (the profiler slows the host, which shows as idle, not the kernels); the
    timed step's remainder over them is idle between kernels. GEMM parts become TFLOP/s over
    fwd+bwd (3x the model's forward FLOPs of that part); the attention's sparse kernels are taken out of its part at
    the kernels' own rates first, the split GEMM's halves out of the head's and the compressors' (SPLIT_BYTES at
    the fused Adam's bandwidth, as often as the row's code split them); the indexer (frozen: no backward) over its
    forward. The micro-batch pair gives a fixed cost per micro-batch (less gradient accumulation and, where the
    row's code split every micro-batch, the splits; per block); what is left is elementwise work per token and
    block. The gradient accumulation and the optimizer step are memory-bound: their profiled times become the
    bandwidths at which they move GRAD_ACCUM_BYTES and ADAM_BYTES a parameter; the fused Adam's from a second
    profile when the row has one, which is also the rate of every other vectorised memory-bound pass
    (stream_gbps). The host's time an eager op is the trainer's side of an in-process FP8 sync over the ops it runs
    (sync_host_ops). Memory: peak(mb) = static + stacked expert copies + act_scale x inventory(mb) + workspace,
    two equations, two unknowns."""
    from dsv4.flops import forward_flops_per_token

    mb1, mb2 = sorted(int(k) for k in row.step_s)[:2]
    shape = model_shape(row.model, tuple(row.overrides), row.seq_len)
    cfg = shape.cfg
    # the code the row's steps and profile ran
    wl = Workload(seq_len=row.seq_len, global_batch=row.global_batch, adam_kernel=row.adam_kernel,
                  fp32_split=row.fp32_split, expert_wgrad=row.expert_wgrad, expert_stack=row.expert_stack,
                  head_loss=row.head_loss, quant_chunk=row.quant_chunk)
    T = row.global_batch * row.seq_len
    F = forward_flops_per_token(cfg, row.seq_len)
    step1 = row.step_s[str(mb1)]
    part = {k: v / 1000 for k, v in row.profile_ms.items()}                  # kernel time by part, seconds
    n_blocks = cfg.n_layers
    M1, M2 = row.global_batch // mb1, row.global_batch // mb2
    per_mb = (step1 - row.step_s[str(mb2)]) / (M1 - M2)
    lay1 = Layout(micro_batch=mb1)
    items = stage_params(shape, lay1, 0, wl)
    trained = _trained_by_dtype(items, lay1, wl)
    optimizer_gbps = {row.adam_kernel: _adam_bytes(trained) / part["optimizer"] / 1e9}
    if row.fused_adam_ms:
        other = model_shape(row.model, tuple(row.fused_adam_overrides), row.seq_len)
        n = _trained_by_dtype(stage_params(other, lay1, 0, wl), lay1, wl)
        optimizer_gbps["fused"] = _adam_bytes(n) / (row.fused_adam_ms / 1000) / 1e9
    stream = optimizer_gbps.get("fused", optimizer_gbps[row.adam_kernel]) * 1e9
    # the split GEMM's halves inside the profiled head and compressor parts, and a micro-batch's share of them
    per_split = SPLIT_BYTES + (SPLIT_BACKWARD_BYTES if row.fp32_split == "micro_batch" else 0)
    splits = M1 if row.fp32_split == "micro_batch" else 1
    head_split = splits * cfg.vocab_size * cfg.dim * per_split / stream
    comp_split = splits * sum(b.split_elems for b in shape.layers) * per_split / stream
    split_mb = (head_split + comp_split) / M1 if row.fp32_split == "micro_batch" else 0.0
    # the experts' wgrad epilogue inside the expert GEMMs' part, where the row's code accumulated in it
    experts = _trained_by_dtype([(k, x) for k, x in items if k[0] == "exp"], lay1, wl)["bf16"]
    fused = fused_expert_wgrad(shape, lay1, wl)
    epilogue_mb = experts * EPILOGUE_BYTES / stream if fused else 0.0
    # the grouped GEMM's stacking copy inside the expert GEMMs' part: at every micro-batch (a per-micro-batch cost,
    # as the epilogue) or once a step, as the row's code made it
    stacking = expert_stacking(shape, lay1, wl)
    stack_s = stage_stacked_bytes(shape, lay1, 0, wl) * STACK_PASSES / stream if stacking else 0.0
    stack_mb, stack_step = (stack_s, 0.0) if stacking == "micro_batch" else (0.0, stack_s)
    # the loss's memory-bound passes inside the head's part (LOSS_BYTES, derived): the row's tokens over the vocabulary
    loss = T * cfg.vocab_size * LOSS_BYTES[head_loss_of(shape, lay1, wl)] / stream
    sparse = 0.0
    for b in shape.layers:
        per = T * cfg.n_heads * kernel_slots(cfg, b.ratio, row.seq_len) * cfg.head_dim
        sparse += 4 * per / (row.sparse_fwd_tflops * 1e12) + 10 * per / (row.sparse_bwd_tflops * 1e12)
    tflops = {
        "head": 3 * F["lm head"] * T / (part["LM head and loss"] - head_split - loss) / 1e12,
        "attention": 3 * F["attention projections"] * T / max(part["attention"] - sparse, 1e-9) / 1e12,
        "experts": 3 * (F["routed experts"] + F["shared expert"] + F.get("router", 0)) * T
        / (part["expert GEMMs"] - (epilogue_mb + stack_mb) * M1 - stack_step) / 1e12,
        "compressors": 3 * F["compressors"] * T / (part["compressors"] - comp_split) / 1e12,
        "indexer": F["indexer"] * T / part["indexer"] / 1e12,
    }
    grad_accum = row.grad_accum_ms / 1000 / M1
    grad_accum_gbps = (trained["bf16"] - (experts if fused else 0.0)) * GRAD_ACCUM_BYTES / grad_accum / 1e9
    layer_mb = (per_mb - grad_accum - split_mb - epilogue_mb - stack_mb) / n_blocks
    # the parts' time at the GEMM rates: the memory-bound passes inside them, which the model times apart, out
    apart = head_split + comp_split + loss + stack_step
    gemm = sum(part[k] for k in ("LM head and loss", "attention", "expert GEMMs", "compressors", "indexer",
                                 "optimizer")) - apart - (epilogue_mb + stack_mb) * M1
    elementwise = step1 - gemm - apart - M1 * (per_mb - split_mb)
    ew_ns = elementwise / (T * n_blocks) / (cfg.dim * cfg.hc_mult / 16384) * 1e9
    # the host's time an eager op: the trainer's side of the row's in-process FP8 sync, over the ops it runs in the
    # row's chunks (launch-bound: at 2^19 elements the host's time is 10x the bytes' or more)
    host_op_s = 0.0
    if row.sync_host_s:
        host_op_s = row.sync_host_s / sync_host_ops(shape, RLWorkload(1, 1, sync_format="fp8"), row.quant_chunk)
    # memory: inventory at the two micro-batches
    inv = []
    for mb in (mb1, mb2):
        m = stage_memory(shape, Layout(micro_batch=mb), wl, None, 0)
        exact = sum(m.detail["backward_gib"].get(k, 0.0) for k in (STACKED, QAT_COPIES))
        static = m.parts["weights"] + m.parts["gradients"] + m.parts["optimizer"] + exact
        inv.append((static, m.detail["phases_gib"]["forward-backward"] - exact))
    (s1, a1), (s2, a2) = inv
    p1, p2 = row.peak_gib[str(mb1)], row.peak_gib[str(mb2)]
    act_scale = (p2 - p1) / (a2 - a1)
    workspace = p1 - s1 - act_scale * a1
    # decode: effective bandwidth at the measured batches, from the bytes the step reads
    decode = {b: _decode_bytes(cfg, int(b), row.decode_prompt) / (ms / 1000) / 1e9 for b, ms in row.decode_ms.items()}
    rates = Rates(row.gpu, "measured", row.note, tflops, row.sparse_fwd_tflops, row.sparse_bwd_tflops, ew_ns,
                  layer_mb, grad_accum_gbps, optimizer_gbps, act_scale, workspace, decode,
                  dict(row.sync_gbps), {}, row.outside_allocator_gib, stream / 1e9, host_op_s, row.quant_chunk)
    # the fit's own check, at the calibration shape: the model must give back what it was fitted to
    hw = Hardware("calibration", row.gpu, 1000.0, 0.0, 1, 1.0, 1.0, rates=rates)
    check = {}
    for mb in (mb1, mb2):
        p = predict(shape, Layout(micro_batch=mb), wl, hw)
        check[str(mb)] = {"step_s": p.step_s, "measured_step_s": row.step_s[str(mb)], "peak_gib": p.peak_gib,
                          "measured_peak_gib": row.peak_gib[str(mb)]}
    return replace(rates, calibration=check)


# ================================================================================================ from the config

# what every prediction assumes beyond the hw layer's figures (printed by `v4 plan`; docs/plan.md has the sources)
MODEL_ASSUMPTIONS = (
    "rates and the fixed cost per layer and micro-batch come from the 4-layer smoke at TP1 on one H200 and are taken "
    "to hold at every split (benchmarks/records/plan_calibration.jsonl)",
    "EP all-to-all: tokens routed evenly over the EP group, NCCL at the bandwidths above (no DeepEP)",
    "multi-node figures are not measured here: the network bandwidth is the hw file's assumption",
)


def hardware_from_config(cfg, gpus_per_node: int | None = None) -> Hardware:
    v = cfg.values
    gpu = v.get("HW_GPU_NAME", "")
    rates = rates_for(gpu) if gpu else None
    assumptions = []
    if rates and rates.source == "scaled":
        assumptions.append(f"{gpu} step rates: {rates.note}")
    assumptions.append(f"NVLink {v.get('HW_NVLINK_GBPS', 0):g} GB/s a GPU ({cfg.origin('HW_NVLINK_GBPS').where})")
    assumptions.append(f"network {v.get('HW_IB_GBPS', 0):g} GB/s a GPU ({cfg.origin('HW_IB_GBPS').where})")
    assumptions += MODEL_ASSUMPTIONS
    return Hardware(cfg.selection.hw, gpu, float(v.get("HW_GPU_MEMORY_GB", 0) or 0), float(v.get("HW_PEAK_TFLOPS", 0)),
                    gpus_per_node or int(v["V4_NUM_GPUS_PER_NODE"]), float(v.get("HW_NVLINK_GBPS", 0)),
                    float(v.get("HW_IB_GBPS", 0)), rates, reserve_gib=reserve_of(rates),
                    assumptions=tuple(assumptions))


def reserve_of(rates: Rates | None) -> float:
    """GiB of a GPU that the training process holds outside torch's allocator (CUDA context, kernel modules, NCCL,
    the libraries' own allocations): the calibration's measurement where it has one (a bench process's OOM report:
    in use less reserved), else the 2 GiB assumption."""
    return rates.reserve_gib if rates and rates.reserve_gib else Hardware.reserve_gib


def workload_from_config(cfg) -> Workload:
    from dsv4.config import parse_overrides
    v = cfg.values
    impl = v["PRESET_ATTN_IMPL"]
    if impl == "auto":
        impl = "tilelang" if v["HW_DEVICE"] == "cuda" else "torch"
    overrides = parse_overrides(*v["PRESET_MODEL_OVERRIDES"])
    rl = None
    if v["PRESET_MODE"] == "rl":
        samples = v["PRESET_RL_PROMPTS_PER_STEP"] * v["PRESET_RL_GROUP_SIZE"]
        response = v["PRESET_RL_MAX_NEW_TOKENS"] or max(1, v["PRESET_SEQ_LEN"] // 2)
        sync = v["PRESET_RL_SYNC"]
        engine = v["V4_ROLLOUT_ENGINE"]
        if sync == "auto":
            sync = "inproc" if engine == "embedded" else "broadcast"
        separate = [n for n in v["V4_ROLLOUT_NODES"] if n not in cfg.nodes[:1]] if v["V4_ROLLOUT_NODES"] else []
        rl = RLWorkload(samples, response, max(1, v["PRESET_RL_MINIBATCHES"]), engine, not separate,
                        len(separate) * v["V4_NUM_GPUS_PER_NODE"], v["V4_ROLLOUT_TP"], v["V4_ROLLOUT_EP"],
                        v["V4_ROLLOUT_MEM_FRACTION"], sync, v["PRESET_RL_SYNC_FORMAT"])
    # the model config's runtime switches the model distinguishes: moe_impl=grouped_triton (the Triton wgrad) and
    # head_loss (ModelConfig; from the preset's model and PRESET_MODEL_OVERRIDES)
    model = _model_config(v["PRESET_MODEL"], tuple(v["PRESET_MODEL_OVERRIDES"]))
    moe_impl = getattr(model, "moe_impl", overrides.get("moe_impl", "grouped"))
    head_loss = getattr(model, "head_loss", overrides.get("head_loss", Workload.head_loss))
    return Workload(seq_len=v["PRESET_SEQ_LEN"], global_batch=v["PRESET_GLOBAL_BATCH_SIZE"],
                    recompute=v["HW_RECOMPUTE_GRANULARITY"] if v["HW_RECOMPUTE_GRANULARITY"] in ("none", "full")
                    else "none",
                    mtp=bool(v["PRESET_MTP_LOSS_COEFF"]), indexer_loss=float(overrides.get("indexer_loss_coeff", 0)) > 0,
                    attn_impl=impl, rl=rl, expert_wgrad="triton" if moe_impl == "grouped_triton" else "main_grad",
                    head_loss=head_loss if head_loss in HEAD_LOSSES else Workload.head_loss)


@functools.lru_cache(maxsize=32)
def _model_config(preset: str, overrides: tuple[str, ...]):
    """The run's dsv4.config.ModelConfig (None where the preset or its overrides do not build one: the config's
    checks say why)."""
    from dsv4.config import ModelConfig
    try:
        return ModelConfig.preset(preset).with_overrides(*overrides)
    except (KeyError, ValueError, TypeError):
        return None


def layout_from_config(cfg, stages: list[int] | None) -> Layout:
    v, d = cfg.values, cfg.derived
    tp, pp, cp = v["PRESET_TP"], v["PRESET_PP"], v["PRESET_CP"]
    world = d["WORLD_SIZE"].value if "WORLD_SIZE" in d else tp * pp * cp
    dp = max(1, world // (tp * pp * cp))
    return Layout(tp, pp, cp, v["PRESET_EP"], v["PRESET_ETP"], dp, tuple(stages or ()), v["PRESET_MICRO_BATCH_SIZE"])


def predict_config(cfg, stages: list[int] | None = None) -> Prediction:
    """The prediction for a resolved configuration's own layout (config validate, the dry-run plan, the B0 gates)."""
    v = cfg.values
    shape = model_shape(v["PRESET_MODEL"], tuple(v["PRESET_MODEL_OVERRIDES"]), v["PRESET_SEQ_LEN"])
    if stages is None and "PP_STAGE_LAYERS" in cfg.derived:
        stages = cfg.derived["PP_STAGE_LAYERS"].value
    per_node = v["PRESET_GPUS_PER_NODE"] or v["V4_NUM_GPUS_PER_NODE"]
    return predict(shape, layout_from_config(cfg, stages), workload_from_config(cfg), hardware_from_config(cfg, per_node))


# ================================================================================================ one process
# what `v4 bench step` does not run: it is one process, every collective and the pipeline absent
COMMUNICATION = ("TP collectives", "EP all-to-all", "CP gathers", "PP p2p", "PP bubble", "DP gradient sync",
                 "TP replicated-grad all-reduce")


@dataclass(frozen=True)
class BenchShape:
    """What `v4 bench step` builds and trains in its one process (world size 1, megatron's schedule without a
    pipeline), as the planner's inputs, so that the bench asks the same model as `v4 plan` before it spends minutes
    building and compiling on the GPU. The model is given as built: with --rank-of, the rank's slice (its layers,
    the MTP block where the slice holds it, E/EP local experts) as overrides of the preset. Then:
    * TP as dsv4.megatron.rankshape's stand-in builds it: heads, shared expert and vocabulary over TP, the
      sequence-parallel shards between sublayers; megatron's own groups stay of size one, so EP is 1 (every local
      expert in this process, the grouped GEMM's stacked copies) and DP is 1 (Adam's state whole);
    * one micro-batch's activations at a time (no pipeline holds more);
    * the MTP block trains only where the slice holds it (the bench's MTP loss); the indexer never does."""
    model: str
    overrides: tuple[str, ...] = ()
    tp: int = 1
    etp: int = 1
    seq_len: int = 4096
    global_batch: int = 8
    micro_batch: int = 1
    recompute: str = "none"
    mtp: bool = False
    attn_impl: str = "tilelang"
    adam_kernel: str = "fused"
    grad_check_bytes: int = GRAD_CHECK_BYTES
    fp32_split: str = "step"
    expert_wgrad: str = "main_grad"
    weight_qdq: str = "step"
    expert_stack: str = "step"
    head_loss: str = "fused"
    quant_chunk: str = "gpu"

    def layout(self) -> Layout:
        return Layout(tp=self.tp, etp=self.etp, micro_batch=self.micro_batch)

    def workload(self) -> Workload:
        return Workload(seq_len=self.seq_len, global_batch=self.global_batch, recompute=self.recompute, mtp=self.mtp,
                        attn_impl=self.attn_impl, adam_kernel=self.adam_kernel, grad_check_bytes=self.grad_check_bytes,
                        fp32_split=self.fp32_split, expert_wgrad=self.expert_wgrad, weight_qdq=self.weight_qdq,
                        expert_stack=self.expert_stack, head_loss=self.head_loss, quant_chunk=self.quant_chunk)

    def to_json(self) -> dict:
        """The fields of a validation case (plan_validation.jsonl) with "bench": true."""
        return {"model": self.model, "overrides": list(self.overrides), "seq_len": self.seq_len,
                "global_batch": self.global_batch,
                "layout": {"tp": self.tp, "etp": self.etp, "micro_batch": self.micro_batch},
                "workload": {"recompute": self.recompute, "mtp": self.mtp, "attn_impl": self.attn_impl,
                             "adam_kernel": self.adam_kernel, "grad_check_bytes": self.grad_check_bytes,
                             "fp32_split": self.fp32_split, "expert_wgrad": self.expert_wgrad,
                             "weight_qdq": self.weight_qdq, "expert_stack": self.expert_stack,
                             "head_loss": self.head_loss, "quant_chunk": self.quant_chunk},
                "bench": True}

    @classmethod
    def from_case(cls, case) -> "BenchShape":
        lay, wl = case.layout, {**unnamed_as_before(case), **case.workload}
        return cls(case.model, tuple(case.overrides), lay.get("tp", 1), lay.get("etp", 1), case.seq_len,
                   case.global_batch, lay.get("micro_batch", 1), wl.get("recompute", "none"), wl.get("mtp", False),
                   wl.get("attn_impl", "tilelang"), wl.get("adam_kernel", "fused"),
                   wl.get("grad_check_bytes", GRAD_CHECK_BYTES), wl.get("fp32_split", "step"),
                   wl.get("expert_wgrad", "main_grad"), wl.get("weight_qdq", "step"), wl.get("expert_stack", "step"),
                   wl.get("head_loss", "fused"), wl.get("quant_chunk", "gpu"))


def predict_bench(b: BenchShape, hw: Hardware) -> Prediction:
    """The prediction for the one process of `v4 bench step`: memory as `predict` has it at that shape; time without
    the communication the process does not run (what the bench's timed step is to be compared with)."""
    p = predict(model_shape(b.model, b.overrides, b.seq_len), b.layout(), b.workload(), hw)
    compute = {k: v for k, v in p.time.items() if k not in COMMUNICATION}
    step = sum(compute.values()) if compute else None
    return replace(p, time=compute, step_s=step, mfu=None,
                   tokens_per_s_gpu=b.global_batch * b.seq_len / step if step else None,
                   notes=p.notes + ["one process: no collectives, no pipeline (the bench's step)"])


def device_hardware(gpu_name: str, total_gib: float, tp: int = 1) -> Hardware:
    """The one GPU a bench runs on: the hw layer whose HW_GPU_NAME names it (its rates and the calibration's reserve
    outside the allocator) at the memory the device itself reports; where no hw layer names it, memory only, at
    the inventory's own scale and the assumed reserve (uncalibrated: the rates' note says so)."""
    from launcher.config import Selection, load
    from launcher.config.resolve import hw_for_gpu
    name = hw_for_gpu(gpu_name)
    if name is None:
        return Hardware("", gpu_name, total_gib, 0.0, max(1, tp), 0.0, 0.0,
                        assumptions=(f"no hw layer names {gpu_name!r}: memory without the calibrated activation "
                                     "scale and workspace",))
    hw = hardware_from_config(load(Selection(hw=name, environ={})), gpus_per_node=max(1, tp))
    return replace(hw, memory_gib=total_gib)


def memory_lines(p: Prediction, hw: Hardware) -> list[str]:
    """A prediction's memory for people: the peak moment's parts (the state, the activations together with their
    largest, the transient, the workspace), against what the device leaves usable; then the two phases (the
    forward-backward and the gradient check after it) and which of them is the peak."""
    parts = p.memory.parts
    acts = {k.split(": ", 1)[1]: v for k, v in parts.items() if k.startswith("activations: ") and k != STACKED}
    named = [("weights", parts.get("weights", 0.0)), ("gradients", parts.get("gradients", 0.0)),
             ("Adam state", parts.get("optimizer", 0.0))]
    if acts:
        top = ", ".join(f"{k} {v:.1f}" for k, v in sorted(acts.items(), key=lambda kv: -kv[1])[:3])
        named.append((f"activations ({top}, ...)", sum(acts.values())))
    named += [(k.removeprefix("activations: ") if k == STACKED else f"transient ({k.removeprefix('transient: ')})", v)
              for k, v in parts.items() if k == STACKED or k.startswith("transient: ")]
    named.append(("workspace", parts.get("workspace", 0.0)))
    lines = [f"predicted peak {p.peak_gib:.1f} GiB of {p.usable_gib:.1f} usable ({hw.memory_gib:.1f} GiB less "
             f"{hw.reserve_gib:.2f} outside torch's allocator, {hw.fragmentation:.0%} fragmentation): "
             + ", ".join(f"{k} {v:.1f}" for k, v in named if v >= 0.05)]
    phases = p.memory.detail.get("phases_gib")
    if phases and p.workload.grad_check_bytes:
        state = sum(parts.get(k, 0.0) for k in ("weights", "gradients", "optimizer"))
        buf, n = max(p.memory.detail["grad_buffers_gib"].items(), key=lambda kv: kv[1], default=("", 0.0))
        peak = max(phases, key=phases.get)
        lines.append(f"  over {state:.1f} GiB of state: the forward-backward {phases['forward-backward']:.1f}, "
                     f"the gradient check after it {phases['gradient check']:.1f} ({p.workload.grad_check_bytes} "
                     f"bytes an element of the {n:.1f} GiB fp32 gradient buffer of the {buf}): the {peak} is the peak")
    return lines


# ================================================================================================ enumeration
@dataclass
class Rejected:
    layout: Layout | None              # None: every layout of `scope`
    reasons: list
    scope: str = ""
    peak_gib: float | None = None      # memory rejections: the predicted peak

    @property
    def category(self) -> str:
        return self.reasons[0].split(":", 1)[0]

    def name(self) -> str:
        return self.scope or self.layout.name()

    def to_json(self) -> dict:
        return {"layout": self.layout.to_json() if self.layout else None, "scope": self.scope or None,
                "category": self.category, "reasons": self.reasons,
                "peak_gib": None if self.peak_gib is None else round(self.peak_gib, 1)}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def enumerate_layouts(shape: ModelShape, wl: Workload, hw: Hardware, gpus: int,
                      micro_batches: tuple[int, ...] = (1, 2, 4, 8), schedules: tuple[str, ...] = ("1f1b",),
                      tps: tuple[int, ...] = (1, 2, 4, 8, 16),
                      cps: tuple[int, ...] = (1, 2, 4, 8, 16)) -> tuple[list[Prediction], list[Rejected]]:
    """Every TP x PP x CP x EP x ETP x micro-batch (x interleaving) layout of `gpus` GPUs: the feasible ones predicted
    and ranked by tokens/s a GPU (lowest peak memory where the GPU has no rates), the others with their reasons (a
    reason that holds for a whole TP or CP value is given once, for all its layouts)."""
    cfg = shape.cfg
    feasible, rejected = [], []
    ctx: dict = {}
    layer_flops = sum(f for _, f, _ in shape.layers[-1].flops)
    head_layers = shape.head_flops / layer_flops if layer_flops else 1.0
    probe = replace(wl, rl=None) if wl.rl else wl
    for tp in (t for t in tps if t <= gpus and gpus % t == 0):
        why = layout_problems(shape, Layout(tp=tp, dp=cfg.n_routed_experts * tp), probe, hw.gpus_per_node)
        why = [w for w in why if not w.startswith(("SP:", "batch:", "layers/PP"))]
        if why:
            rejected.append(Rejected(None, why, f"TP={tp} (every PP, CP, EP, micro-batch)"))
            continue
        for cp in (c for c in cps if gpus % (tp * c) == 0):
            why = [w for w in layout_problems(shape, Layout(tp=tp, cp=cp, dp=cfg.n_routed_experts), wl,
                                              hw.gpus_per_node) if w.startswith(("CP:", "SP:"))]
            if why:
                rejected.append(Rejected(None, why, f"TP={tp} CP={cp} (every PP, EP, micro-batch)"))
                continue
            for pp in _divisors(gpus // (tp * cp)):
                if pp > cfg.n_layers:
                    continue
                dp = gpus // (tp * cp * pp)
                for vpp in ((1, 2) if "interleaved" in schedules and pp > 1 else (1,)):
                    if vpp == 1 and "1f1b" not in schedules:
                        continue
                    stages = split_layers(cfg.n_layers, pp, cfg.n_hash_layers, head_layers, vpp)
                    for ep in _divisors(cfg.n_routed_experts):
                        for etp in sorted({1, tp}):
                            if (dp * cp * tp) % (ep * etp):
                                if etp == 1:
                                    rejected.append(Rejected(None, [
                                        f"expert grid: EP*ETP={ep}*{etp} must divide DP*CP*TP={dp}*{cp}*{tp} "
                                        "(megatron's expert grid)"], f"TP{tp} PP{pp} CP{cp} EP{ep} DP{dp} (every "
                                        "micro-batch)"))
                                continue
                            for mb in micro_batches:
                                lay = Layout(tp, pp, cp, ep, etp, dp, stages, mb, vpp)
                                why = layout_problems(shape, lay, wl, hw.gpus_per_node)
                                if why:
                                    rejected.append(Rejected(lay, why))
                                    continue
                                p = predict(shape, lay, wl, hw, ctx, time_if_oom=False)
                                if p.fits:
                                    feasible.append(p)
                                else:
                                    rejected.append(Rejected(lay, [p.overflow], peak_gib=p.peak_gib))
    if hw.rates:
        feasible.sort(key=lambda p: -(p.tokens_per_s_gpu or 0))
    else:
        feasible.sort(key=lambda p: p.peak_gib)
    return feasible, rejected


# ================================================================================================ validation
VALIDATION_FILE = ROOT / "benchmarks" / "records" / "plan_validation.jsonl"


def _validation_types():
    import msgspec

    class Case(msgspec.Struct, forbid_unknown_fields=True):
        name: str
        source: str                        # fit | measured | gap | recipe | oom
        hw: str
        model: str
        seq_len: int
        global_batch: int
        layout: dict
        command: str
        note: str
        date: str = ""
        commit: str = ""
        overrides: list[str] = []
        workload: dict = {}
        rl: dict | None = None
        measured: dict[str, float] = {}
        relative_to: dict | None = None    # {"layout": {...}, "measured": {...}}: compare ratios to that run
        expect: str = ""                   # fits | oom | rejected
        gpu_memory_gb: float = 0.0
        quantity: str = ""
        bench: bool = False                # the one process of `v4 bench step` (BenchShape), not a layout's rank
        fit: list[str] = []                # measured keys that are calibration inputs (plan_calibration.jsonl)
    return msgspec, Case


def validation_cases(path: str = str(VALIDATION_FILE)) -> list:
    msgspec, Case = _validation_types()
    out = []
    for no, line in enumerate(Path(path).read_text().splitlines(), 1):
        if line.strip():
            try:
                out.append(msgspec.json.decode(line, type=Case))
            except msgspec.ValidationError as e:
                raise ValueError(f"{path}:{no}: {e}") from None
    return out


def unnamed_as_before(case) -> dict:
    """Workload fields that a case (a plan_validation.jsonl row, a bench record's plan) which does not name them ran
    as the code before: expert_stack "micro_batch" (the stack once a step came with 80eff6b), quant_chunk
    "cpu_sized" (the quantisers' 2^24-element chunks on a GPU came with 3fd1ccf), ep_experts "loop" (EP > 1's
    local experts through the grouped GEMMs came with f338075) and head_loss "eager" (the fused head loss became
    the default after cccd6ba, whose bench records name it), all after every row and record so far; a row or
    record of later code names them, as BenchShape.to_json does (a bench's process is EP = 1: BenchShape has no
    ep_experts, from_case ignores it). A gap has not run yet: it is to be measured with today's code, the Workload's
    defaults (its command runs the code checked out)."""
    return {} if case.source == "gap" else {"expert_stack": "micro_batch", "quant_chunk": "cpu_sized",
                                            "ep_experts": "loop", "head_loss": "eager"}


def _case_hardware(case, world: int) -> Hardware:
    from launcher.config import Selection, load
    sets = (f"HW_GPU_MEMORY_GB={case.gpu_memory_gb:g}",) if case.gpu_memory_gb else ()
    cfg = load(Selection(hw=case.hw, sets=sets, environ={}))
    return hardware_from_config(cfg, gpus_per_node=min(8, max(1, world)))


def _case_layout(shape: ModelShape, d: dict) -> Layout:
    lay = Layout(**{k: v for k, v in d.items() if k in ("tp", "pp", "cp", "ep", "etp", "dp", "micro_batch", "vpp")})
    if "stages" in d:
        lay = replace(lay, stages=tuple(d["stages"]))
    elif lay.pp > 1 and "first" not in d:
        lay = replace(lay, stages=split_layers(shape.cfg.n_layers, lay.pp, shape.cfg.n_hash_layers))
    return lay


def case_prediction(case) -> tuple[Prediction | None, list[str]]:
    """The model's prediction for one validation case, and the reasons its layout cannot run (if any)."""
    if case.bench:
        b = BenchShape.from_case(case)
        return predict_bench(b, _case_hardware(case, b.tp)), []
    shape = model_shape(case.model, tuple(case.overrides), case.seq_len)
    if "first" in case.layout:
        from launcher.config.checks import pipeline_split
        try:
            stages = pipeline_split(shape.cfg.n_layers, case.layout["pp"], case.layout["first"], case.layout["last"], "")
        except ValueError as e:
            return None, [f"layers/PP split: {e}"]
        lay = replace(_case_layout(shape, {k: v for k, v in case.layout.items() if k not in ("first", "last")}),
                      stages=tuple(stages))
    else:
        lay = _case_layout(shape, case.layout)
    rl = RLWorkload(**case.rl) if case.rl else None
    wl = Workload(seq_len=case.seq_len, global_batch=case.global_batch, rl=rl,
                  **{**unnamed_as_before(case), **case.workload})
    hw = _case_hardware(case, lay.world)
    problems = layout_problems(shape, lay, wl, hw.gpus_per_node)
    return predict(shape, lay, wl, hw), problems


# an RL step's parts as its metrics rows time them (time_rollout_s, time_train_s, time_sync_s) and the prediction's
# parts they hold: the rollout's decode and prefill, the weight sync with its eager ops, the rest training
RL_PARTS = {"rollout_s": ("rollout",), "sync_s": ("weight sync",)}


def _quantity(p: Prediction, key: str) -> float | None:
    if key in RL_PARTS:
        return sum(v for k, v in p.time.items() if k.startswith(RL_PARTS[key])) if p.time else None
    if key == "train_s":
        return p.step_s - sum(v for k, v in p.time.items() if k.startswith(("rollout", "weight sync"))) \
            if p.step_s else None
    return {"peak_gib": p.peak_gib, "step_s": p.step_s, "weights_gib": p.memory.parts.get("weights")}.get(key)


TRAIN_STEP_RECORDS = ROOT / "benchmarks" / "records" / "train_step.jsonl"


def record_cases(path: str = str(TRAIN_STEP_RECORDS)) -> list:
    """Validation cases from `v4 bench step --record` rows that carry the planner's inputs ("plan": the BenchShape,
    the device's memory, the prediction made then): each measured peak and step against today's model."""
    msgspec, Case = _validation_types()
    out = []
    p = Path(path)
    for no, line in enumerate(p.read_text().splitlines() if p.exists() else [], 1):
        rec = json.loads(line) if line.strip() else {}
        plan = rec.get("plan")
        # a GPU no hw layer names was predicted uncalibrated: nothing to hold the model to
        if not plan or not plan.get("hw") or not rec.get("metrics") or \
                rec.get("benchmark", "").endswith("_nonfinite_hooks"):
            continue
        then = plan.get("predicted", {})
        case = {k: v for k, v in plan.items() if k not in ("predicted", "gpu_memory_gib")}
        try:
            out.append(msgspec.convert({
                **case, "name": f"{rec['benchmark']} (bench record)", "source": "measured",
                "gpu_memory_gb": plan.get("gpu_memory_gib", 0.0), "date": rec.get("date") or "",
                "commit": rec.get("commit") or "", "command": rec.get("command", ""),
                "measured": {"peak_gib": rec["metrics"]["peak_mem_gb"], "step_s": rec["metrics"]["step_s"]},
                "note": f"{p.name}; predicted when it ran: {then.get('peak_gib', '?')} GiB, "
                        f"{then.get('step_s', '?')} s"}, Case))
        except (msgspec.ValidationError, KeyError) as e:
            raise ValueError(f"{path}:{no}: the record's plan is not a validation case: {e}") from None
    return out


def validation_table(path: str = str(VALIDATION_FILE), records: str | None = None) -> list[dict]:
    """One row per case and quantity: measured, predicted, relative error, and the verdict against
    MODEL_TOLERANCE (memory +-10 %, step time +-15 %); ratio cases compare predicted and measured ratios to a
    reference run of the same code, which cancels what changed in the code since. `records`: a train_step.jsonl
    whose bench rows carry their plan (record_cases) adds those."""
    rows = []
    for case in validation_cases(path) + (record_cases(records) if records else []):
        p, problems = case_prediction(case)
        src = " ".join(x for x in (case.date, case.commit) if x) or case.source
        base = {"name": case.name, "source": src, "kind": case.source, "command": case.command, "note": case.note}
        if case.source in ("recipe", "oom"):
            if case.expect == "rejected" or p is None:
                ok = p is None or bool(problems)
                verdict = ("rejected: " + "; ".join(problems)) if ok else "NOT rejected"
                rows.append({**base, "quantity": "layout", "measured": None, "predicted": None, "error": None,
                             "verdict": verdict, "ok": ok})
                continue
            if case.quantity == "weights":
                m, q = case.measured["weights_gib"], p.memory.parts["weights"]
                err = q / m - 1
                rows.append({**base, "quantity": "weights GiB", "measured": m, "predicted": q, "error": err,
                             "verdict": ("within" if abs(err) <= MODEL_TOLERANCE["memory"] else "OUTSIDE")
                             + f" +-{MODEL_TOLERANCE['memory']:.0%}", "ok": abs(err) <= MODEL_TOLERANCE["memory"]})
            feasible = p.fits and not problems
            # an OOM's report bounds the peak from below: what PyTorch had allocated plus the request that failed
            floor = case.measured.get("oom_gib")
            err = p.peak_gib / floor - 1 if floor else None
            if case.expect == "fits":
                verdict = (f"feasible: {p.peak_gib:.1f} of {p.usable_gib:.1f} GiB" if feasible else
                           "NOT feasible: " + "; ".join(problems + [p.overflow]))
                ok = feasible
            else:
                verdict = ("flagged: " + (p.overflow or "; ".join(problems))) if not feasible else "NOT flagged"
                ok = not feasible
                if floor and err < -MODEL_TOLERANCE["memory"]:
                    verdict, ok = f"{verdict}; but under the OOM's allocated {floor:.1f} GiB by more than " \
                        f"{MODEL_TOLERANCE['memory']:.0%}", False
            rows.append({**base, "quantity": "peak GiB" + (" (OOM: at least)" if floor else ""), "measured": floor,
                         "predicted": p.peak_gib, "error": err, "verdict": verdict, "ok": ok})
            continue
        ref = None
        if case.relative_to:
            import msgspec
            ref = case_prediction(msgspec.structs.replace(case, layout=case.relative_to["layout"],
                                                          relative_to=None))[0]
        for key, label, tol in (("peak_gib", "peak GiB", MODEL_TOLERANCE["memory"]),
                                ("step_s", "s/step", MODEL_TOLERANCE["step_time"]),
                                ("rollout_s", "s/step: rollout", MODEL_TOLERANCE["step_time"]),
                                ("train_s", "s/step: train", MODEL_TOLERANCE["step_time"]),
                                ("sync_s", "s/step: weight sync", MODEL_TOLERANCE["step_time"])):
            pred = _quantity(p, key)
            meas = case.measured.get(key)
            if case.source == "gap" and key not in ("peak_gib", "step_s") and not case.rl:
                continue
            if case.source == "gap":
                rows.append({**base, "quantity": label, "measured": None, "predicted": pred, "error": None,
                             "verdict": "GAP: to measure on the H200", "ok": None})
                continue
            if meas is None or pred is None:
                continue
            if ref is not None:
                m_ref, p_ref = case.relative_to["measured"][key], _quantity(ref, key)
                err = (pred / p_ref) / (meas / m_ref) - 1
                label = f"{label} ratio"
                meas, pred = meas / m_ref, pred / p_ref
            else:
                err = pred / meas - 1
            if case.source == "fit":
                verdict, ok = "fit (calibration input)", abs(err) < 1e-6
            elif key in case.fit:
                # a part whose measurement a rate was derived from: it comes back by construction, to the model's
                # own approximations (op counts)
                verdict, ok = "fit (calibration input)", abs(err) <= tol
            else:
                ok = abs(err) <= tol
                verdict = ("within" if ok else "OUTSIDE") + f" +-{tol:.0%}"
            rows.append({**base, "quantity": label, "measured": meas, "predicted": pred, "error": err,
                         "verdict": verdict, "ok": ok})
    return rows
