"""From a resolved config to a Plan: ordered steps with the exact commands, environment and nodes.

The plan is pure data rendered from templates; `v4 run --dry-run` prints it and touches nothing.
`v4 run` executes the same Plan, so what was shown is what runs.
"""
from __future__ import annotations

import fnmatch
import json
import shlex
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path

import jinja2

from launcher.cluster import auth_env, dashboard_url, site_env
from launcher.config import Config
from launcher.nodes import python_on_nodes

TEMPLATES = jinja2.Environment(
    loader=jinja2.FileSystemLoader(Path(__file__).parent / "templates"),
    undefined=jinja2.StrictUndefined, keep_trailing_newline=True, trim_blocks=True, lstrip_blocks=True)
TEMPLATES.filters["shq"] = lambda s: shlex.quote(str(s))
# values that refer to the node's own environment (PATH=/venv/bin:${PATH}) stay expandable
TEMPLATES.filters["envq"] = lambda s: f'"{s}"' if "${" in str(s) else shlex.quote(str(s))


@dataclass(frozen=True)
class StepDef:
    module: str
    doc: str
    inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()


# The pipeline's steps: one entry each, in no particular order (PRESET_STEPS orders them).
# Inputs/outputs name config keys (resolved to paths) or paths relative to the run directory.
PIPELINE: dict[str, StepDef] = {
    "weights": StepDef("jobs.obtain_weights", "generate a random checkpoint in the official release layout",
                       outputs=("CKPT_HF_DIR",)),
    "prepare_data": StepDef("jobs.prepare_data", "chat data -> normalized messages jsonl",
                            inputs=("PRESET_DATA",), outputs=("V4_SFT_DATA",)),
    "verify_template": StepDef("jobs.verify_template", "chat encoding and loss mask: print the table, fail on bad masks",
                               inputs=("V4_SFT_DATA", "CKPT_HF_DIR"), outputs=("steps/verify_template/summary.json",)),
    "dequantize": StepDef("jobs.dequantize", "FP8/MXFP4 official checkpoint -> BF16 HF shards",
                          inputs=("CKPT_HF_DIR",), outputs=("CKPT_BF16_DIR",)),
    "convert": StepDef("jobs.convert_ckpt", "BF16 HF -> Megatron distributed checkpoint",
                       inputs=("CKPT_BF16_DIR",), outputs=("CKPT_TORCH_DIST",)),
    "train": StepDef("jobs.train_sft", "SFT on megatron-core: metrics.jsonl, checkpoints, reload check",
                     inputs=("CKPT_TORCH_DIST", "V4_SFT_DATA"), outputs=("checkpoints/", "metrics.jsonl")),
    "evaluate": StepDef("jobs.evaluate", "held-out loss of the trained checkpoint",
                        inputs=("checkpoints/", "V4_SFT_DATA"), outputs=("steps/evaluate/eval.json",)),
}
RL_TRAIN = StepDef("jobs.train_rl", "GRPO with the embedded rollout engine",
                   inputs=("CKPT_TORCH_DIST",), outputs=("checkpoints/", "metrics.jsonl"))
# The same step when the rollouts come from SGLang servers (V4_ROLLOUT_ENGINE=sglang): they load the BF16 checkpoint.
RL_TRAIN_SGLANG = StepDef("jobs.train_rl", "GRPO against the SGLang rollout servers (ROLLOUT_URLS)",
                          inputs=("CKPT_TORCH_DIST", "CKPT_BF16_DIR"),
                          outputs=("checkpoints/", "metrics.jsonl"))

GATES = {
    "finite_loss": "every step's loss and grad norm are finite",
    "loss_decreasing": "the last step's loss is below the first step's",
    "reload_equal": "save -> reload -> the next step's loss is identical",
    "peak_memory": "peak memory per GPU under HW_PEAK_MEM_BUDGET_GB",
    "step_time": "steady-state step time under HW_STEP_TIME_BUDGET_S",
    "reward_rising": "RL: the last window's mean reward beats the first window's by PRESET_RL_REWARD_RISE",
    "logprob_match": "RL: trainer and rollout logprobs of every response token within PRESET_RL_LOGPROB_TOL",
    "baseline": "every step's metrics follow PRESET_BASELINE_RUN's within PRESET_BASELINE_TOL",
    "weights_synced": "RL: after every sync the engine's weights read back equal to the trainer's",
}

# Ray uploads the checkout as each job's working_dir; these never travel (nor, by working_dir_excludes, what git ignores).
WORKING_DIR_EXCLUDES = [".git", ".venv", ".dev", "outputs", "**/__pycache__", "*.egg-info", ".pytest_cache"]


