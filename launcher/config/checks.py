"""Derived values and cross-checks, in one place.

Each failed check names the values that disagree and the file:line each came from; all failures
are reported together so one edit-validate cycle fixes them all.
"""
from __future__ import annotations

import hashlib
import ipaddress
import math
import re
from pathlib import Path
import shlex
from dataclasses import dataclass

from launcher.config.resolve import Config, Derived
from launcher.config.schema import ALWAYS_PORT_KEYS, PORT_KEYS, ROLLOUT_PORT_KEY, SCHEMA
from launcher.errors import ConfigError


class InvalidConfig(ConfigError):
    """Failed cross-checks, one message each (`v4 config validate --json` lists them)."""

    def __init__(self, errors: list[str], fix: str | None = None):
        super().__init__("invalid configuration:\n  " + "\n  ".join(errors), fix=fix)
        self.errors = list(errors)


# Counts that are meaningless below 1 (a zero or negative value would divide by zero, train nothing or
# split nothing), and counts and rates where 0 has a meaning ("all", "even split", "off") but < 0 has none.
POSITIVE_KEYS = ("PRESET_TP", "PRESET_PP", "PRESET_CP", "PRESET_EP", "PRESET_ETP", "V4_NUM_NODES",
                 "V4_NUM_GPUS_PER_NODE", "PRESET_GLOBAL_BATCH_SIZE", "PRESET_MICRO_BATCH_SIZE",
                 "PRESET_NUM_STEPS", "PRESET_SEQ_LEN", "HW_SMOKE_SEQ_LEN", "HW_MAX_TOKENS_PER_GPU",
                 "V4_SSH_RETRIES", "V4_ROLLOUT_TP", "V4_ROLLOUT_EP", "V4_ROLLOUT_DP")
NON_NEGATIVE_KEYS = ("PRESET_NUM_NODES", "PRESET_GPUS_PER_NODE", "HW_CP_SMOKE_GPUS_PER_NODE",
                     "PRESET_SAVE_INTERVAL", "PRESET_SAVE_RETAIN_INTERVAL", "PRESET_PP_FIRST_LAYERS",
                     "PRESET_PP_LAST_LAYERS", "PRESET_LR_WARMUP_ITERS",
                     "PRESET_LR", "PRESET_MIN_LR", "PRESET_WEIGHT_DECAY",
                     "PRESET_MTP_LOSS_COEFF", "HW_GPU_MEMORY_GB", "PRESET_HANG_TIMEOUT", "HW_GEMM_TFLOPS",
                     "HW_HBM_GBPS", "HW_GPU_PROBE_MIN_FRACTION", "V4_NCCL_MIN_PAIR_BUSBW_GBPS",
                     "V4_MIN_NODES", "PRESET_MAX_RESTARTS")
# Timeouts: 0 or less would fail every connection or step at once.
POSITIVE_SECONDS_KEYS = ("V4_SSH_CONNECT_TIMEOUT", "V4_SSH_COMMAND_TIMEOUT", "V4_RAY_READY_TIMEOUT",
                         "PRESET_JOB_TIMEOUT", "V4_ROLLOUT_HEALTH_TIMEOUT", "V4_WANDB_TIMEOUT",
                         "V4_NODE_DEAD_TIMEOUT")

# SGLang's _SAMPLING_EPS (dsv4.rl.api.SAMPLING_EPS; the launcher does not import dsv4): a rollout temperature below
# it is greedy decoding
RL_SAMPLING_EPS = 1e-6

# SGLang server flags the launcher renders itself (launcher/rollout.py), with the key that sets each: given again in
# V4_ROLLOUT_EXTRA_ARGS they would override it behind the launcher's back (argparse keeps the last), e.g. a second
# --port the health wait would never look at.
ROLLOUT_OWNED_FLAGS = {
    "--model-path": "the checkpoint (CKPT_BF16_DIR)", "--model": "the checkpoint (CKPT_BF16_DIR)",
    "--host": "the rollout node's address (V4_ROLLOUT_NODES)", "--port": "V4_ROLLOUT_PORT",
    "--tp-size": "V4_ROLLOUT_TP", "--tensor-parallel-size": "V4_ROLLOUT_TP",
    "--ep-size": "V4_ROLLOUT_EP", "--expert-parallel-size": "V4_ROLLOUT_EP", "--ep": "V4_ROLLOUT_EP",
    "--dp-size": "V4_ROLLOUT_DP", "--data-parallel-size": "V4_ROLLOUT_DP",
    "--mem-fraction-static": "V4_ROLLOUT_MEM_FRACTION", "--dsv4-attn-backend": "V4_ROLLOUT_DSV4_ATTN_BACKEND",
}

# Names that end up inside rendered shell scripts and docker/ray command lines: only characters that
# need no quoting there. (key, pattern, what it must look like)
NAME_RULES = (
    ("V4_CLUSTER_NAME", re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*"),
     "letters, digits, '.', '_' and '-', starting with a letter or digit"),
    ("V4_CONTAINER", re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*"),
     "a docker container name: letters, digits, '_', '.' and '-', starting with a letter or digit"),
    ("V4_IMAGE", re.compile(r"[A-Za-z0-9][A-Za-z0-9._/:@-]*"),
     "a docker image reference such as registry/name:tag or name@sha256:..."),
    ("V4_SSH_USER", re.compile(r"[A-Za-z_][A-Za-z0-9._-]*"),
     "a login name: letters, digits, '.', '_' and '-'"),
    ("V4_SOCKET_IFNAME", re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@-]*"),
     "'auto' or a network interface name such as eth0 or bond0"),
    ("PRESET_RUN_ID_PREFIX", re.compile(r"[A-Za-z0-9][A-Za-z0-9_.]*(-[A-Za-z0-9_.]+)*"),
     "letters, digits, '_' and '.', in parts joined by single '-', starting with a letter or digit: it begins every "
     "run id (PREFIX-YYYYmmdd-HHMMSS-xxxx), which names the run's directory and its Ray jobs"),
)
HOSTNAME_RE = re.compile(r"(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
                         r"(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?")


