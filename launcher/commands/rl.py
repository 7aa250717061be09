"""`v4 rl`: reinforcement-learning tools. `v4 rl serve` puts the embedded rollout engine behind SGLang's HTTP API.

torch and dsv4 are imported inside the commands, so loading this module (and `v4 --help`) stays cheap.
"""
from __future__ import annotations

import json
import shlex
import stat
from pathlib import Path

import click

from launcher.errors import ConfigError


@click.group("rl")
def rl():
    """Reinforcement learning: serve the embedded rollout engine over SGLang's HTTP API."""


def read_token_file(path: Path) -> str:
    """The shared secret in `path`: refused when others can read it (the project keeps secrets 0600, as
    `launcher.cluster` does for the Ray token) or when it is empty."""
    try:
        st = path.stat()
    except OSError as e:
        raise ConfigError(f"--token-file {path}: {e.strerror}", fix="write the token to a file: "
                          f"(umask 077 && python -c 'import secrets; print(secrets.token_urlsafe(32))' > {path})"
                          ) from None
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"--token-file {path}: not a regular file")
    if st.st_mode & 0o077:
        raise ConfigError(f"--token-file {path} is readable by others (mode {stat.S_IMODE(st.st_mode):04o}); a token "
                          f"others can read protects nothing", fix=f"chmod 600 {shlex.quote(str(path))}")
    token = path.read_text().strip()
    if not token:
        raise ConfigError(f"--token-file {path} is empty")
    if any(c.isspace() for c in token):
        raise ConfigError(f"--token-file {path}: the token contains whitespace; it is sent as one HTTP header value")
    return token


def _curl_example(url: str, token_file: Path | None) -> str:
    auth = f" -H \"Authorization: Bearer $(cat {shlex.quote(str(token_file))})\"" if token_file else ""
    body = '{"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 8, "temperature": 0}, "return_logprob": true}'
    return f"curl -s {url}/generate -H 'Content-Type: application/json'{auth} -d '{body}'"


@rl.command("serve")
@click.option("--model", default=None, metavar="PRESET",
              help="Model preset with random weights: tiny (default), 4layer, flash, pro.")
@click.option("--checkpoint", type=click.Path(file_okay=False, path_type=Path), default=None, metavar="BF16_DIR",
              help="Serve this BF16 checkpoint directory (v4 ckpt dequantize output) instead of a preset.")
@click.option("--model-overrides", "overrides", multiple=True, metavar="KEY=VALUE",
              help="ModelConfig override(s), e.g. 'n_layers=2 dtype=fp32'. Repeatable.")
@click.option("--seed", type=int, default=0, show_default=True,
              help="Initialisation seed of a preset model, and the engine's sampling seed.")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True)
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to bind. Anything but loopback needs --token-file.")
@click.option("--port", type=click.IntRange(0, 65535), default=30000, show_default=True,
              help="Port (SGLang's default; 0 picks a free one).")
@click.option("--token-file", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="File holding the shared secret clients send as 'Authorization: Bearer <token>' (mode 0600).")
@click.option("--max-batch", type=click.IntRange(1), default=64, show_default=True,
              help="Most sequences decoded together; larger /generate batches run in turns.")
@click.option("--max-body-mb", type=click.IntRange(1, 1 << 20), default=4096, show_default=True,
              help="Largest request body (MiB); a weight bucket of N MiB is ~1.34 N MiB once base64'd.")
@click.option("--read-timeout", type=click.FloatRange(0, 86400, min_open=True), default=60.0, show_default=True,
              metavar="SECONDS", help="Longest silence while a client sends its request; then 408.")
@click.option("--group-timeout", type=click.FloatRange(0, 86400, min_open=True), default=60.0, show_default=True,
              metavar="SECONDS",
              help="Longest a weight-update group (/init_weights_update_group) waits for its members, and each "
                   "broadcast for its sender.")