def working_dir_excludes(root: Path) -> list[str]:
    """WORKING_DIR_EXCLUDES plus every path git ignores under `root`, anchored ("/bundles/"). Ray reads .gitignore
    files itself, but not .git/info/exclude or the user's core.excludesFile, so what a developer keeps out of git
    only there (local bundles, data) would travel with every job. Outside a git checkout, or without git: the list."""
    try:
        r = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--others", "--ignored", "--exclude-standard",
                            "--directory"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return list(WORKING_DIR_EXCLUDES)
    if r.returncode != 0:
        return list(WORKING_DIR_EXCLUDES)
    names = [pat.removeprefix("**/") for pat in WORKING_DIR_EXCLUDES]

    def covered(path: str) -> bool:      # already skipped by a pattern of the list (they match at any depth)
        return any(fnmatch.fnmatch(part, n) for part in path.strip("/").split("/") for n in names)

    return WORKING_DIR_EXCLUDES + sorted("/" + path for path in r.stdout.split("\0") if path and not covered(path))


@dataclass
class JobSpec:
    submission_id: str
    entrypoint: str
    runtime_env: dict
    entrypoint_num_cpus: float
    entrypoint_num_gpus: float
    timeout_s: float
    submit: str                      # the equivalent `ray job submit` command line
    # the driver's place: {"node:<head ip>": 0.001} pins it to the head (docs/resilience.md); {} lets Ray choose
    entrypoint_resources: dict = field(default_factory=dict)


@dataclass
class Step:
    name: str
    kind: str                        # preflight | cluster | rollout | job | gates
    doc: str
    nodes: dict[str, list[str]] = field(default_factory=dict)   # node -> commands run there
    job: JobSpec | None = None
    inputs: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    items: list[str] = field(default_factory=list)              # check or gate names
    module: str = ""                                            # a job step's program (jobs.<name>)
    available: bool = True                                      # its program exists in this checkout


@dataclass
class Plan:
    run_id: str
    run_dir: str
    selection: dict
    dashboard: str
    executor: str
    steps: list[Step]
    from_shell: dict = field(default_factory=dict)   # schema keys set by the process environment
    prediction: dict = field(default_factory=dict)   # the cost model's memory and step time (launcher/costmodel.py)

    def to_json(self) -> dict:
        return asdict(self)

    def render(self) -> str:
        return TEMPLATES.get_template("plan.txt.j2").render(plan=self)

    def unavailable(self) -> list[str]:
        """`name (module)` of each job step whose program does not exist yet (RL training, for one)."""
        return [f"{s.name} ({s.module})" for s in self.steps if s.kind == "job" and not s.available]