@dataclass(frozen=True)
class ModelFacts:
    n_layers: int
    n_experts: int
    n_heads: int
    o_groups: int
    dense_params: int           # every parameter outside the routed experts
    expert_params: int
    bytes_per_param: int        # weight + gradient + optimizer state, as the trainer keeps them
    ckpt_bytes: int             # one training checkpoint: every weight, optimizer state of the trained ones


# Bytes a parameter costs. Weight: 2 (bf16) or 4 (fp32); gradient: fp32; optimizer: the fp32 master copy
# (bf16 models only) and the two fp32 Adam moments. A training checkpoint holds every weight and the
# optimizer state of each parameter that receives a gradient (gradients are not saved); in memory a
# trained parameter costs all three (bf16: 2 + 4 + 12 = 18).
WEIGHT_BYTES = {"bf16": 2, "fp32": 4}
GRAD_BYTES = 4
OPTIMIZER_BYTES = {"bf16": 12, "fp32": 8}


def model_facts(cfg: Config) -> ModelFacts:
    # dsv4.config is plain dataclasses (no torch), so this stays a sub-second import.
    from dsv4.config import ModelConfig

    try:
        m = ModelConfig.preset(cfg["PRESET_MODEL"]).with_overrides(*cfg["PRESET_MODEL_OVERRIDES"])
        shapes = m.param_shapes()
    except (KeyError, ValueError, TypeError, ArithmeticError) as e:
        # ArithmeticError: a zero override (o_groups=0) divides by zero inside the model's own checks.
        # The location first is the overrides' when there are any: that is the line to edit.
        overrides, model_at = cfg["PRESET_MODEL_OVERRIDES"], cfg.origin("PRESET_MODEL").where
        if overrides:
            what = (f"{cfg.origin('PRESET_MODEL_OVERRIDES').where}: PRESET_MODEL_OVERRIDES={' '.join(overrides)!r} "
                    f"on model {cfg['PRESET_MODEL']!r} ({model_at})")
        else:
            what = f"{model_at}: model {cfg['PRESET_MODEL']!r}"
        if isinstance(e, ArithmeticError):
            reason = f"{type(e).__name__}: {e}"
        else:       # str() of a KeyError would add quotes
            reason = str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)
        raise ConfigError(f"{what}: {reason}",
                          fix="PRESET_MODEL is one of tiny, 4layer, flash, pro; overrides are field=value "
                              "with values the model accepts (sizes and counts >= 1)") from None
    expert = sum(math.prod(s) for name, s in shapes.items() if ".experts." in name)
    total = sum(math.prod(s) for s in shapes.values())
    # Without their loss terms the MTP blocks and the indexers get no gradient, hence no Adam state
    # (measured: the H200 smoke checkpoint is 32 GiB, not the 36 GiB that optimizer state for all would be).
    untrained = sum(math.prod(s) for name, s in shapes.items()
                    if (name.startswith("mtp.") and not cfg["PRESET_MTP_LOSS_COEFF"])
                    or (".indexer." in name and not m.indexer_loss_coeff))
    weight, optimizer = WEIGHT_BYTES.get(m.dtype, 2), OPTIMIZER_BYTES.get(m.dtype, 12)
    ckpt = total * weight + (total - untrained) * optimizer
    return ModelFacts(m.n_layers, m.n_routed_experts, m.n_heads, m.o_groups, total - expert, expert,
                      weight + GRAD_BYTES + optimizer, ckpt)


def _check_prediction(cfg: Config, m: ModelFacts, errors: list[str]) -> None:
    """Derive the cost model's figures for this layout (launcher/costmodel.py). Weights, gradients and Adam state
    over the GPU's memory is an error: certain, and found otherwise only after the download, dequantize and convert
    steps. A predicted peak (activations and all) over the usable memory is a warning: the model holds to +-10 %
    where it is calibrated, and less far from it."""
    v, d = cfg.values, cfg.derived
    if v["PRESET_PP"] > 1 and "PP_STAGE_LAYERS" not in d:
        return                                     # the split is wrong, which is reported; nothing to place
    from launcher import costmodel

    p = costmodel.predict_config(cfg)
    mem = p.memory.parts
    state = mem.get("weights", 0) + mem.get("gradients", 0) + mem.get("optimizer", 0)
    where = f"stage {p.memory.stage} of {v['PRESET_PP']}" if v["PRESET_PP"] > 1 else "every GPU"
    d["STATE_GB_PER_GPU"] = Derived(round(state, 1), f"cost model: weights + fp32 gradients + Adam state, GiB, on the "
                                                     f"fullest GPU ({where})")
    if v["HW_DEVICE"] == "cuda":
        # on a CPU the figures would be a GPU's for the tiny model: the calibration is a GPU's
        d["PREDICTED_PEAK_GB"] = Derived(round(p.peak_gib, 1), f"cost model: peak GiB on the fullest GPU ({where}), "
                                                               "`v4 plan show` explains it by part")
    if p.step_s is not None and v["HW_DEVICE"] == "cuda":
        d["PREDICTED_STEP_S"] = Derived(round(p.step_s, 2), f"cost model: seconds a step (bottleneck {p.bottleneck}; "
                                                            f"{p.rates})")
        d["PREDICTED_TOKENS_PER_S_GPU"] = Derived(round(p.tokens_per_s_gpu), "cost model: tokens/s a GPU")
    capacity = v["HW_GPU_MEMORY_GB"]
    if not capacity:
        return
    if state > capacity:
        # an error: the train step would run out of memory after the download, dequantize and convert steps
        errors.append(f"~{state:.0f} GB of weights, gradients and optimizer state per GPU ({where}) for "
                      f"{at(cfg, 'PRESET_MODEL')} ({(m.dense_params + m.expert_params) / 1e9:.1f} B params) "
                      f"exceed {at(cfg, 'HW_GPU_MEMORY_GB')}; spread it wider ({at(cfg, 'PRESET_EP')}, "
                      f"{at(cfg, 'PRESET_TP')}, {at(cfg, 'PRESET_PP')}) or shrink it, e.g. "
                      f"--set PRESET_MODEL_OVERRIDES=\"n_routed_experts=8\"; the train step would run out of memory")
    elif not p.fits:
        cfg.warnings.append(f"predicted peak {p.overflow}; see `v4 plan show` with the same selection, and `v4 plan "
                            f"layouts` for the layouts that fit ({at(cfg, 'HW_GPU_MEMORY_GB')})")


