"""Every configuration key, declared once: type, default, usual layer, one-line doc.

Prefixes follow the layer that normally sets a key: V4_* the cluster and base files, HW_* the
hardware file, PRESET_* the workload preset. Any layer may set any key; the prefix is a convention
that `v4 config show --explain` makes visible, not a restriction.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

SECRET_RE = re.compile(r"_(PASSWORD|TOKEN|KEY)$")


@dataclass(frozen=True)
class Key:
    name: str
    type: str               # str | int | float | bool | path | list | enum | port (an int, or `auto`)
    default: str            # as it would be written in an env file ("" = unset)
    layer: str              # cluster | base | hw | preset
    doc: str
    choices: tuple[str, ...] = field(default=())

    @property
    def secret(self) -> bool:
        # A *_KEY that holds a file path names a secret, it is not one.
        return bool(SECRET_RE.search(self.name)) and self.type != "path"

    @property
    def required(self) -> bool:
        # A path with a default is one the launcher always uses (the shared root, run registry, caches):
        # emptied, it would silently become a path under `/` ("${V4_WORK}/runs" -> "/runs").
        return self.type == "path" and self.default != ""


def _k(name, type, default, layer, doc, choices=()):
    return Key(name, type, str(default), layer, doc, tuple(choices))


KEYS: list[Key] = [
    # --- cluster identity and topology -----------------------------------------------------------
    _k("V4_CLUSTER_NAME", "str", "local", "cluster", "name of the cluster (used for run ids and Ray namespaces)"),
    _k("V4_CLUSTER_TEMPLATE", "bool", 0, "cluster",
       "this cluster file is a template: its placeholders pass validate (`v4 cluster init NAME --from` it)"),
    _k("V4_GPU_MODEL", "str", "", "cluster", "hw layer this cluster's nodes use (selects hw/<name>.env when --hw auto)"),
    _k("V4_TRANSPORT", "enum", "local", "cluster", "how nodes are reached: local subprocess or SSH", ("local", "ssh")),
    _k("V4_MASTER_IP", "str", "127.0.0.1", "cluster", "address of the head node (Ray head, rank-0 rendezvous)"),
    _k("V4_WORKER_IPS", "list", "", "cluster", "addresses of the worker nodes, space-separated"),
    _k("V4_NUM_NODES", "int", 1, "cluster", "nodes in the cluster (head + workers)"),
    _k("V4_NUM_GPUS_PER_NODE", "int", 1, "cluster", "training processes per node: GPUs, or gloo processes on hw=cpu"),
    _k("V4_EXECUTOR", "enum", "ray", "cluster",
       "how steps run: Ray jobs on the cluster, or subprocesses on this one machine (no Ray needed)", ("ray", "local")),
    # docs/resilience.md: nodes left out before a run (--exclude-bad-nodes) or lost in one, standbys in their place
    _k("V4_STANDBY_IPS", "list", "", "cluster",
       "standby nodes, space-separated: no Ray until a node is left out at preflight (--exclude-bad-nodes) or lost "
       "mid-run; then one that passes preflight takes its place (same SSH, paths and GPUs as the others)"),
    _k("V4_MIN_NODES", "int", 0, "cluster",
       "fewest nodes a run goes on with once bad or lost nodes are left out (0: as few as the run's layout allows)"),
    _k("V4_NODE_DEAD_TIMEOUT", "float", 30, "cluster",
       "seconds a node may miss Ray's health checks before the GCS declares it dead, set on the Ray `v4 cluster up` "
       "starts (Ray's own: 15 s for a killed raylet, 63 s for a host off the network): a lost node is noticed that "
       "fast"),
    # --- SSH --------------------------------------------------------------------------------------
    _k("V4_SSH_USER", "str", "root", "cluster", "SSH login user on every node"),
    _k("V4_SSH_PORT", "int", 22, "cluster", "SSH port on every node"),
    _k("V4_SSH_KEY", "path", "", "cluster", "private key file for SSH (empty: the agent / ~/.ssh defaults)"),
    _k("V4_SSH_KNOWN_HOSTS", "path", "", "cluster", "known_hosts file host keys are checked against (empty: ~/.ssh/known_hosts)"),
    _k("V4_SSH_ACCEPT_NEW_HOST_KEYS", "bool", 0, "cluster", "accept and record unknown host keys (never silent; off by default)"),
    _k("V4_SSH_CONNECT_TIMEOUT", "float", 10, "cluster", "seconds to wait for an SSH connection"),
    _k("V4_SSH_COMMAND_TIMEOUT", "float", 600, "cluster", "default seconds a remote command may run"),
    _k("V4_SSH_RETRIES", "int", 3, "cluster", "connection attempts per node before it is reported unreachable"),
    # --- software and storage --------------------------------------------------------------------
    _k("V4_PYTHON", "str", "", "cluster", "Python interpreter on the nodes (empty: the launcher's own)"),
    _k("V4_WORK", "path", "${V4_ROOT}/outputs", "cluster", "shared root visible at the same path on every node"),
    _k("V4_LOCAL_DIR", "path", "/tmp/v4-{node_ip}", "cluster", "node-local scratch; {node_ip} is replaced per node"),
    _k("V4_IMAGE", "str", "", "cluster", "container image (with V4_CONTAINER)"),
    _k("V4_CONTAINER", "str", "", "cluster", "container name to run inside via docker exec (empty: no container)"),
    _k("V4_DOCKER_MOUNTS", "list", "", "cluster", "bind mounts src:dst for the container, space-separated"),
    _k("V4_CONTAINER_SHM_SIZE", "str", "200g", "cluster", "--shm-size of the container"),
    _k("V4_HTTP_PROXY", "str", "", "cluster", "HTTP(S) proxy for the nodes (empty: none)"),
    _k("V4_TZ", "str", "", "cluster", "time zone exported to jobs (empty: the node's)"),
    _k("V4_REDIS_HOST", "str", "", "cluster", "external Redis for Ray GCS fault tolerance (empty: the GCS keeps its state in memory)"),
    _k("V4_REDIS_PORT", "int", 6379, "cluster", "port of the external Redis"),
    _k("V4_REDIS_PASSWORD", "str", "", "cluster", "password of the external Redis (secret; redacted)"),
    # --- ports and networking --------------------------------------------------------------------
    # type port: a number, or `auto` (V4_TRANSPORT=local only): picked free once per V4_LOCAL_DIR and recorded there
    # (launcher/config/ports.py), so every checkout's local Ray has ports of its own
    _k("V4_RAY_PORT", "port", 6379, "cluster", "Ray GCS port on the head (auto: picked once for this checkout)"),
    _k("V4_DASHBOARD_PORT", "port", 8265, "cluster",
       "Ray dashboard / Jobs API port on the head (auto: picked once for this checkout)"),
    _k("V4_RAY_CLIENT_PORT", "port", 10001, "cluster",
       "Ray client server (ray://) port on the head, 1024-65535 (auto: picked once for this checkout)"),
    _k("V4_DIST_PORT", "port", 29500, "cluster",
       "torch.distributed rendezvous port (MASTER_PORT); 0: each job's store binds one the OS picks"),
    _k("V4_PROMETHEUS_PORT", "int", 0, "cluster", "Prometheus port (0: not used)"),
    _k("V4_GRAFANA_PORT", "int", 0, "cluster", "Grafana port (0: not used)"),
    _k("V4_RAY_NUM_CPUS", "str", "", "cluster", "CPUs each Ray node advertises (empty: detected)"),
    _k("V4_RAY_READY_TIMEOUT", "float", 120, "cluster", "seconds to wait for every Ray node to register"),
    _k("V4_SOCKET_IFNAME", "str", "auto", "cluster", "NCCL/Gloo socket interface (auto: the default-route interface)"),
    _k("V4_EXPECT_IB", "bool", 0, "cluster", "InfiniBand devices must be present on every node"),
    _k("V4_NCCL_IB_DISABLE", "bool", 0, "cluster", "set NCCL_IB_DISABLE=1 for jobs (hosts whose IB driver rejects memory registration)"),
    # --- RL rollout engine (PRESET_MODE=rl) --------------------------------------------------------
    _k("V4_ROLLOUT_ENGINE", "enum", "embedded", "cluster",
       "RL rollouts: the embedded engine inside the trainer, the embedded engine as a `v4 rl serve` process the RL job "
       "starts beside rank 0 (server), or SGLang servers the launcher starts", ("embedded", "server", "sglang")),
    _k("V4_ROLLOUT_NODES", "list", "", "cluster",
       "cluster nodes that run an SGLang rollout server, space-separated (empty: the trainer's nodes, colocated)"),
    _k("V4_ROLLOUT_TP", "int", 1, "cluster", "SGLang --tp-size of each rollout server"),
    _k("V4_ROLLOUT_EP", "int", 1, "cluster", "SGLang --ep-size of each rollout server (must divide V4_ROLLOUT_TP)"),
    _k("V4_ROLLOUT_DP", "int", 1, "cluster", "SGLang --dp-size (model replicas) of each rollout server"),
    _k("V4_ROLLOUT_MEM_FRACTION", "float", 0.7, "cluster",
       "SGLang --mem-fraction-static: share of GPU memory for weights + KV cache"),
    _k("V4_ROLLOUT_PORT", "int", 30000, "cluster", "HTTP port of the SGLang server on each rollout node"),
    _k("V4_SGLANG_VERSION", "str", "0.5.23", "base", "pinned SGLang version the rollout nodes must have (preflight `sglang`)"),
    _k("V4_ROLLOUT_HEALTH_TIMEOUT", "float", 900, "cluster",
       "seconds to wait for every rollout server's /health_generate to answer 200 (weights load first)"),
    _k("V4_ROLLOUT_DSV4_ATTN_BACKEND", "enum", "flashmla", "cluster",
       "SGLang --dsv4-attn-backend (flashmla_mega and trtllm need SM100/SM103)",
       ("auto", "flashmla", "flashmla_mega", "trtllm")),
    _k("V4_ROLLOUT_EXTRA_ARGS", "str", "", "cluster",
       "extra SGLang server flags, appended as written (shell words; no flag the launcher sets itself)"),
    # --- project paths (base.env derives them from V4_WORK) --------------------------------------
    _k("V4_MODELS", "path", "${V4_WORK}/models", "base", "checkpoints root"),
    _k("V4_DATA", "path", "${V4_WORK}/data", "base", "datasets root"),
    _k("V4_OUT", "path", "${V4_WORK}/runs", "base", "run registry root: one directory per run"),
    _k("V4_WANDB_PROJECT", "str", "", "base",
       "Weights & Biases project that every training run logs its metrics to (empty: off); the key comes from "
       "WANDB_API_KEY or ~/.netrc (`wandb login`) where the training ranks run, never from a config file"),
    _k("V4_WANDB_MODE", "enum", "online", "base",
       "online, or offline: the W&B run stays under RUN/wandb for `wandb sync`", ("online", "offline")),
    _k("V4_WANDB_BASE_URL", "str", "", "base",
       "W&B server, e.g. a self-hosted one (empty: WANDB_BASE_URL where the ranks run, else wandb's default)"),
    _k("V4_WANDB_TIMEOUT", "float", 30, "base",
       "seconds W&B may take to answer preflight's request, to start the run, and to upload the rest at the end "
       "(what is left stays under RUN/wandb for `wandb sync`)"),
    _k("V4_HF_DIR", "path", "", "base", "official-layout (FP8/FP4) checkpoint; generated when PRESET_WEIGHTS=generate"),
    _k("V4_BF16_DIR", "path", "", "base", "dequantized BF16 HF checkpoint"),
    _k("V4_TORCH_DIST", "path", "", "base", "Megatron distributed checkpoint converted for training"),
    _k("V4_SFT_DATA", "path", "", "base", "normalized chat data (jsonl) the SFT job reads"),
    _k("V4_HF_HOME", "path", "${V4_WORK}/.cache/huggingface", "base", "HF_HOME for jobs"),
    _k("V4_COMPILE_CACHE", "path", "${V4_WORK}/compile-cache", "base",
       "compiled kernels (TileLang, inductor, Triton) every rank of every node loads and adds to, so a later run's "
       "first step does not compile them again; one subdirectory per GPU model and torch/Triton/TileLang version, "
       "0700 (dsv4/procenv.py)"),
    # --- hardware ---------------------------------------------------------------------------------
    _k("HW_DEVICE", "enum", "cpu", "hw", "device jobs train on", ("cpu", "cuda")),
    _k("HW_DIST_BACKEND", "enum", "gloo", "hw", "torch.distributed backend", ("gloo", "nccl")),
    _k("HW_GPU_NAME", "str", "", "hw", "substring the GPU's name must contain (preflight); empty on cpu"),
    _k("HW_GPU_MEMORY_GB", "float", 0, "hw", "memory per GPU in GB (0 on cpu)"),
    _k("HW_PEAK_TFLOPS", "float", 0, "hw", "dense bf16 peak TFLOP/s of one GPU: MFU's denominator (0: no MFU)"),
    # the cost model's (launcher/costmodel.py, `v4 plan`) bandwidths: what each hw file states is a measurement or an
    # assumption with its source, said next to the value
    _k("HW_NVLINK_GBPS", "float", 0, "hw",
       "bus bandwidth of NCCL collectives among one node's GPUs, GB/s a GPU (cost model; 0: unknown, not timed)"),
    _k("HW_IB_GBPS", "float", 0, "hw",
       "network bandwidth between nodes, GB/s a GPU (cost model: all-to-all and gradient reduction across nodes; "
       "0: unknown, not timed)"),
    _k("HW_MAX_TOKENS_PER_GPU", "int", 4096, "hw", "token budget per GPU per micro-batch"),
    _k("HW_RECOMPUTE_GRANULARITY", "enum", "none", "hw",
       "activation recomputation: full recomputes each transformer block in backward", ("none", "full")),
    _k("HW_NCCL_NVLS_ENABLE", "bool", 0, "hw", "NVLink SHARP (multicast) in NCCL; keep 0 where the host forbids it"),
    _k("HW_NCCL_MIN_BUSBW_GBPS", "float", 0, "hw",
       "preflight `nccl`: the all-reduce bus bandwidth across a node's GPUs below which it warns (0: no floor)"),
    _k("HW_GEMM_TFLOPS", "float", 0, "hw",
       "preflight `gpu_perf`: the bf16 GEMM TFLOP/s a healthy GPU of this model reaches in the probe (0: judged "
       "against the other GPUs only)"),
    _k("HW_HBM_GBPS", "float", 0, "hw",
       "preflight `gpu_perf`: the device-to-device copy bandwidth (read + write, GB/s) a healthy GPU reaches in the "
       "probe (0: judged against the other GPUs only)"),
    _k("HW_GPU_PROBE_MIN_FRACTION", "float", 0.8, "hw",
       "preflight `gpu_perf`: a GPU below this fraction of the expected GEMM or copy figure fails (docs/resilience.md)"),
    _k("V4_NCCL_MIN_PAIR_BUSBW_GBPS", "float", 0, "cluster",
       "preflight `nccl_pairs`: the all-reduce bus bandwidth between two nodes' GPUs below which a pair fails (the "
       "fabric's figure; 0: pairs are judged against one another only)"),
    _k("HW_PYTORCH_CUDA_ALLOC_CONF", "str", "expandable_segments:True", "hw", "PYTORCH_CUDA_ALLOC_CONF for jobs"),
    _k("HW_SMOKE_MODEL", "str", "tiny", "hw", "model the smoke preset uses on this hardware"),
    _k("HW_SMOKE_MODEL_OVERRIDES", "list", "", "hw",
       "model overrides of the smoke and rl_smoke presets here (few routed experts: one GPU holds the model)"),
    _k("HW_SMOKE_SAVE_INTERVAL", "int", 3, "hw",
       "the smoke preset's save interval here (its steps: one checkpoint at a time, for large smoke models)"),
    _k("HW_SMOKE_SEQ_LEN", "int", 128, "hw", "sequence length the smoke preset uses on this hardware"),
    _k("HW_SMOKE_LR", "float", 1e-3, "hw", "learning rate the smoke preset uses on this hardware's smoke model"),
    _k("HW_RL_SMOKE_LR", "float", 1e-3, "hw", "learning rate the rl_smoke preset uses on this hardware's smoke model"),
    _k("HW_RL_SMOKE_SYNC_FORMAT", "str", "full", "hw",
       "weight-sync format of the rl_smoke preset here: full (exact, fp32 on CPU) or fp8 (what a GPU rollout serves)",
       choices=("full", "fp8")),
    _k("HW_RL_LOGPROB_TOL", "float", 1e-4, "hw",
       "logprob_match tolerance of the rl_smoke preset here: fp32 round-off on CPU, bf16 kernels on a GPU"),
    # cp_smoke: flash over 64 GPUs by default (TP8 PP4 CP2; EP16 keeps the state per GPU at ~78 GB, under an
    # H20's 96); hw/cpu.env runs the tiny model as CP 2 gloo processes instead
    _k("HW_CP_SMOKE_MODEL", "str", "flash", "hw", "model the cp_smoke preset uses on this hardware"),
    _k("HW_CP_SMOKE_WEIGHTS", "enum", "hf", "hw", "the cp_smoke preset's weights here (hf: the release; generate: random)",
       ("generate", "hf")),
    _k("HW_CP_SMOKE_STEPS", "list", "prepare_data verify_template dequantize convert train", "hw",
       "the cp_smoke preset's pipeline steps here (generated weights need the weights step first)"),
    _k("HW_CP_SMOKE_SEQ_LEN", "int", 8192, "hw", "the cp_smoke preset's sequence length here"),
    _k("HW_CP_SMOKE_GLOBAL_BATCH_SIZE", "int", 128, "hw", "the cp_smoke preset's global batch here"),
    _k("HW_CP_SMOKE_TP", "int", 8, "hw", "the cp_smoke preset's tensor parallel size here"),
    _k("HW_CP_SMOKE_PP", "int", 4, "hw", "the cp_smoke preset's pipeline parallel size here"),
    _k("HW_CP_SMOKE_EP", "int", 16, "hw", "the cp_smoke preset's expert parallel size here"),
    _k("HW_CP_SMOKE_GPUS_PER_NODE", "int", 0, "hw",
       "training processes per node of the cp_smoke preset here (0: the cluster's V4_NUM_GPUS_PER_NODE)"),
    _k("HW_PEAK_MEM_BUDGET_GB", "float", 0, "hw", "dryrun gate: peak memory per GPU must stay under this (0: no gate)"),
    _k("HW_STEP_TIME_BUDGET_S", "float", 0, "hw", "dryrun gate: steady-state step time must stay under this (0: no gate)"),
    # --- workload preset --------------------------------------------------------------------------
    _k("PRESET_STAGE", "str", "", "preset", "stage this preset is (smoke, dryrun, full, ...); gates the next stage"),
    _k("PRESET_REQUIRES_STAGE", "str", "", "preset", "stage that must have passed for the same config first"),
    _k("PRESET_RUN_ID_PREFIX", "str", "run", "preset", "prefix of run ids"),
    _k("PRESET_MODE", "enum", "sft", "preset", "training mode", ("sft", "rl")),
    _k("PRESET_MODEL", "str", "tiny", "preset", "dsv4 model preset: tiny, 4layer, flash, pro"),
    _k("PRESET_MODEL_OVERRIDES", "list", "", "preset", "model field overrides, e.g. \"n_layers=2 n_routed_experts=16\""),
    _k("PRESET_WEIGHTS", "enum", "generate", "preset", "generate a random official-layout checkpoint, or use V4_HF_DIR", ("generate", "hf")),
    _k("PRESET_STEPS", "list", "weights prepare_data verify_template dequantize convert train", "preset", "pipeline steps in order"),
    _k("PRESET_GATES", "list", "finite_loss", "preset", "gates checked after training"),
    _k("PRESET_DATA", "path", "${V4_ROOT}/data/sft_smoke.jsonl", "preset", "chat data source (jsonl or parquet)"),
    _k("PRESET_DATA_MAX_DROP", "float", 0.2, "preset",
       "prepare_data fails when more than this share of PRESET_DATA's rows is dropped (0.2: a fifth)"),
    _k("PRESET_THINKING_MODE", "enum", "chat", "preset", "chat encoding mode (MILES_DSV4_THINKING_MODE)", ("chat", "thinking")),
    _k("PRESET_DROP_THINKING", "bool", 0, "preset", "drop reasoning of earlier assistant turns (MILES_DSV4_DROP_THINKING)"),
    _k("PRESET_NUM_NODES", "int", 0, "preset", "nodes the job uses (0: all of the cluster)"),
    _k("PRESET_GPUS_PER_NODE", "int", 0, "preset",
       "training processes per node the job uses (0: V4_NUM_GPUS_PER_NODE); on hw=cpu gloo processes, which the "
       "cluster's count does not bound"),
    _k("PRESET_NUM_STEPS", "int", 2, "preset", "optimizer steps"),
    _k("PRESET_GLOBAL_BATCH_SIZE", "int", 8, "preset", "sequences per optimizer step"),
    _k("PRESET_MICRO_BATCH_SIZE", "int", 1, "preset", "sequences per micro-batch"),
    _k("PRESET_SEQ_LEN", "int", 4096, "preset", "tokens per sequence"),
    _k("PRESET_SAVE_INTERVAL", "int", 1, "preset", "save a checkpoint every N steps"),
    _k("PRESET_SAVE_RETAIN_INTERVAL", "int", 0, "preset", "keep checkpoints every N steps (0: keep the latest only)"),
    _k("PRESET_TP", "int", 1, "preset", "tensor parallel size"),
    _k("PRESET_PP", "int", 1, "preset", "pipeline parallel size"),
    _k("PRESET_CP", "int", 1, "preset", "context parallel size"),
    _k("PRESET_EP", "int", 1, "preset", "expert parallel size"),
    _k("PRESET_ETP", "int", 1, "preset", "expert tensor parallel size"),
    _k("PRESET_PP_FIRST_LAYERS", "int", 0, "preset", "layers on the first pipeline stage (0: even split)"),
    _k("PRESET_PP_LAST_LAYERS", "int", 0, "preset", "layers on the last pipeline stage (0: even split)"),
    _k("PRESET_PP_LAYOUT", "str", "", "preset", "megatron pipeline layout string, e.g. 'Ett|(tt|)*3,ttL' (overrides first/last)"),
    _k("PRESET_ATTN_IMPL", "enum", "auto", "preset", "sparse attention implementation (auto: tilelang on cuda, torch on cpu)", ("auto", "tilelang", "torch")),
    _k("PRESET_LR", "float", 5e-6, "preset", "peak learning rate"),
    _k("PRESET_MIN_LR", "float", 0, "preset", "final learning rate of the decay"),
    _k("PRESET_LR_DECAY_STYLE", "enum", "constant", "preset", "learning-rate schedule", ("constant", "cosine", "linear")),
    _k("PRESET_LR_WARMUP_ITERS", "int", 0, "preset", "warm-up steps"),
    _k("PRESET_WEIGHT_DECAY", "float", 0.1, "preset", "AdamW weight decay"),
    _k("PRESET_MTP_LOSS_COEFF", "float", 0, "preset", "weight of the MTP blocks' loss (0: MTP neither runs nor trains)"),
    _k("PRESET_SEED", "int", 1234, "preset", "seed for weights, data order and dropout"),
    _k("PRESET_STRICT_PREFLIGHT", "bool", 0, "preset", "treat preflight WARN as FAIL"),
    _k("PRESET_BASELINE_RUN", "str", "", "preset",
       "gate baseline: the run (id under V4_OUT) whose metrics this run must follow step by step"),
    _k("PRESET_BASELINE_TOL", "float", 0.0, "preset",
       "gate baseline: relative tolerance per metric (0: bit-identical)"),
    _k("PRESET_PLANT_NAN", "str", "", "preset", "fault injection for tests: MODULE:STEP[:forward|backward][@COND,...] makes that module's output NaN at "
       "that step (docs/nan.md)"),
    _k("PRESET_NONFINITE_LOCATE", "enum", "rerun", "preset",
       "how exit 16 names the first non-finite module: rerun runs the bad step again with hooks on every module "
       "(free while steps are finite), every_step keeps them on (a fault that does not repeat), off names none",
       ("rerun", "every_step", "off")),
    _k("PRESET_JOB_TIMEOUT", "float", 3600, "preset", "seconds a pipeline step may run before it is stopped"),
    # docs/resilience.md: longer than the slowest stretch between two heartbeats (a step, a checkpoint save or
    # load) of the largest runs, shorter than a hang should cost; the ranks' collective timeout becomes twice it
    _k("PRESET_HANG_TIMEOUT", "float", 1800, "preset",
       "seconds without a heartbeat from any training rank before every rank's Python stacks go to RUN/hang and the "
       "step is stopped (exit 124; 0: no watchdog)"),
    _k("PRESET_PLANT_HANG", "str", "", "preset",
       "fault injection for tests: RANK:STEP[:PHASE][@once] makes that rank sleep for good before the loss "
       "all-reduce (or PHASE, dsv4/heartbeat.py) of that step; @once: in the step's first job only"),
    _k("PRESET_MAX_RESTARTS", "int", 2, "preset",
       "restarts without a person over the run's life (a --resume goes on counting): of a step after a node is lost "
       "mid-step (on the remaining nodes or a standby) or a hang (PRESET_HANG_TIMEOUT), from the last complete "
       "checkpoint, and of an RL rollout engine that died (0: none; docs/resilience.md)"),
    # --- RL (PRESET_MODE=rl; docs/rl.md) ----------------------------------------------------------
    _k("PRESET_RL_TASK", "str", "echo", "preset", "prompts and reward: echo, copy, math (dsv4/rl/tasks.py)"),
    _k("PRESET_RL_REWARD", "str", "", "preset",
       "reward function as package.module:function(sample, response_ids) -> float (empty: the task's own)"),
    _k("PRESET_RL_PROMPTS_PER_STEP", "int", 16, "preset", "prompts drawn per optimizer step"),
    _k("PRESET_RL_GROUP_SIZE", "int", 8, "preset", "responses sampled per prompt (GRPO's group)"),
    _k("PRESET_RL_MAX_NEW_TOKENS", "int", 0, "preset", "response length limit (0: the task's)"),
    _k("PRESET_RL_TEMPERATURE", "float", 1.0, "preset", "rollout sampling temperature; the trainer scores with the same"),
    _k("PRESET_RL_CLIP_LOW", "float", 0.2, "preset", "PPO clip below: ratio >= 1 - this"),
    _k("PRESET_RL_CLIP_HIGH", "float", 0.28, "preset", "PPO clip above: ratio <= 1 + this (DAPO's clip-higher)"),
    _k("PRESET_RL_KL_COEF", "float", 0, "preset", "weight of the k3 KL to the frozen initial policy (0: no reference model)"),
    _k("PRESET_RL_TIS_CAP", "float", 0, "preset",
       "truncated importance sampling: weight tokens by min(p_train/p_rollout, cap) (0: off)"),
    _k("PRESET_RL_STD_NORMALIZE", "bool", 1, "preset", "divide group advantages by the group's reward std"),
    _k("PRESET_RL_SYNC", "enum", "auto", "preset",
       "weight sync to the rollout engine: in-process copy, a broadcast group, or a checkpoint on disk "
       "(auto: inproc for the embedded engine, broadcast for SGLang servers)", ("auto", "inproc", "broadcast", "disk")),
    _k("PRESET_RL_SYNC_FORMAT", "enum", "full", "preset",
       "full: tensors in the trainer's dtype; fp8: the release format's FP8 tensors as e4m3 128x128 blocks with "
       "power-of-two scales", ("full", "fp8")),
    _k("PRESET_RL_SYNC_BUCKET_MB", "int", 1024, "preset", "weight-sync bucket size (a weight and its scale stay together)"),
    _k("PRESET_RL_REPLAY", "bool", 1, "preset", "routing replay: the trainer routes tokens to the experts the rollout chose"),
    _k("PRESET_RL_MINIBATCHES", "int", 1, "preset",
       "optimizer updates per rollout, each on its share of the samples (PPO ratio against the policy before the first)"),
    _k("PRESET_RL_DEAD_STEPS", "int", 5, "preset",
       "stop after this many steps in a row with no group whose rewards differ (nothing to learn from)"),
    _k("PRESET_RL_REWARD_RISE", "float", 0.3, "preset",
       "gate reward_rising: the mean reward of the last window must beat the first window's by this"),
    _k("PRESET_RL_GATE_WINDOW", "int", 5, "preset", "steps in each window of the reward_rising gate"),
    _k("PRESET_RL_LOGPROB_TOL", "float", 1e-4, "preset",
       "gate logprob_match: max |trainer - rollout| logprob of a response token"),
]

SCHEMA: dict[str, Key] = {k.name: k for k in KEYS}

# Filled in by the loader, never by a file: the project checkout the launcher runs from.
BUILTINS = ("V4_ROOT",)

# Ports on the head node that must differ from one another (0 = unused).
PORT_KEYS = ("V4_RAY_PORT", "V4_DASHBOARD_PORT", "V4_RAY_CLIENT_PORT", "V4_DIST_PORT", "V4_PROMETHEUS_PORT",
             "V4_GRAFANA_PORT")
# With V4_ROLLOUT_ENGINE=sglang the rollout server's port joins them (checks.py): colocated, the server listens on
# the head next to Ray. With the embedded engine nothing listens on it, so it may share a number with anything.
ROLLOUT_PORT_KEY = "V4_ROLLOUT_PORT"
# Ports always in use, so 0 is no choice: 1-65535. sshd listens on the head too, so V4_SSH_PORT must also
# differ from the PORT_KEYS; the external Redis runs on its own host (V4_REDIS_HOST) and may share a number.
ALWAYS_PORT_KEYS = ("V4_SSH_PORT", "V4_REDIS_PORT")


def secret_name(name: str) -> bool:
    """Whether a key's value must never be shown: a declared key by its schema entry, any other name
    (a misspelt or unknown key may still hold a password) by its suffix."""
    key = SCHEMA.get(name)
    return key.secret if key else bool(SECRET_RE.search(name))