def program_exists(root: Path | str, module: str) -> bool:
    """Whether `module` is in the checkout that becomes every job's working_dir. A file test, not an import:
    planning must not import the jobs (nor torch through them)."""
    base = Path(root, *module.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def job_env(cfg: Config, run_dir: str) -> dict[str, str]:
    """Environment every job step gets (the runtime_env's env_vars)."""
    env = {
        "V4_RUN_DIR": run_dir,
        "PYTHONUNBUFFERED": "1",
        "MASTER_ADDR": cfg["V4_MASTER_IP"],
        "MASTER_PORT": str(cfg["V4_DIST_PORT"]),
        "HF_HOME": cfg["V4_HF_HOME"],
        # every rank compiles into and loads from this (dsv4/procenv.py: a subdirectory per GPU model and wheels)
        "V4_COMPILE_CACHE": cfg["V4_COMPILE_CACHE"],
    }
    python = python_on_nodes(cfg)
    if python.startswith("/"):
        # `python` inside a job must be the project's interpreter, not the system one.
        env["PATH"] = f"{Path(python).parent}:${{PATH}}"
    if cfg["V4_SOCKET_IFNAME"] != "auto":
        env["GLOO_SOCKET_IFNAME"] = env["NCCL_SOCKET_IFNAME"] = cfg["V4_SOCKET_IFNAME"]
    if cfg["HW_DEVICE"] == "cuda":
        env["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
        env["NCCL_NVLS_ENABLE"] = str(int(cfg["HW_NCCL_NVLS_ENABLE"]))
        if cfg["HW_PYTORCH_CUDA_ALLOC_CONF"]:
            env["PYTORCH_CUDA_ALLOC_CONF"] = cfg["HW_PYTORCH_CUDA_ALLOC_CONF"]
    if cfg["V4_NCCL_IB_DISABLE"]:
        env["NCCL_IB_DISABLE"] = "1"
    if cfg["PRESET_PLANT_NAN"]:
        env["V4_PLANT_NAN"] = cfg["PRESET_PLANT_NAN"]
    env.update(site_env(cfg))
    return env


def step_def(cfg: Config, name: str) -> StepDef:
    if name == "train" and cfg["PRESET_MODE"] == "rl":
        from launcher import rollout
        return RL_TRAIN_SGLANG if rollout.enabled(cfg) else RL_TRAIN
    return PIPELINE[name]


# What marks an input complete when a person (not this run) put it there.
INPUT_SENTINELS = {"CKPT_HF_DIR": "model.safetensors.index.json", "CKPT_BF16_DIR": "model.safetensors.index.json",
                   "CKPT_TORCH_DIST": ".v4-done.json"}


def required_inputs(cfg: Config) -> list:
    """Inputs no step of this run produces: they must exist before it starts (preflight `inputs`)."""
    from launcher.preflight import RequiredInput

    produced: set[str] = set()
    out, seen = [], set()
    for name in cfg["PRESET_STEPS"]:
        d = step_def(cfg, name) if name in PIPELINE else None
        if d is None:
            continue
        for key in d.inputs:
            if key in cfg and key not in produced and key not in seen:
                seen.add(key)
                out.append(RequiredInput(
                    str(cfg[key]), f"{name} reads {key}", INPUT_SENTINELS.get(key, ""),
                    f"provide {key}={cfg[key]} (or add the step that makes it to PRESET_STEPS)"))
        produced |= set(d.outputs)
    return out


def job_step(cfg: Config, name: str, run_id: str, run_dir: str, excludes: list[str]) -> Step:
    d = step_def(cfg, name)
    entrypoint = f"{shlex.quote(python_on_nodes(cfg))} -m {d.module} --run-dir {shlex.quote(run_dir)}"
    runtime_env = {"working_dir": str(cfg.selection.root),
                   "excludes": excludes, "env_vars": job_env(cfg, run_dir)}
    # The driver is light: training ranks are Ray actors that reserve the GPUs themselves. It holds its CPU while
    # they wait for theirs, which the ranks' placement check counts (dsv4/megatron/launch.py).
    runtime_env["env_vars"]["V4_JOB_DRIVER_CPUS"] = "1"
    job = JobSpec(
        submission_id=f"{run_id}-{name}",
        entrypoint=entrypoint,
        runtime_env=runtime_env,
        entrypoint_num_cpus=1,
        entrypoint_num_gpus=0,
        timeout_s=cfg["PRESET_JOB_TIMEOUT"],
        submit="",
        # on the head, the one node a run cannot lose (its GCS and dashboard): a lost worker takes ranks, never the
        # driver that reports them, nor its log
        entrypoint_resources={f"node:{cfg['V4_MASTER_IP']}": 0.001},
    )
    if cfg["V4_EXECUTOR"] == "local":
        job.submit = TEMPLATES.get_template("job_local.sh.j2").render(job=job)
    else:
        job.submit = TEMPLATES.get_template("job_submit.sh.j2").render(
            address=dashboard_url(cfg), job=job, runtime_env_json=json.dumps(runtime_env),
            auth_env=auth_env(cfg, cfg.nodes[0]))   # the head's token file: the client runs there
    resolve_io = lambda keys: [cfg[k] if k in cfg else f"{run_dir}/{k}" for k in keys]
    return Step(name, "job", d.doc, job=job, inputs=resolve_io(d.inputs), outputs=resolve_io(d.outputs),
                module=d.module, available=program_exists(cfg.selection.root, d.module))


def build(cfg: Config, run_id: str | None = None) -> Plan:
    """The plan of a new run, or (`run_id`, already resolved by registry.resolve_resume) of the run to resume."""
    from launcher import rollout
    from launcher.registry import RUN_ID_RE, new_run_id

    run_id = run_id or new_run_id(cfg["PRESET_RUN_ID_PREFIX"])
    if not RUN_ID_RE.match(run_id):
        # it names the run directory and every job id, and lands in shell commands: never a raw --resume string
        from launcher.errors import ConfigError
        raise ConfigError(f"run id {run_id!r} is not PREFIX-YYYYmmdd-HHMMSS-xxxx",
                          fix="`v4 runs ls` lists the runs; --resume takes one's id, a unique prefix, or `latest`")
    run_dir = f"{cfg['V4_OUT']}/{run_id}"
    steps = [preflight_step(cfg)]
    excludes = working_dir_excludes(cfg.selection.root)      # one git call a plan, shared by its jobs
    if cfg["V4_EXECUTOR"] == "ray":
        steps.append(cluster_step(cfg))
    for name in cfg["PRESET_STEPS"]:
        if name not in PIPELINE:
            from launcher.errors import ConfigError
            raise ConfigError(f"{cfg.origin('PRESET_STEPS').where}: unknown pipeline step {name!r}",
                              fix=f"steps: {', '.join(PIPELINE)}")
        if name == "train" and rollout.enabled(cfg):
            # the servers load the checkpoint the steps before write, and serve only the train step
            steps.append(rollout_step(cfg, "up"))
            steps.append(job_step(cfg, name, run_id, run_dir, excludes))
            steps.append(rollout_step(cfg, "down"))
        else:
            steps.append(job_step(cfg, name, run_id, run_dir, excludes))
    unknown = [g for g in cfg["PRESET_GATES"] if g not in GATES]
    if unknown:
        from launcher.errors import ConfigError
        raise ConfigError(f"{cfg.origin('PRESET_GATES').where}: unknown gate(s) {', '.join(unknown)}",
                          fix=f"gates: {', '.join(GATES)}")
    steps.append(Step("gates", "gates", "assertions over the train step's metrics",
                      items=[f"{g}: {GATES[g]}" for g in cfg["PRESET_GATES"]]))
    sel = cfg.selection
    return Plan(run_id, run_dir, {"cluster": sel.cluster, "hw": sel.hw, "preset": sel.preset},
                dashboard_url(cfg), cfg["V4_EXECUTOR"], steps, cfg.from_shell(), prediction(cfg))


def prediction(cfg: Config) -> dict:
    """What `config validate` derived from the cost model for this layout (empty where it could not place it)."""
    if "PREDICTED_PEAK_GB" not in cfg.derived:
        return {}
    keys = ("STATE_GB_PER_GPU", "PREDICTED_PEAK_GB", "PREDICTED_STEP_S", "PREDICTED_TOKENS_PER_S_GPU")
    out = {k.lower(): cfg.derived[k].value for k in keys if k in cfg.derived}
    if "PREDICTED_STEP_S" in cfg.derived:
        out["step_parts"] = cfg.derived["PREDICTED_STEP_S"].formula.split("(", 1)[-1][:-1]
    return out


def preflight_step(cfg: Config) -> Step:
    try:
        from launcher.preflight import check_names
        names = check_names(cfg)
    except ImportError:
        names = []
    return Step("preflight", "preflight", f"checks on {len(cfg.nodes)} node(s), in parallel; any FAIL stops the run",
                items=names)


def cluster_step(cfg: Config) -> Step:
    from launcher.cluster import cluster_commands
    nodes = {f"{nc.ip} ({nc.role})": nc.display() for nc in cluster_commands(cfg)}
    return Step("cluster-up", "cluster",
                f"Ray head on {cfg['V4_MASTER_IP']}, then {len(cfg.nodes) - 1} worker(s); ready when the GCS "
                f"reports all {len(cfg.nodes)} nodes (deadline {cfg['V4_RAY_READY_TIMEOUT']:.0f} s); "
                "skipped when the cluster is already healthy", nodes=nodes)


def rollout_step(cfg: Config, which: str) -> Step:
    """`rollout-up` (start an SGLang server on every rollout node, wait on /health_generate) or `rollout-down` (stop
    exactly the servers v4 recorded there); the pipeline runs them around the RL train step."""
    from launcher import rollout
    nodes = rollout.rollout_nodes(cfg)
    box = f" in container {cfg['V4_CONTAINER']}" if cfg["V4_CONTAINER"] else ""
    if which == "up":
        doc = (f"SGLang {cfg['V4_SGLANG_VERSION']} on {len(nodes)} node(s){box}, port {cfg['V4_ROLLOUT_PORT']}; "
               f"ready when every GET /health_generate answers 200 (deadline {cfg['V4_ROLLOUT_HEALTH_TIMEOUT']:.0f} s); a server "
               "v4 started with the same command line is kept")
        return Step("rollout-up", "rollout", doc, nodes=rollout.plan_nodes(cfg, "start"))
    return Step("rollout-down", "rollout", "stop the SGLang servers v4 started (recorded PIDs; nothing else); "
                "also when the run fails", nodes=rollout.plan_nodes(cfg, "stop"))