def peak_checkpoints(num_steps: int, interval: int, retain: int) -> int:
    """Most training checkpoints on disk at once: a save happens every `interval` steps and at the last
    step; after it, only the newest and every `retain`-th one stay."""
    interval = max(1, interval)
    saves = sorted({*range(interval, num_steps + 1, interval), num_steps} - {0})
    kept: list[int] = []
    peak = 0
    for it in saves:
        peak = max(peak, len(kept) + 1)
        kept = [k for k in kept if retain and k % retain == 0] + [it]
    return peak


def at(cfg: Config, key: str) -> str:
    """`KEY=value (file:line)` for error messages."""
    return f"{key}={cfg.shown(key)} ({cfg.origin(key).where})"


def _warn_hw_over_cluster(cfg: Config) -> None:
    """The hardware layer comes after the cluster's: an HW_* value a cluster file sets is overridden by the hw file
    that sets it too (a cluster that must keep HW_NCCL_NVLS_ENABLE=0 on shared hosts would silently lose it)."""
    for key, hist in cfg.history.items():
        mine, last = cfg.set_by(key, "cluster"), len(hist) - 1
        if mine is not None and cfg.set_by(key, "hw") == last and \
                cfg.resolved.get((key, mine)) != cfg.resolved.get((key, last)):
            cfg.warnings.append(f"{hist[last].where} overrides {key}={cfg.resolved.get((key, mine))!r} from "
                                f"{hist[mine].where} (the hardware file comes after the cluster's); to keep the "
                                "cluster's value, give it with --env-file or --set")


