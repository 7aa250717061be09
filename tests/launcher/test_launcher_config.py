"""Config engine: every bad input gets a clear message and exit code 2; provenance is exact."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.cli import main
from launcher.config import Selection, load, resolve
from launcher.config.checks import InvalidConfig, pipeline_split
from launcher.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def v4(capsys, *args) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as e:
        main(list(args))
    out, err = capsys.readouterr()
    return e.value.code, out, err


def env_file(tmp_path, text: str, name="extra.env") -> str:
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def test_every_shipped_combination_resolves():
    for cluster, hw, preset in [("local", "cpu", "smoke"), ("h20_8node", "h200", "smoke"),
                                ("h20_8node", "auto", "dryrun"),
                                ("h20_8node", "auto", "validation"), ("h20_8node", "auto", "full"),
                                ("local", "cpu", "rl_smoke"), ("h200_template", "auto", "full")]:
        resolve(Selection(cluster=cluster, hw=hw, preset=preset))


def test_flash_layouts_split_43_layers():
    cfg = resolve(Selection(cluster="h20_8node", preset="dryrun"))
    assert cfg["PP_STAGE_LAYERS"] == [4, 6, 6, 6, 6, 6, 6, 3]
    assert pipeline_split(43, 4, 11, 10, "") == [11, 11, 11, 10]        # cp_smoke's split


@pytest.mark.parametrize("cluster,hw,preset,world,tokens", [
    ("h20_8node", "auto", "cp_smoke", 64, 4096),            # flash, TP8 PP4 CP2 EP16
    ("h200_template", "auto", "long_context", 128, 32768),  # flash, TP8 PP2 CP8 EP64
    ("local", "cpu", "cp_smoke", 2, 128),                   # the tiny model as two gloo CP ranks
])
def test_context_parallel_presets_validate_where_they_fit(cluster, hw, preset, world, tokens):
    cfg = resolve(Selection(cluster=cluster, hw=hw, preset=preset))
    assert cfg["PRESET_CP"] > 1 and cfg["WORLD_SIZE"] == world and cfg["TOKENS_PER_GPU"] == tokens
    assert cfg["WORLD_SIZE"] % (cfg["PRESET_TP"] * cfg["PRESET_PP"] * cfg["PRESET_CP"]) == 0


@pytest.mark.parametrize("sets,message", [
    ({"PRESET_SEQ_LEN": "250"}, "not a multiple of 2\\*CP = 4"),
    ({"PRESET_MODE": "rl"}, "RL scores log-probabilities"),
    ({"HW_CP_SMOKE_EP": "4"}, "does not divide DP\\*CP\\*TP = 1\\*2\\*1"),
])
def test_context_parallel_constraints_are_checked(sets, message):
    with pytest.raises(InvalidConfig, match=message):
        resolve(Selection(cluster="local", hw="cpu", preset="cp_smoke", sets=tuple(f"{k}={v}" for k, v in sets.items())))


def test_explain_names_file_line_and_what_was_overridden(capsys):
    code, out, _ = v4(capsys, "config", "show", "--cluster", "h20_8node", "--preset", "smoke", "--json")
    assert code == 0
    prov = json.loads(out)["provenance"]
    # hw/h20.env sets 4096, the smoke preset's PRESET_SEQ_LEN refers to it
    line = next(n for n, l in enumerate((ROOT / "hw/h20.env").read_text().splitlines(), 1)
                if l.startswith("HW_MAX_TOKENS_PER_GPU="))
    assert prov["HW_MAX_TOKENS_PER_GPU"]["from"] == f"hw/h20.env:{line}"
    assert prov["HW_MAX_TOKENS_PER_GPU"]["overrode"] == {"value": "4096", "from": "default"}
    assert prov["PRESET_LR"]["from"].startswith("presets/smoke.env:")
    # ... and says what it was written as, so the reader knows to look at HW_SMOKE_SEQ_LEN's own row
    assert prov["PRESET_SEQ_LEN"]["written"] == "${HW_SMOKE_SEQ_LEN}" and prov["PRESET_TP"]["written"] is None
    assert prov["PRESET_LR"]["overrode"]["from"] == "default"
    code, out, _ = v4(capsys, "config", "show", "--preset", "smoke", "--hw", "cpu", "--explain",
                      "--set", "PRESET_LR=3e-4")
    line = next(l for l in out.splitlines() if l.startswith("PRESET_LR "))
    assert "cli --set PRESET_LR" in line and "'1e-3 = ${HW_SMOKE_LR}' (presets/smoke.env:" in line
    line = next(l for l in out.splitlines() if l.startswith("PRESET_SEQ_LEN "))
    assert "presets/smoke.env:" in line and " = ${HW_SMOKE_SEQ_LEN}" in line


def test_set_moves_interpolated_paths():
    cfg = resolve(Selection(preset="smoke", hw="cpu", sets=("V4_WORK=/srv/x",)))
    assert cfg["V4_OUT"] == "/srv/x/runs" and cfg["V4_SFT_DATA"] == "/srv/x/data/sft.jsonl"


def test_self_reference_appends_to_the_overridden_value(tmp_path):
    f = env_file(tmp_path, 'PRESET_MODEL_OVERRIDES="${PRESET_MODEL_OVERRIDES} n_layers=2"\n')
    cfg = resolve(Selection(preset="smoke", hw="cpu", env_files=(f,),
                            sets=("PRESET_MODEL_OVERRIDES=${PRESET_MODEL_OVERRIDES} seed=3",)))
    assert cfg["PRESET_MODEL_OVERRIDES"] == ["n_layers=2", "seed=3"]


def test_secrets_are_redacted(capsys):
    code, out, _ = v4(capsys, "config", "show", "--cluster", "h200_template", "--json",
                      "--set", "V4_REDIS_PASSWORD=hunter2")
    assert code == 0 and "hunter2" not in out
    assert json.loads(out)["values"]["V4_REDIS_PASSWORD"] == "***"


@pytest.mark.parametrize("text, needles", [
    ("PRESET_LRR=1e-4\n", ["extra.env:1", "unknown key PRESET_LRR", "did you mean PRESET_LR"]),
    ("PRESET_TP=eight\n", ["extra.env:1", "PRESET_TP='eight'", "expected an integer"]),
    ("\nthis is not an assignment\n", ["extra.env:2", "malformed line"]),
    ("PRESET_LR=1e-4 # fine\nV4_WORKER_IPS=a b\n", ["extra.env:2", "unquoted value with spaces"]),
    ("V4_TZ=$(date)\n", ["extra.env:1", "command substitution"]),
    ("V4_DOCKER_MOUNTS=(a b)\n", ["extra.env:1", "arrays are not supported"]),
    ('V4_MODELS="${V4_DATA}/m"\nV4_DATA="${V4_MODELS}/d"\n', ["interpolation cycle", "V4_MODELS (", "extra.env:1"]),
    ("PRESET_PP_FIRST_LAYERS=5\nPRESET_PP_LAST_LAYERS=3\n", ["pipeline split", "first 5 + last 3 leave 35 layers",
                                                             "PRESET_PP_FIRST_LAYERS=5 (", "extra.env:1"]),
    ("PRESET_PP=3\n", ["TP*PP*CP = 24 does not divide the world size 64", "PRESET_PP=3 (", "extra.env:1"]),
    ("HW_DEVICE=gpu\n", ["HW_DEVICE='gpu'", "one of 'cpu', 'cuda'"]),
    ("V4_RAY_PORT=8201\n", ["V4_RAY_PORT=8201 (", "collides with", "V4_DASHBOARD_PORT=8201 (envs/cluster/h20_8node.env:"]),
    ("V4_WORK=relative/dir\n", ["must be an absolute path", "V4_WORK=relative/dir"]),
    ("PRESET_EP=3\n", ["PRESET_EP=3", "does not divide the model's 256 routed experts"]),
])
def test_bad_input_exits_2_with_file_line(capsys, tmp_path, text, needles):
    f = env_file(tmp_path, text)
    code, out, err = v4(capsys, "config", "validate", "--cluster", "h20_8node", "--preset", "dryrun", "--env-file", f)
    assert code == 2, err
    for n in needles:
        assert n in err, f"{n!r} not in:\n{err}"


@pytest.mark.parametrize("flag, name, listed", [
    ("--preset", "smok", ["unknown preset 'smok'", "did you mean 'smoke'", "cp_smoke", "dryrun"]),
    ("--hw", "a100", ["unknown hw 'a100'", "cpu, h100, h20, h200"]),
    ("--cluster", "h20", ["unknown cluster 'h20'", "h20_8node", "local"]),
])
def test_unknown_selector_lists_what_exists(capsys, flag, name, listed):
    args = ["config", "show", flag, name] + ([] if flag == "--preset" else ["--preset", "smoke"])
    code, _, err = v4(capsys, *args)
    assert code == 2
    for n in listed:
        assert n in err


def test_missing_preset_is_a_usage_error(capsys):
    code, _, err = v4(capsys, "run", "--dry-run")
    assert code == 2 and "--preset" in err


def test_all_errors_reported_together(tmp_path):
    f = env_file(tmp_path, "PRESET_PP=3\nV4_RAY_PORT=8201\n")
    with pytest.raises(ConfigError) as e:
        resolve(Selection(cluster="h20_8node", preset="dryrun", env_files=(f,)))
    assert "does not divide" in e.value.message and "collides" in e.value.message


def test_process_environment_applies_to_schema_keys_only():
    cfg = load(Selection(preset="smoke", hw="cpu", environ={"PRESET_LR": "2e-4", "HOME": "/x", "PRESET_LRX": "1"}))
    assert cfg["PRESET_LR"] == 2e-4 and cfg.origin("PRESET_LR").where == "env $PRESET_LR"


def test_layer_files_are_valid_bash():
    files = sorted(ROOT.glob("envs/**/*.env")) + sorted(ROOT.glob("hw/*.env")) + sorted(ROOT.glob("presets/*.env"))
    for f in files:
        r = subprocess.run(["bash", "-n", str(f)], capture_output=True, text=True)
        assert r.returncode == 0, f"{f}: {r.stderr}"


def test_pipeline_layouts():
    assert pipeline_split(43, 8, 4, 3, "") == [4, 6, 6, 6, 6, 6, 6, 3]
    assert pipeline_split(43, 8, 0, 0, "Ett|(ttt|)*11,(tt|)*3,ttL") == [2] + [3] * 11 + [2] * 3 + [2]
    assert pipeline_split(4, 2, 0, 0, "") == [2, 2]
    with pytest.raises(ValueError, match="layout places 42 layers"):
        pipeline_split(43, 8, 0, 0, "Ett|(ttt|)*11,(tt|)*3,tL")
    with pytest.raises(ValueError, match="do not split evenly"):
        pipeline_split(43, 2, 0, 0, "")


def test_config_show_imports_neither_torch_nor_ray():
    code = ("import sys\nfrom launcher.cli import main\n"
            "try:\n    main(['config', 'show', '--preset', 'smoke', '--cluster', 'h20_8node'])\n"
            "except SystemExit:\n    pass\n"
            "print('HEAVY', sorted(m for m in ('torch', 'ray', 'paramiko', 'dsv4.model') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert "HEAVY []" in r.stdout, r.stdout[-500:] + r.stderr[-2000:]


def test_memory_estimate_refuses_what_cannot_fit():
    """The 4-layer model with all 256 experts on one H200: ~570 GB of state, an error naming the keys to change.
    The H200 layer's own smoke (8 routed experts) fits, and so does a cluster's smoke with EP over its GPUs."""
    with pytest.raises(InvalidConfig, match=r"exceed HW_GPU_MEMORY_GB=141.0 .*n_routed_experts=8"):
        resolve(Selection(preset="smoke", hw="h200", sets=("PRESET_MODEL_OVERRIDES=",)))
    small = resolve(Selection(preset="smoke", hw="h200"))
    assert 0 < small["STATE_GB_PER_GPU"] < 141 and not small.warnings
    assert small["CKPT_PEAK_COUNT"] == 1 and small["CKPT_PEAK_GB"] < 64   # one checkpoint: fits the H200 host
    assert not resolve(Selection(cluster="h20_8node", hw="h200", preset="smoke")).warnings


# --- secrets never printed: not in parse errors, not when pulled into another key ---------------------

@pytest.mark.parametrize("text", [
    "V4_REDIS_PASSWORD=hu$nter2\n",                 # bare `$`
    "V4_REDIS_PASSWORD=hu nter2\n",                 # unquoted space
    "V4_REDIS_PASSWORD=hu;nter2\n",                 # shell metacharacter
    "V4_REDIS_PASSWORD hunter2\n",                  # malformed line
    'V4_REDIS_PASSWORD="x"hunter2\n',               # text after the closing quote
    "V4_REDIS_PASSWORD='x'hunter2\n",
    'V4_REDIS_PASSWORD="hu$nter2"\n',
])
def test_parse_errors_never_show_a_secret(capsys, tmp_path, text):
    f = env_file(tmp_path, "# leading comment\n" + text)
    code, out, err = v4(capsys, "config", "show", "--env-file", f)
    assert code == 2 and "extra.env:2" in err, err
    assert "nter2" not in out + err, err


def test_set_parse_error_never_shows_a_secret(capsys):
    code, out, err = v4(capsys, "config", "show", "--set", 'V4_REDIS_PASSWORD="x"hunter2')
    assert code == 2 and "cli --set V4_REDIS_PASSWORD" in err and "hunter2" not in out + err


def test_a_secret_pulled_in_by_reference_is_redacted(capsys, tmp_path):
    f = env_file(tmp_path, 'V4_REDIS_PASSWORD=hunter2\n'
                           'V4_HTTP_PROXY="http://u:${V4_REDIS_PASSWORD}@proxy:3128"\n'
                           'V4_TZ="${V4_HTTP_PROXY}"\n')           # transitively
    for args in (["--json"], ["--explain"], []):
        code, out, err = v4(capsys, "config", "show", "--env-file", f, *args)
        assert code == 0 and "hunter2" not in out + err, out
    code, out, err = v4(capsys, "config", "show", "--env-file", f, "--explain",
                        "--set", "V4_HTTP_PROXY=http://proxy:3128")     # the overridden value stays hidden
    line = next(l for l in out.splitlines() if l.startswith("V4_HTTP_PROXY "))
    assert "http://proxy:3128" in line and "hunter2" not in out
    cfg = load(Selection(env_files=(f,), environ={}))
    assert cfg.shown("V4_TZ") == "***" and cfg.is_secret("V4_HTTP_PROXY")
    assert cfg.job_values()["V4_HTTP_PROXY"] == "http://u:hunter2@proxy:3128"     # jobs get the real value
    assert cfg.redact_text("export http_proxy=http://u:hunter2@proxy:3128") == "export http_proxy=***"
    # an empty secret taints nothing
    assert not load(Selection(env_files=(env_file(tmp_path, 'V4_HTTP_PROXY="${V4_REDIS_PASSWORD}x"\n', "e.env"),),
                              environ={})).is_secret("V4_HTTP_PROXY")
    # nor does it show up in a type error of the key that took it in
    g = env_file(tmp_path, 'V4_REDIS_PASSWORD=hunter2\nV4_REDIS_PORT="${V4_REDIS_PASSWORD}"\n', "port.env")
    code, out, err = v4(capsys, "config", "show", "--env-file", g)
    assert code == 2 and "port.env:2" in err and "expected an integer" in err and "hunter2" not in err


# --- the file format matches bash ---------------------------------------------------------------------

def _bash_values(path: str, keys: list[str], env: dict[str, str]) -> dict[str, str]:
    script = f"set -e; source {path}; " + "; ".join(f'printf "%s\\0" "${k}"' for k in keys)
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env, check=True).stdout
    return dict(zip(keys, out.split("\0")))


def test_escapes_and_comments_resolve_as_bash_does(tmp_path):
    f = env_file(tmp_path, '\n'.join([
        'V4_TZ="\\${V4_WORK}"',                  # escaped: a literal ${V4_WORK}
        'V4_IMAGE=\\${V4_WORK}',                 # the same, unquoted
        'V4_CONTAINER_SHM_SIZE="\\\\${V4_WORK}"',  # an escaped backslash, then a real reference
        'V4_PYTHON="a\\b\\"c\\`d\\$e"',           # kept backslash, escaped quote, backtick, dollar
        'V4_HTTP_PROXY="UTC" # comment',
        'V4_REDIS_HOST=a#b',                     # `#` not after whitespace is part of the value
        'V4_RAY_NUM_CPUS=4\t# tab, then a comment',
    ]) + "\n")
    keys = ["V4_TZ", "V4_IMAGE", "V4_CONTAINER_SHM_SIZE", "V4_PYTHON", "V4_HTTP_PROXY", "V4_REDIS_HOST",
            "V4_RAY_NUM_CPUS"]
    cfg = load(Selection(env_files=(f,), sets=("V4_WORK=/w",), environ={}))
    assert {k: cfg[k] for k in keys} == _bash_values(f, keys, {"V4_WORK": "/w", "PATH": "/usr/bin:/bin"})
    assert cfg["V4_TZ"] == "${V4_WORK}" and cfg["V4_CONTAINER_SHM_SIZE"] == "\\/w"
    assert load(Selection(sets=("V4_TZ=\\${V4_WORK}",), environ={}))["V4_TZ"] == "${V4_WORK}"


def test_text_glued_to_a_closing_quote_is_refused(tmp_path):
    # bash reads "UTC"#comment as `UTC#comment`; silently dropping `#comment` would differ from it
    f = env_file(tmp_path, 'V4_TZ="UTC"#comment\n')
    with pytest.raises(ConfigError, match=r"extra.env:1: unexpected text after the closing quote"):
        load(Selection(env_files=(f,), environ={}))


def test_line_numbers_count_newlines_only(tmp_path):
    # a form feed (or \x1c, \u2028...) in a comment is no line break for bash
    f = env_file(tmp_path, "# page one\x0cpage two\n# \u2028 still one line\nPRESET_TP=eight\r\n")
    with pytest.raises(ConfigError, match=r"extra.env:3: PRESET_TP='eight'"):
        load(Selection(env_files=(f,), environ={}))


# --- values that cannot be right ----------------------------------------------------------------------

def test_empty_work_root_is_refused(capsys):
    with pytest.raises(ConfigError) as e:
        resolve(Selection(preset="smoke", hw="cpu", environ={"V4_WORK": ""}))
    assert "V4_WORK= (env $V4_WORK) is empty" in e.value.message and "absolute path" in e.value.message
    code, _, err = v4(capsys, "config", "validate", "--set", "V4_OUT=")
    assert code == 2 and "V4_OUT= (cli --set V4_OUT) is empty" in err


@pytest.mark.parametrize("override, needles", [
    ("o_groups=0", ["ZeroDivisionError"]),
    ("foo", ["'foo' is not key=value"]),
])
def test_bad_model_overrides_are_config_errors_at_their_origin(capsys, override, needles):
    code, _, err = v4(capsys, "config", "validate", "--preset", "smoke", "--hw", "cpu",
                      "--set", f"PRESET_MODEL_OVERRIDES={override}")
    assert code == 2, err
    for n in ["error: cli --set PRESET_MODEL_OVERRIDES:", *needles]:
        assert n in err, err


@pytest.mark.parametrize("setting, needle", [
    ("PRESET_LR=nan", "PRESET_LR='nan': expected a finite number"),
    ("HW_GPU_MEMORY_GB=inf", "expected a finite number"),
    ("V4_SSH_PORT=0", "V4_SSH_PORT=0 (cli --set V4_SSH_PORT) is not a valid port"),
    ("V4_SSH_PORT=70000", "is not a valid port"),
    ("V4_RAY_PORT=22", "V4_SSH_PORT=22 (default) collides with V4_RAY_PORT=22 (cli --set V4_RAY_PORT)"),
    ("V4_REDIS_PORT=-1", "V4_REDIS_PORT=-1 (cli --set V4_REDIS_PORT) is not a valid port"),
    ("PRESET_NUM_STEPS=0", "PRESET_NUM_STEPS=0 (cli --set PRESET_NUM_STEPS) must be >= 1"),
    ("PRESET_SEQ_LEN=-4", "PRESET_SEQ_LEN=-4 (cli --set PRESET_SEQ_LEN) must be >= 1"),
    ("PRESET_PP_FIRST_LAYERS=-1", "must be >= 0"),
    ("V4_SSH_CONNECT_TIMEOUT=0", "must be > 0 seconds"),
])
def test_out_of_range_values_exit_2(capsys, setting, needle):
    code, _, err = v4(capsys, "config", "validate", "--preset", "smoke", "--hw", "cpu", "--set", setting)
    assert code == 2 and needle in err, err


def test_pipeline_split_never_gives_a_stage_negative_layers(capsys):
    with pytest.raises(ValueError, match="leave -1 for the other 1 stage"):
        pipeline_split(4, 2, 0, 5, "")
    with pytest.raises(ValueError, match="leave 0 for the other 2 stage"):
        pipeline_split(4, 3, 4, 0, "")
    code, _, err = v4(capsys, "config", "validate", "--preset", "smoke", "--hw", "cpu",
                      "--set", "V4_NUM_GPUS_PER_NODE=2", "--set", "PRESET_PP=2", "--set", "PRESET_EP=1",
                      "--set", "PRESET_PP_LAST_LAYERS=5")
    assert code == 2 and "pipeline split" in err and "PRESET_PP_LAST_LAYERS=5 (cli --set" in err


def test_validate_json_reports_failure_on_stdout(capsys):
    code, out, err = v4(capsys, "config", "validate", "--json", "--preset", "smoke", "--hw", "cpu",
                        "--set", "PRESET_TP=0", "--set", "PRESET_PP=0")
    assert code == 2
    report = json.loads(out)
    assert report["ok"] is False and len(report["errors"]) == 2 and "PRESET_TP=0" in report["errors"][0]
    assert "PRESET_TP=0" in err                         # the human-readable error still goes to stderr
    code, out, _ = v4(capsys, "config", "validate", "--json", "--preset", "smoke", "--set", "PRESET_LR=nan")
    assert code == 2 and "expected a finite number" in json.loads(out)["errors"][0]
    code, out, _ = v4(capsys, "config", "validate", "--json", "--preset", "smoke", "--hw", "cpu")
    assert code == 0 and json.loads(out)["ok"] is True


@pytest.mark.parametrize("setting, needle", [
    ("V4_CLUSTER_NAME=x$(touch /tmp/PWNED)",
     "V4_CLUSTER_NAME=x$(touch /tmp/PWNED) (cli --set V4_CLUSTER_NAME) is not valid"),
    ("V4_CLUSTER_NAME=", "V4_CLUSTER_NAME= (cli --set V4_CLUSTER_NAME) is empty"),
    ("V4_MASTER_IP=10.0.0.1;reboot", "V4_MASTER_IP=10.0.0.1;reboot (cli --set V4_MASTER_IP) is not an address"),
    ("V4_MASTER_IP=", "V4_MASTER_IP= (cli --set V4_MASTER_IP) is not an address"),
    ("V4_CONTAINER=c`id`", "V4_CONTAINER=c`id` (cli --set V4_CONTAINER) is not valid: it must be a docker container"),
    ("V4_IMAGE=img $(id)", "V4_IMAGE=img $(id) (cli --set V4_IMAGE) is not valid"),
])
def test_names_pasted_into_scripts_are_validated(capsys, setting, needle):
    code, _, err = v4(capsys, "config", "validate", "--set", setting)
    assert code == 2 and needle in err, err


def test_worker_addresses_are_validated(tmp_path):
    ports = "V4_RAY_PORT=6379\nV4_DASHBOARD_PORT=8265\nV4_RAY_CLIENT_PORT=10001\n"   # SSH: no `auto` (local.env's)
    f = env_file(tmp_path, 'V4_TRANSPORT=ssh\nV4_NUM_NODES=4\nV4_MASTER_IP=10.0.0.1\n'
                           'V4_WORKER_IPS="10.0.0.2 fd00::3 node-4.example.com"\n' + ports)
    resolve(Selection(env_files=(f,), environ={}))
    f = env_file(tmp_path, 'V4_TRANSPORT=ssh\nV4_NUM_NODES=3\nV4_MASTER_IP=10.0.0.1\nV4_WORKER_IPS="10.0.0.2 n3;id"\n'
                 + ports)
    with pytest.raises(ConfigError, match=r"V4_WORKER_IPS entry 'n3;id' \(.*extra.env:4\) is not an address"):
        resolve(Selection(env_files=(f,), environ={}))


def test_a_cluster_name_given_as_a_file_name_gets_the_right_spelling(capsys):
    code, _, err = v4(capsys, "config", "show", "--cluster", "local.env", "--preset", "smoke")
    assert code == 2 and "cluster file local.env does not exist" in err and "--cluster local names" in err


def test_the_redis_host_must_be_a_host(capsys):
    code, _, err = v4(capsys, "config", "validate", "--preset", "smoke", "--set", "V4_REDIS_HOST=x;reboot")
    assert code == 2 and "V4_REDIS_HOST" in err and "not an address or host name" in err
    code, _, _ = v4(capsys, "config", "validate", "--preset", "smoke", "--set", "V4_REDIS_HOST=10.0.0.9")
    assert code == 0


def test_a_hw_file_overriding_the_clusters_hw_setting_is_warned(tmp_path):
    f = tmp_path / "shared.env"
    f.write_text("V4_CLUSTER_NAME=shared\nHW_NCCL_NVLS_ENABLE=0\n")
    cfg = resolve(Selection(cluster=str(f), preset="smoke", hw="h20"))
    assert cfg["HW_NCCL_NVLS_ENABLE"] is True                      # the documented order: hw after cluster ...
    assert any("overrides HW_NCCL_NVLS_ENABLE='0' from " in w and "--env-file or --set" in w for w in cfg.warnings)
    quiet = resolve(Selection(cluster=str(f), preset="smoke", hw="h20", sets=("HW_NCCL_NVLS_ENABLE=0",)))
    assert not quiet["HW_NCCL_NVLS_ENABLE"] and not any("overrides" in w for w in quiet.warnings)


@pytest.mark.parametrize("driver_name, hw", [
    ("NVIDIA H200", "h200"), ("NVIDIA H20", "h20"), ("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA A100-SXM4-80GB", None),
])
def test_the_hw_layer_of_a_gpu_is_the_longest_name_it_contains(driver_name, hw):
    """--hw auto: "H200" contains "H20", so the longest HW_GPU_NAME the driver's name contains wins."""
    from launcher.config.resolve import hw_for_gpu
    assert hw_for_gpu(driver_name) == hw