def serve(model, checkpoint, overrides, seed, device, host, port, token_file, max_batch, max_body_mb, read_timeout,
          group_timeout):
    """Serve the embedded DSV4 rollout engine with SGLang's HTTP API (/generate, weight updates, health).

    \b
    Clients: dsv4.rl.http.HTTPEngine, or anything that speaks SGLang 0.5.23's /generate with input_ids.
    Stops cleanly on SIGTERM or Ctrl-C (requests in flight finish first).
    """
    from dsv4.rl.http import is_loopback

    if model is not None and checkpoint is not None:
        raise click.UsageError("--model and --checkpoint are alternatives: give one")
    token = read_token_file(token_file) if token_file is not None else None
    if token is None and not is_loopback(host):
        raise ConfigError(f"--host {host} is not a loopback address and no --token-file was given: anyone who "
                          f"reaches the port could replace the weights or run generation",
                          fix="serve on 127.0.0.1 (reach it over an SSH tunnel), or pass --token-file FILE (mode 0600)")

    engine = _load_engine(model or "tiny", checkpoint, overrides, seed, device, max_batch)

    from dsv4.rl.http import serve as serve_http

    def ready(url: str) -> None:
        info = engine.model_info()
        click.echo(f"v4 rl serve: {info['model_path']} ({info['num_hidden_layers']} layers, {device}) at {url}"
                   + (" (token required)" if token else ""), err=True)
        click.echo(f"  try: {_curl_example(url, token_file)}", err=True)

    try:
        serve_http(engine, host, port, token, max_body_mb=max_body_mb, read_timeout_s=read_timeout,
                   group_timeout_s=group_timeout, on_ready=ready)
    except OSError as e:
        raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror or e}",
                          fix="pick another --port (0 picks a free one) or stop what holds it") from None


def _load_engine(model: str, checkpoint: Path | None, overrides: tuple[str, ...], seed: int, device: str,
                 max_batch: int):
    import torch

    from dsv4.checkpoint import CheckpointError
    from dsv4.config import ModelConfig, parse_overrides
    from dsv4.rl.engine import EmbeddedEngine

    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda, but torch sees no CUDA GPU", fix="use --device cpu")
    click.echo(f"v4 rl serve: loading {checkpoint or f'preset {model}'} on {device} ...", err=True)
    if checkpoint is None:
        try:
            return EmbeddedEngine.from_preset(model, overrides=overrides, seed=seed, device=device,
                                              max_batch=max_batch)
        except KeyError as e:
            raise ConfigError(f"--model {model} / --model-overrides {' '.join(overrides) or '(none)'}: {e.args[0]}"
                              ) from None
        except ValueError as e:
            raise ConfigError(f"--model {model} with --model-overrides {' '.join(overrides)}: {e}") from None
    config = checkpoint / "config.json"
    if not config.is_file():
        raise ConfigError(f"--checkpoint {checkpoint}: no config.json there",
                          fix="pass a BF16 checkpoint directory (v4 ckpt dequantize SRC DST writes one)")
    try:
        hf = json.loads(config.read_bytes())
    except ValueError as e:                       # JSONDecodeError and UnicodeDecodeError
        raise ConfigError(f"--checkpoint {checkpoint}: {config} is not JSON ({e})") from None
    if not isinstance(hf, dict):
        raise ConfigError(f"--checkpoint {checkpoint}: {config} is not a JSON object of HF config keys")
    try:
        base = ModelConfig.from_hf_config(hf)
    except (KeyError, ValueError, TypeError, AttributeError) as e:      # a value of the wrong JSON type
        raise ConfigError(f"--checkpoint {checkpoint}: {config}: {e.args[0] if e.args else e}") from None
    typed = {}
    if overrides:
        # type the overrides against the checkpoint's own config, as --set does for presets
        try:
            new = base.with_overrides(*overrides)
        except (KeyError, ValueError) as e:
            raise ConfigError(f"--model-overrides {' '.join(overrides)}: {e.args[0] if e.args else e}") from None
        typed = {k: getattr(new, k) for k in parse_overrides(*overrides)}
    torch.manual_seed(seed)
    try:
        return EmbeddedEngine.from_checkpoint(checkpoint, device=device, overrides=typed, max_batch=max_batch,
                                              seed=seed)
    except CheckpointError as e:
        raise ConfigError(f"--checkpoint {checkpoint}: {e}",
                          fix="re-download or re-convert the named file (v4 ckpt dequantize SRC DST --force)"
                          ) from None
    except OSError as e:
        raise ConfigError(f"--checkpoint {checkpoint}: {e.filename or ''}: {e.strerror or e}") from None