def derive_and_check(cfg: Config) -> None:
    v, d, errors = cfg.values, cfg.derived, []
    _warn_hw_over_cluster(cfg)

    # -- topology ---------------------------------------------------------------------------------
    if len(cfg.nodes) != v["V4_NUM_NODES"]:
        errors.append(f"{at(cfg, 'V4_NUM_NODES')} but V4_MASTER_IP + V4_WORKER_IPS name "
                      f"{len(cfg.nodes)} node(s) ({cfg.origin('V4_WORKER_IPS').where})")
    job_nodes = v["PRESET_NUM_NODES"] or v["V4_NUM_NODES"]
    if job_nodes > v["V4_NUM_NODES"]:
        errors.append(f"{at(cfg, 'PRESET_NUM_NODES')} exceeds the cluster's {at(cfg, 'V4_NUM_NODES')}")
    per_node = v["PRESET_GPUS_PER_NODE"] or v["V4_NUM_GPUS_PER_NODE"]
    if v["HW_DEVICE"] == "cuda" and per_node > v["V4_NUM_GPUS_PER_NODE"]:
        errors.append(f"{at(cfg, 'PRESET_GPUS_PER_NODE')} exceeds the GPUs of a node, {at(cfg, 'V4_NUM_GPUS_PER_NODE')}")
    world = job_nodes * per_node
    d["JOB_NUM_NODES"] = Derived(job_nodes, "PRESET_NUM_NODES or V4_NUM_NODES")
    d["WORLD_SIZE"] = Derived(world, "JOB_NUM_NODES * (PRESET_GPUS_PER_NODE or V4_NUM_GPUS_PER_NODE)")
    d["NODES"] = Derived(cfg.nodes, "V4_MASTER_IP + V4_WORKER_IPS")
    _derive_rollout(cfg)

    tp, pp, cp, ep = v["PRESET_TP"], v["PRESET_PP"], v["PRESET_CP"], v["PRESET_EP"]
    _check_ranges(cfg, errors)
    if errors:
        raise InvalidConfig(errors)
    if not cfg.selection.preset:
        # Without a workload only the cluster and hardware layers can disagree.
        _check_site(cfg, errors)
        if errors:
            raise InvalidConfig(errors)
        return
    if cp > 1:
        # what dsv4.megatron's split needs (parallel.Layout.validate says the same, later, in the job)
        seq = v["PRESET_SEQ_LEN"]
        if seq % (2 * cp):
            errors.append(f"{at(cfg, 'PRESET_SEQ_LEN')} is not a multiple of 2*CP = {2 * cp}: context parallelism cuts "
                          f"each sequence into 2*CP equal chunks ({at(cfg, 'PRESET_CP')})")
        elif (seq // cp) % tp:
            errors.append(f"{at(cfg, 'PRESET_SEQ_LEN')} / CP = {seq // cp} positions per rank do not split over "
                          f"{at(cfg, 'PRESET_TP')} (sequence parallelism)")
        if v["PRESET_MODE"] == "rl":
            errors.append(f"{at(cfg, 'PRESET_CP')}: RL scores log-probabilities over whole sequences, which the trainer "
                          f"does not do under context parallelism; set PRESET_CP=1 for RL")
    model_parallel = tp * pp * cp
    if world % model_parallel:
        errors.append(f"TP*PP*CP = {model_parallel} does not divide the world size {world} "
                      f"(= {job_nodes} nodes x {at(cfg, 'V4_NUM_GPUS_PER_NODE')}); "
                      f"{at(cfg, 'PRESET_TP')}, {at(cfg, 'PRESET_PP')}, {at(cfg, 'PRESET_CP')}")
        dp = 0
    else:
        dp = world // model_parallel
    d["DP"] = Derived(dp, "WORLD_SIZE / (TP * PP * CP)")

    # -- model-dependent checks -------------------------------------------------------------------
    m = model_facts(cfg)
    d["MODEL_LAYERS"] = Derived(m.n_layers, f"dsv4 preset {v['PRESET_MODEL']} + overrides")
    d["MODEL_EXPERTS"] = Derived(m.n_experts, f"dsv4 preset {v['PRESET_MODEL']} + overrides")
    if m.n_experts % ep:
        errors.append(f"{at(cfg, 'PRESET_EP')} does not divide the model's {m.n_experts} routed experts "
                      f"({at(cfg, 'PRESET_MODEL')})")
    if dp and (dp * cp * tp) % ep:
        # megatron folds CP into the expert-parallel ranks: experts spread over DP*CP*TP
        errors.append(f"{at(cfg, 'PRESET_EP')} does not divide DP*CP*TP = {dp}*{cp}*{tp} = {dp * cp * tp}")
    if sglang_engine(cfg) and m.n_experts % v["V4_ROLLOUT_EP"]:
        errors.append(f"{at(cfg, 'V4_ROLLOUT_EP')} does not divide the model's {m.n_experts} routed experts "
                      f"({at(cfg, 'PRESET_MODEL')}): each SGLang expert-parallel rank holds an equal share")
    if m.n_heads % tp or m.o_groups % tp:
        errors.append(f"{at(cfg, 'PRESET_TP')} must divide the model's {m.n_heads} heads and "
                      f"{m.o_groups} output groups ({at(cfg, 'PRESET_MODEL')})")
    try:
        stages = pipeline_split(m.n_layers, pp, v["PRESET_PP_FIRST_LAYERS"], v["PRESET_PP_LAST_LAYERS"],
                                v["PRESET_PP_LAYOUT"])
        d["PP_STAGE_LAYERS"] = Derived(stages, "pipeline split of MODEL_LAYERS over PP stages")
    except ValueError as e:
        keys = ("PRESET_PP_LAYOUT",) if v["PRESET_PP_LAYOUT"] else ("PRESET_PP_FIRST_LAYERS", "PRESET_PP_LAST_LAYERS")
        errors.append(f"pipeline split: {e}; {', '.join(at(cfg, k) for k in (*keys, 'PRESET_PP'))}, "
                      f"model layers {m.n_layers} ({at(cfg, 'PRESET_MODEL')})")

    # -- memory and step time: the cost model that `v4 plan`, the dry-run plan and the B0 gates use too --------
    _check_prediction(cfg, m, errors)

    # -- training checkpoints on disk: the previous one stays until the new one is complete ------------
    ckpt_gb = m.ckpt_bytes / 1e9                                                      # GB, as df reports
    peak = peak_checkpoints(v["PRESET_NUM_STEPS"], v["PRESET_SAVE_INTERVAL"], v["PRESET_SAVE_RETAIN_INTERVAL"])
    d["CKPT_GB"] = Derived(float(f"{ckpt_gb:.3g}"), "every weight + fp32 master (bf16) and Adam moments of the params "
                                              "that get gradients (not MTP/indexer without their loss)")
    d["CKPT_PEAK_COUNT"] = Derived(peak, "checkpoints on disk at once: NUM_STEPS, SAVE_INTERVAL, SAVE_RETAIN_INTERVAL "
                                         "(the latest is kept; the previous one until the next save completes)")
    d["CKPT_PEAK_GB"] = Derived(float(f"{peak * ckpt_gb:.3g}"), "CKPT_GB * CKPT_PEAK_COUNT (preflight checks V4_WORK's free space)")

    # -- checkpoints: the real release (hf) or a generated one per model/overrides/seed -----------
    if v["PRESET_WEIGHTS"] == "generate":
        tag = model_tag(v["PRESET_MODEL"], v["PRESET_MODEL_OVERRIDES"], v["PRESET_SEED"])
        base = f"{v['V4_MODELS']}/generated/{tag}"
        dirs = (f"{base}/official", f"{base}/bf16", f"{base}/torch_dist")
        formula = "V4_MODELS/generated/<model>-<overrides hash>-s<seed>/..."
    else:
        dirs = (v["V4_HF_DIR"], v["V4_BF16_DIR"], v["V4_TORCH_DIST"])
        formula = "V4_HF_DIR / V4_BF16_DIR / V4_TORCH_DIST"
    for key, path in zip(("CKPT_HF_DIR", "CKPT_BF16_DIR", "CKPT_TORCH_DIST"), dirs):
        d[key] = Derived(path, formula)

    # -- batch and token budget -------------------------------------------------------------------
    if v["PRESET_MODE"] == "rl" and v["V4_ROLLOUT_ENGINE"] != "embedded" and v["PRESET_RL_SYNC"] == "inproc":
        errors.append(f"{at(cfg, 'PRESET_RL_SYNC')} copies weights inside the trainer's process, but "
                      f"{at(cfg, 'V4_ROLLOUT_ENGINE')} serves from its own processes: use broadcast (or disk, on a "
                      "path both see)")
    if v["PRESET_MODE"] == "rl":
        # an RL step trains on every sample it rolled out: the global batch is prompts x group
        samples = v["PRESET_RL_PROMPTS_PER_STEP"] * v["PRESET_RL_GROUP_SIZE"]
        d["RL_SAMPLES_PER_STEP"] = Derived(samples, "PRESET_RL_PROMPTS_PER_STEP * PRESET_RL_GROUP_SIZE")
        m = max(1, v["PRESET_RL_MINIBATCHES"])
        share = samples // (dp * m) if dp else samples      # one rank's samples in one update
        if dp and (samples % (dp * m) or not share or share % min(v["PRESET_MICRO_BATCH_SIZE"], share)):
            errors.append(f"{samples} samples per RL step ({at(cfg, 'PRESET_RL_PROMPTS_PER_STEP')} x "
                          f"{at(cfg, 'PRESET_RL_GROUP_SIZE')}) do not split into DP={dp} x "
                          f"{at(cfg, 'PRESET_RL_MINIBATCHES')} equal shares of whole micro-batches of "
                          f"{at(cfg, 'PRESET_MICRO_BATCH_SIZE')}")
    elif dp and v["PRESET_GLOBAL_BATCH_SIZE"] % (v["PRESET_MICRO_BATCH_SIZE"] * dp):
        errors.append(f"{at(cfg, 'PRESET_GLOBAL_BATCH_SIZE')} is not a multiple of "
                      f"MICRO_BATCH_SIZE*DP = {v['PRESET_MICRO_BATCH_SIZE']}*{dp}")
    tokens_per_gpu = v["PRESET_SEQ_LEN"] * v["PRESET_MICRO_BATCH_SIZE"] // cp
    d["TOKENS_PER_GPU"] = Derived(tokens_per_gpu, "SEQ_LEN * MICRO_BATCH_SIZE / CP")
    if tokens_per_gpu > v["HW_MAX_TOKENS_PER_GPU"]:
        errors.append(f"{tokens_per_gpu} tokens per GPU (SEQ_LEN*MICRO_BATCH_SIZE/CP) exceed "
                      f"{at(cfg, 'HW_MAX_TOKENS_PER_GPU')}; {at(cfg, 'PRESET_SEQ_LEN')}, {at(cfg, 'PRESET_CP')}")
    if d["DP"].value and v["PRESET_MODE"] != "rl":
        d["GRAD_ACCUM_STEPS"] = Derived(v["PRESET_GLOBAL_BATCH_SIZE"] // (v["PRESET_MICRO_BATCH_SIZE"] * dp),
                                        "GLOBAL_BATCH_SIZE / (MICRO_BATCH_SIZE * DP)")

    # -- device and kernels -----------------------------------------------------------------------
    impl = v["PRESET_ATTN_IMPL"]
    if impl == "auto":
        impl = "tilelang" if v["HW_DEVICE"] == "cuda" else "torch"
    d["ATTN_IMPL"] = Derived(impl, "PRESET_ATTN_IMPL (auto: tilelang on cuda, torch on cpu)")
    if impl == "tilelang" and v["HW_DEVICE"] != "cuda":
        errors.append(f"{at(cfg, 'PRESET_ATTN_IMPL')} needs a GPU but {at(cfg, 'HW_DEVICE')}")
    if v["HW_DIST_BACKEND"] == "nccl" and v["HW_DEVICE"] != "cuda":
        errors.append(f"{at(cfg, 'HW_DIST_BACKEND')} needs {at(cfg, 'HW_DEVICE')} to be cuda")

    _check_site(cfg, errors)
    if errors:
        raise InvalidConfig(errors, fix="change the values above (or override them with --set KEY=VALUE), "
                                        "then `v4 config validate`")


def _check_ranges(cfg: Config, errors: list[str]) -> None:
    v = cfg.values
    for key in POSITIVE_KEYS:
        if v[key] < 1:
            errors.append(f"{at(cfg, key)} must be >= 1")
    for key in NON_NEGATIVE_KEYS:
        if v[key] < 0:
            errors.append(f"{at(cfg, key)} must be >= 0 ({SCHEMA[key].doc})")
    for key in POSITIVE_SECONDS_KEYS:
        if v[key] <= 0:
            errors.append(f"{at(cfg, key)} must be > 0 seconds")
    t = v["PRESET_RL_TEMPERATURE"]
    if not (t == 0 or t >= RL_SAMPLING_EPS):
        errors.append(f"{at(cfg, 'PRESET_RL_TEMPERATURE')} must be 0 (greedy) or >= {RL_SAMPLING_EPS:g}: a rollout "
                      "engine samples greedily below that (SGLang's floor) while the trainer would score at the "
                      "temperature, so rollout and training log-probabilities would disagree")


def _check_site(cfg: Config, errors: list[str]) -> None:
    """What the cluster and hardware layers alone decide: ports, paths, names, transport, the rollout servers."""
    _check_ports_paths(cfg, errors)
    _check_names(cfg, errors)
    _check_onboarding(cfg, errors)
    _check_rollout(cfg, errors)


DOC_NETS = [ipaddress.ip_network(n) for n in ("192.0.2.0/24", "198.51.100.0/24", "203.0.113.0/24", "2001:db8::/32")]
PLACEHOLDER_PATH = re.compile(r"(^|[\s:=])/your/")


def placeholders(cfg: Config) -> list[str]:
    """Keys still holding a template's placeholder: a documentation-range address (RFC 5737/3849) or a /your/ path."""
    out = []
    for key in ("V4_MASTER_IP", "V4_WORKER_IPS", "V4_REDIS_HOST", "V4_ROLLOUT_NODES"):
        vals = cfg.values[key] if isinstance(cfg.values[key], list) else [cfg.values[key]]
        for h in vals:
            try:
                if any(ipaddress.ip_address(h) in n for n in DOC_NETS):
                    out.append(key)
                    break
            except ValueError:
                pass
    for key, hist in cfg.history.items():
        # the key's own text, not its value: V4_MODELS="${V4_WORK}/models" is fixed by fixing V4_WORK
        if key.startswith("V4_") and hist and PLACEHOLDER_PATH.search(hist[-1].raw):
            out.append(key)
    return list(dict.fromkeys(out))


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _check_onboarding(cfg: Config, errors: list[str]) -> None:
    """What a new cluster file gets wrong and only bring-up or a job would say: placeholders left from its template,
    a name that is not its file's, a head no worker can reach, keys its transport or container mode needs."""
    v = cfg.values
    if not v["V4_CLUSTER_TEMPLATE"]:
        for key in placeholders(cfg):
            errors.append(f"{at(cfg, key)} is a template placeholder (a documentation-range address or a /your/ "
                          f"path) that reaches nothing; put the real value there, e.g. `v4 cluster init "
                          f"{v['V4_CLUSTER_NAME']} --from <template> --master ADDR --workers 'ADDR ...' --work DIR`")
    cluster_file = dict(cfg.layers).get("cluster")
    # a named cluster (`--cluster NAME` finds envs/cluster/NAME.env); a file given by its path is not looked up by name
    if cluster_file and cluster_file.startswith("envs/cluster/") and cluster_file.endswith(".env"):
        stem = Path(cluster_file).name[:-len(".env")]
        if v["V4_CLUSTER_NAME"] != stem and cfg.origin("V4_CLUSTER_NAME").where.startswith(cluster_file + ":"):
            # runs, Ray namespaces and stage records carry the name; `--cluster NAME` finds the file: one name for both
            errors.append(f"{at(cfg, 'V4_CLUSTER_NAME')} differs from its file's name {stem!r} ({cluster_file}); "
                          f"set V4_CLUSTER_NAME={stem}, or rename the file to {v['V4_CLUSTER_NAME']}.env")
    remote = [w for w in v["V4_WORKER_IPS"] if not _is_loopback(w)]
    if _is_loopback(v["V4_MASTER_IP"]) and remote:
        errors.append(f"{at(cfg, 'V4_MASTER_IP')} is a loopback address but the workers ({' '.join(remote)}, "
                      f"{cfg.origin('V4_WORKER_IPS').where}) are other hosts: they would dial themselves to join Ray; "
                      "put the head's address on the cluster network")
    if v["V4_CONTAINER"] and not v["V4_IMAGE"]:
        errors.append(f"{at(cfg, 'V4_CONTAINER')} (container mode) needs the image to start it from, but "
                      f"{at(cfg, 'V4_IMAGE')} is empty; set V4_IMAGE, or empty V4_CONTAINER to run on the hosts")
    if v["V4_TRANSPORT"] == "ssh" and not v["V4_SSH_USER"]:
        errors.append(f"{at(cfg, 'V4_TRANSPORT')} needs an account on the nodes, but {at(cfg, 'V4_SSH_USER')} is empty")


def sglang_engine(cfg: Config) -> bool:
    """Whether the configuration asks for SGLang rollout servers. Checked whatever PRESET_MODE is: the key usually
    sits in the cluster file, and a layout SGLang would refuse should be named by `v4 config validate` already."""
    return cfg.values["V4_ROLLOUT_ENGINE"] == "sglang"


def _derive_rollout(cfg: Config) -> None:
    """ROLLOUT_NODES and ROLLOUT_URLS: where the SGLang servers run and where the trainer finds them (the RL job reads
    them from the run's config.json)."""
    if not sglang_engine(cfg):
        return
    v, d = cfg.values, cfg.derived
    if v["V4_ROLLOUT_NODES"]:
        nodes, formula = list(v["V4_ROLLOUT_NODES"]), "V4_ROLLOUT_NODES"
    else:
        # colocated: the nodes the trainer runs on, head first (the job takes the first JOB_NUM_NODES)
        nodes, formula = cfg.nodes[:d["JOB_NUM_NODES"].value], "the trainer's nodes (V4_ROLLOUT_NODES empty: colocated)"
    d["ROLLOUT_NODES"] = Derived(nodes, formula)
    d["ROLLOUT_URLS"] = Derived([server_url(ip, v["V4_ROLLOUT_PORT"]) for ip in nodes],
                                "http://<ROLLOUT_NODES>:V4_ROLLOUT_PORT")


def server_url(host: str, port: int) -> str:
    """An HTTP base URL; an IPv6 address goes in brackets."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _check_rollout(cfg: Config, errors: list[str]) -> None:
    """SGLang rollout servers: only on GPUs, on nodes of this cluster, in a layout SGLang 0.5.23 accepts."""
    v = cfg.values
    if not (0 < v["V4_ROLLOUT_MEM_FRACTION"] <= 1):
        errors.append(f"{at(cfg, 'V4_ROLLOUT_MEM_FRACTION')} must be in (0, 1]: it is the share of each GPU's memory "
                      "SGLang takes for weights and KV cache (--mem-fraction-static)")
    _check_rollout_extra_args(cfg, errors)
    if not sglang_engine(cfg):
        return
    if v["HW_DEVICE"] != "cuda":
        errors.append(f"{at(cfg, 'V4_ROLLOUT_ENGINE')} but {at(cfg, 'HW_DEVICE')}: SGLang cannot serve without a GPU; "
                      "use V4_ROLLOUT_ENGINE=embedded")
    if not _valid_port(v[ROLLOUT_PORT_KEY]):
        errors.append(f"{at(cfg, ROLLOUT_PORT_KEY)} is not a valid port (1-65535): {at(cfg, 'V4_ROLLOUT_ENGINE')} "
                      "serves on it")
    outside = [ip for ip in v["V4_ROLLOUT_NODES"] if ip not in cfg.nodes]
    if outside:
        # preflight, Ray and the SSH settings cover the cluster's nodes only
        errors.append(f"V4_ROLLOUT_NODES entries {' '.join(outside)} ({cfg.origin('V4_ROLLOUT_NODES').where}) are not "
                      f"nodes of the cluster (V4_MASTER_IP + V4_WORKER_IPS: {' '.join(cfg.nodes)}); list cluster nodes "
                      "only, or add them to V4_WORKER_IPS")
    if len(set(v["V4_ROLLOUT_NODES"])) != len(v["V4_ROLLOUT_NODES"]):
        errors.append(f"{at(cfg, 'V4_ROLLOUT_NODES')} names a node twice: one server per node, on V4_ROLLOUT_PORT")
    tp, ep, dp, gpus = v["V4_ROLLOUT_TP"], v["V4_ROLLOUT_EP"], v["V4_ROLLOUT_DP"], v["V4_NUM_GPUS_PER_NODE"]
    if min(tp, ep, dp) < 1:
        return                                   # reported by _check_ranges
    if v["HW_DEVICE"] == "cuda" and gpus % (tp * dp):
        errors.append(f"V4_ROLLOUT_TP*V4_ROLLOUT_DP = {tp}*{dp} = {tp * dp} GPUs per server does not divide the "
                      f"{gpus} GPUs of a rollout node ({at(cfg, 'V4_ROLLOUT_TP')}, {at(cfg, 'V4_ROLLOUT_DP')}, "
                      f"{at(cfg, 'V4_NUM_GPUS_PER_NODE')})")
    # SGLang 0.5.23: --dp-size counts whole replicas, each a TP group, and the experts are split inside one TP group
    # (model_executor/model_runner_components/moe_ep_setup.py: "tp_size ... must be divisible by ep_size"). So EP must
    # divide TP, which is stricter than dividing TP*DP.
    if tp % ep:
        errors.append(f"{at(cfg, 'V4_ROLLOUT_EP')} must divide {at(cfg, 'V4_ROLLOUT_TP')}: SGLang 0.5.23 splits the "
                      "experts inside each tensor-parallel replica (--dp-size counts whole replicas), so dividing "
                      f"TP*DP = {tp * dp} is not enough")


def _check_rollout_extra_args(cfg: Config, errors: list[str]) -> None:
    """V4_ROLLOUT_EXTRA_ARGS must split into shell words, and must not repeat a flag the launcher sets."""
    try:
        words = shlex.split(cfg.values["V4_ROLLOUT_EXTRA_ARGS"])
    except ValueError as e:
        errors.append(f"{at(cfg, 'V4_ROLLOUT_EXTRA_ARGS')} is not a list of shell words ({e}); quote values with "
                      "spaces, e.g. --json-model-override-args '{\"k\": 1}'")
        return
    for w in words:
        flag = w.split("=", 1)[0]
        if flag in ROLLOUT_OWNED_FLAGS:
            errors.append(f"{at(cfg, 'V4_ROLLOUT_EXTRA_ARGS')} sets {flag}, which the launcher sets from "
                          f"{ROLLOUT_OWNED_FLAGS[flag]}: set that instead and drop {flag} from the extra args")


def _valid_port(port: int) -> bool:
    return 0 < port < 65536


def _check_ports_paths(cfg: Config, errors: list[str]) -> None:
    v = cfg.values
    for key in ALWAYS_PORT_KEYS:
        if not _valid_port(v[key]):
            errors.append(f"{at(cfg, key)} is not a valid port (1-65535)")
    for key in PORT_KEYS:
        if key == "V4_RAY_CLIENT_PORT" and not 1024 <= v[key] <= 65535:
            # `ray start --head` always runs the client server: no 0 for unused, and Ray refuses ports below 1024
            errors.append(f"{at(cfg, key)} is not a port Ray's client server takes (1024-65535)")
        elif v[key] and not _valid_port(v[key]):
            errors.append(f"{at(cfg, key)} is not a valid port (1-65535, or 0 for unused)")
    # the ports the head listens on, sshd's among them, must differ (an invalid one is reported above)
    seen: dict[int, str] = {}
    rollout = (ROLLOUT_PORT_KEY,) if sglang_engine(cfg) else ()
    for key in (*PORT_KEYS, *rollout, "V4_SSH_PORT"):
        if not _valid_port(v[key]):
            continue
        if v[key] in seen:
            errors.append(f"{at(cfg, key)} collides with {at(cfg, seen[v[key]])}")
        else:
            seen[v[key]] = key
    for key, spec in SCHEMA.items():
        if spec.required and not v[key].strip():
            errors.append(f"{at(cfg, key)} is empty, but it is required ({spec.doc}; paths built from it "
                          f"would land under /): set an absolute path, or drop the empty assignment "
                          f"(default: {spec.default})")
        elif spec.type == "path" and v[key] and not v[key].startswith("/"):
            errors.append(f"{at(cfg, key)} must be an absolute path (nodes resolve relative paths differently)")
    if v["V4_EXECUTOR"] == "local" and (v["V4_TRANSPORT"] != "local" or v["V4_NUM_NODES"] != 1):
        errors.append(f"{at(cfg, 'V4_EXECUTOR')} runs steps on this machine only, but {at(cfg, 'V4_TRANSPORT')}, "
                      f"{at(cfg, 'V4_NUM_NODES')}")
    if v["V4_TRANSPORT"] == "local" and v["V4_NUM_NODES"] != 1:
        errors.append(f"{at(cfg, 'V4_TRANSPORT')} runs on this machine only, but {at(cfg, 'V4_NUM_NODES')}")


def _check_names(cfg: Config, errors: list[str]) -> None:
    """Names and addresses that are pasted into shell scripts must be plain: `x$(cmd)` would run."""
    v = cfg.values
    for key, pattern, what in NAME_RULES:
        value = v[key]
        if key == "V4_CLUSTER_NAME" and not value:
            errors.append(f"{at(cfg, key)} is empty; name the cluster ({what})")
        elif key == "PRESET_RUN_ID_PREFIX" and not value:
            errors.append(f"{at(cfg, key)} is empty; it must be {what}")
        elif value and not pattern.fullmatch(value):
            errors.append(f"{at(cfg, key)} is not valid: it must be {what}")
    how = "write an IPv4/IPv6 address or a host name, e.g. 10.0.0.5 or node-01.example.com"
    if not valid_host(v["V4_MASTER_IP"]):
        errors.append(f"{at(cfg, 'V4_MASTER_IP')} is not an address or host name; {how}")
    for host in v["V4_WORKER_IPS"]:
        if not valid_host(host):
            errors.append(f"V4_WORKER_IPS entry {host!r} ({cfg.origin('V4_WORKER_IPS').where}) is not an address "
                          f"or host name; {how} (entries are separated by spaces)")
    for host in v["V4_STANDBY_IPS"]:
        if not valid_host(host):
            errors.append(f"V4_STANDBY_IPS entry {host!r} ({cfg.origin('V4_STANDBY_IPS').where}) is not an address "
                          f"or host name; {how} (entries are separated by spaces)")
    standby = v["V4_STANDBY_IPS"]
    twice = sorted({h for h in standby if standby.count(h) > 1 or h in cfg.nodes})
    if twice:
        # a standby takes a lost node's place: one already in the cluster (or named twice) would take two
        errors.append(f"{at(cfg, 'V4_STANDBY_IPS')} names {', '.join(twice)} twice, or as a node of the cluster "
                      f"(V4_MASTER_IP, V4_WORKER_IPS); a standby is a node outside the cluster until it is needed")
    if v["V4_MIN_NODES"] > len(cfg.nodes) + len(standby):
        errors.append(f"{at(cfg, 'V4_MIN_NODES')} is more than the cluster's {len(cfg.nodes)} node(s) and "
                      f"{len(standby)} standby(s): no run could start")
    if v["V4_REDIS_HOST"] and not valid_host(v["V4_REDIS_HOST"]):
        errors.append(f"{at(cfg, 'V4_REDIS_HOST')} is not an address or host name; {how} (or leave it empty: no "
                      "external Redis)")


def valid_host(host: str) -> bool:
    """An IPv4/IPv6 address or an RFC 1123 host name."""
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return bool(HOSTNAME_RE.fullmatch(host))


def model_tag(model: str, overrides: list[str], seed: int) -> str:
    if not overrides:
        return f"{model}-s{seed}"
    digest = hashlib.sha256(" ".join(sorted(overrides)).encode()).hexdigest()[:8]
    return f"{model}-{digest}-s{seed}"


LAYOUT_REPEAT = re.compile(r"\(([^()]*)\)\*(\d+)")


def pipeline_split(n_layers: int, pp: int, first: int, last: int, layout: str) -> list[int]:
    """Transformer layers per pipeline stage; raises ValueError naming what does not add up."""
    if layout:
        # megatron layout: '|' separates stages, 't' is a layer, 'E'/'L' embedding/loss,
        # '(x)*n' repeats, ',' is only visual grouping.
        text = layout.replace(",", "")
        while LAYOUT_REPEAT.search(text):
            text = LAYOUT_REPEAT.sub(lambda m: m.group(1) * int(m.group(2)), text)
        if set(text) - set("tEL|m"):
            raise ValueError(f"layout {layout!r} has characters other than t E L m | ( ) * digits")
        stages = [s.count("t") for s in text.split("|")]
        if len(stages) % pp:
            raise ValueError(f"layout has {len(stages)} stages, not a multiple of PP={pp}")
        if sum(stages) != n_layers:
            raise ValueError(f"layout places {sum(stages)} layers, the model has {n_layers}")
        return stages
    if pp == 1:
        return [n_layers]
    if not first and not last:
        if n_layers % pp:
            raise ValueError(f"{n_layers} layers do not split evenly over PP={pp}; set first/last layer counts")
        return [n_layers // pp] * pp
    if first < 0 or last < 0:
        raise ValueError(f"first {first} / last {last} layer counts must be >= 0 (0: even split)")
    first = first or None
    last = last or None
    middle_stages = pp - 2
    rest = n_layers - (first or 0) - (last or 0)
    if first is None or last is None:
        # one end given: the other stages share the rest evenly, at least one layer each
        others = pp - 1
        if rest < others or rest % others:
            raise ValueError(f"{first or last} layers on one end leave {rest} for the other {others} stage(s) "
                             f"(must be a positive multiple of {others})")
        per = rest // others
        return [first or per] + [per] * middle_stages + [last or per]
    if middle_stages == 0:
        if rest:
            raise ValueError(f"first {first} + last {last} = {first + last} layers, the model has {n_layers}")
        return [first, last]
    if rest <= 0 or rest % middle_stages:
        raise ValueError(f"first {first} + last {last} leave {rest} layers for {middle_stages} middle stages "
                         f"(must be a positive multiple)")
    return [first] + [rest // middle_stages] * middle_stages + [last]
