"""Layering, interpolation, typing and provenance.

Merge order (later wins): schema defaults -> envs/base.env -> envs/cluster/<cluster>.env ->
hw/<hw>.env -> presets/<preset>.env -> --env-file (in order) -> process environment (schema keys
only) -> --set KEY=VALUE. `${KEY}` references are resolved lazily, after every layer is known, so
`--set V4_WORK=/x` moves every path derived from it; `${KEY}` inside KEY's own value means the value
it overrides (append-style). Every value keeps the assignments that led to it.
"""
from __future__ import annotations

import difflib
import math
import os
import re
import shlex
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from launcher.config.envfile import Assignment, expand, parse_file, parse_value
from launcher.config.ports import AUTO, assign_auto
from launcher.config.schema import BUILTINS, SCHEMA, Key, secret_name
from launcher.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]

# Where each selector's files live, relative to the project root.
LAYER_DIRS = {"cluster": "envs/cluster", "hw": "hw", "preset": "presets"}


@dataclass(frozen=True)
class Selection:
    cluster: str = "local"
    hw: str = "auto"
    preset: str | None = None
    env_files: tuple[str, ...] = ()
    sets: tuple[str, ...] = ()
    environ: Mapping[str, str] | None = None     # None: os.environ
    root: Path = ROOT


@dataclass(frozen=True)
class Derived:
    value: Any
    formula: str


@dataclass
class Config:
    """The resolved configuration: typed values, their history, and derived values."""

    values: dict[str, Any]
    history: dict[str, list[Assignment]]
    selection: Selection
    layers: list[tuple[str, str]]                 # (layer, file) in merge order
    derived: dict[str, Derived] = field(default_factory=dict)
    resolved: dict[tuple[str, int], str] = field(default_factory=dict)   # (key, history index) -> text
    warnings: list[str] = field(default_factory=list)          # cross-checks that are likely, not certain, trouble
    # (key, history index) whose value took in a non-empty secret through `${...}`, directly or through
    # other keys: V4_HTTP_PROXY="http://u:${V4_REDIS_PASSWORD}@proxy" is as secret as the password.
    carries_secret: set[tuple[str, int]] = field(default_factory=set)

    def __getitem__(self, key: str) -> Any:
        if key in self.values:
            return self.values[key]
        if key in self.derived:
            return self.derived[key].value
        raise KeyError(_unknown_key_message(key, "config"))

    def get(self, key: str, default: Any = None) -> Any:
        try:
            return self[key]
        except KeyError:
            return default

    def __contains__(self, key: str) -> bool:
        return key in self.values or key in self.derived

    def origin(self, key: str) -> Assignment:
        return self.history[key][-1]

    def set_by(self, key: str, layer: str) -> int | None:
        """The history index of the last assignment of `key` in `layer`'s file (cluster, hw, preset, ...), or None."""
        f = dict(self.layers).get(layer)
        hits = [i for i, a in enumerate(self.history.get(key, [])) if f and a.where.startswith(f"{f}:")]
        return hits[-1] if hits else None

    @property
    def nodes(self) -> list[str]:
        """Node addresses, head first."""
        return [self.values["V4_MASTER_IP"], *self.values["V4_WORKER_IPS"]]

    def is_secret(self, key: str, idx: int = -1) -> bool:
        """Whether a key's value (its latest, or assignment `idx`) must be redacted when printed or saved:
        a secret key's own, or one that took in a secret. Jobs still get the real value (job_values)."""
        if key in SCHEMA and SCHEMA[key].secret:
            return True
        hist = self.history.get(key)
        return bool(hist) and (key, idx % len(hist)) in self.carries_secret

    def from_shell(self) -> dict[str, Any]:
        """Schema keys whose value comes from the process environment (an `export` in the shell), as printable:
        they change a run as much as a --set does, so plans and rerun commands show them."""
        return {k: "***" if self.is_secret(k) else h[-1].raw
                for k, h in self.history.items() if h and h[-1].where.startswith("env ")}

    def shown(self, key: str) -> Any:
        """The value as it may be printed or saved: secrets redacted."""
        value = self[key]
        return "***" if self.is_secret(key) and value not in ("", None, []) else value

    def secret_texts(self) -> list[str]:
        """The real text of every value `shown` redacts, longest first."""
        texts = {self.resolved.get((k, len(h) - 1), "") for k, h in self.history.items() if self.is_secret(k)}
        return sorted((t for t in texts if t), key=len, reverse=True)

    def redact_text(self, text: str) -> str:
        """`text` with every secret (and every value that took one in) replaced by ***: for printouts that
        embed values themselves, such as a plan's rendered scripts and environment."""
        for secret in self.secret_texts():
            text = text.replace(secret, "***")
        return text

    def explain(self) -> list[dict]:
        rows = []
        for key in self.values:
            hist = self.history[key]
            last = hist[-1]
            prev = hist[-2] if len(hist) > 1 else None
            rows.append({
                "key": key,
                "value": self.shown(key),
                "from": last.where,
                # a value made of references came from where they did too: what it was written as says which
                "written": last.raw if last.refs else None,
                "overrode": None if prev is None else {
                    "value": "***" if self.is_secret(key, len(hist) - 2) and prev.raw
                             else self._as_written(key, len(hist) - 2),
                    "from": prev.where},
            })
        for key, d in self.derived.items():
            rows.append({"key": key, "value": d.value, "from": f"derived: {d.formula}", "written": None,
                         "overrode": None})
        return rows

    def _as_written(self, key: str, idx: int) -> str:
        """An earlier assignment's value, with what it was written as when that differs."""
        raw = self.history[key][idx].raw
        value = self.resolved.get((key, idx), raw)
        return value if value == raw else f"{value} = {raw}"

    def to_json(self) -> dict:
        return {
            "selection": {"cluster": self.selection.cluster, "hw": self.selection.hw,
                          "preset": self.selection.preset, "env_files": list(self.selection.env_files),
                          "sets": [redact_set(s) for s in self.selection.sets]},
            "layers": [{"layer": layer, "file": f} for layer, f in self.layers],
            "values": {k: self.shown(k) for k in self.values},
            "derived": {k: d.value for k, d in self.derived.items()},
            "provenance": {r["key"]: {"from": r["from"], "written": r["written"], "overrode": r["overrode"]}
                           for r in self.explain()},
        }

    def job_values(self) -> dict[str, Any]:
        """Values a job on the cluster needs, secrets included (written only into the run directory)."""
        return {**self.values, **{k: d.value for k, d in self.derived.items()}}


def available(kind: str, root: Path = ROOT) -> list[str]:
    return sorted(p.stem for p in (root / LAYER_DIRS[kind]).glob("*.env"))


def layer_file(kind: str, name: str, root: Path = ROOT) -> Path:
    """A selector's file: a name from the layer's directory, or (cluster/env files) a path."""
    if kind == "cluster" and (name.endswith(".env") or "/" in name):
        path = Path(name)
        if not path.is_file():
            stem = Path(name).name.removesuffix(".env")
            known = stem in available(kind, root)
            raise ConfigError(f"cluster file {name} does not exist",
                              fix=f"--cluster {stem} names {LAYER_DIRS[kind]}/{stem}.env" if known else
                              f"give a path to a cluster .env file, or one of: {', '.join(available(kind, root))}")
        return path.resolve()
    path = root / LAYER_DIRS[kind] / f"{name}.env"
    if not path.is_file():
        names = available(kind, root)
        close = difflib.get_close_matches(name, names, n=1)
        raise ConfigError(
            f"unknown {kind} {name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""),
            fix=f"available {kind}s: {', '.join(names)}"
            + (" (or a path to a cluster .env file)" if kind == "cluster" else ""))
    return path


def resolve(sel: Selection, overlay: "Overlay | None" = None) -> Config:
    """Resolve a selection into a Config, running every cross-check (raises ConfigError). `overlay`: values the
    launcher itself assigns after every layer (nodes a run left out, launcher/recovery.py), with their origin."""
    from launcher.config.checks import derive_and_check

    cfg = load(sel, overlay)
    derive_and_check(cfg)
    return cfg


@dataclass(frozen=True)
class Overlay:
    """KEY=value assignments made by the launcher, not by a file or the command line: applied last, each with
    `where` as its origin (what `config show --explain` and the cross-checks' messages cite). Never part of the
    Selection: a command printed for the person repeats what they chose, not what the launcher derived."""
    where: str
    values: tuple[tuple[str, str], ...]


def load(sel: Selection, overlay: Overlay | None = None) -> Config:
    root = sel.root
    environ = os.environ if sel.environ is None else sel.environ

    def rel(p: Path) -> str:
        try:
            return str(p.relative_to(root))
        except ValueError:
            return str(p)

    def file_layer(kind: str, path: Path) -> tuple[str, str, list[Assignment]]:
        return kind, rel(path), parse_file(path, rel(path))

    head = [("base", *file_layer("base", root / "envs/base.env")[1:])]
    head.append(("cluster", *file_layer("cluster", layer_file("cluster", sel.cluster, root))[1:]))
    tail = []
    if sel.preset:
        tail.append(("preset", *file_layer("preset", layer_file("preset", sel.preset, root))[1:]))
    for f in sel.env_files:
        path = Path(f)
        if not path.is_file():
            raise ConfigError(f"--env-file {f} does not exist")
        tail.append(("env-file", *file_layer("env-file", path.resolve())[1:]))
    env_assigns = [Assignment(k, environ[k], True, f"env ${k}") for k in SCHEMA if k in environ]
    cli_assigns = [_parse_set(s) for s in sel.sets]
    tail += [("env", "process environment", env_assigns), ("cli", "--set", cli_assigns)]
    if overlay is not None:
        tail.append(("launcher", overlay.where, [Assignment(k, v, True, overlay.where) for k, v in overlay.values]))

    hw = sel.hw
    if hw == "auto":
        # The cluster layer names its hardware; a machine with no cluster file entry is probed.
        pre = _merge([*head, *tail], root)
        hw = pre.values["V4_GPU_MODEL"] or detect_hw(root)
    hw_layer = ("hw", *file_layer("hw", layer_file("hw", hw, root))[1:])
    sel = Selection(sel.cluster, hw, sel.preset, sel.env_files, sel.sets, sel.environ, root)
    cfg = _merge([*head, hw_layer, *tail], root)
    cfg.selection = sel
    assign_auto(cfg)
    return cfg


def _merge(layers: list[tuple[str, str, list[Assignment]]], root: Path) -> Config:
    history: dict[str, list[Assignment]] = {
        k.name: [Assignment(k.name, k.default, False, "default")] for k in SCHEMA.values()}
    for _, _, assigns in layers:
        for a in assigns:
            if a.key in BUILTINS:
                raise ConfigError(f"{a.where}: {a.key} is set by the launcher and cannot be assigned")
            if a.key not in SCHEMA:
                raise ConfigError(f"{a.where}: {_unknown_key_message(a.key, 'key')}",
                                  fix="see `v4 config keys` for every key with its doc")
            history[a.key].append(a)
    builtins = {"V4_ROOT": str(root)}
    raw, resolved, carries = _interpolate(history, builtins)
    values = {k: _typed(SCHEMA[k], raw[k], history[k][-1], SCHEMA[k].secret or (k, len(history[k]) - 1) in carries)
              for k in SCHEMA}
    return Config(values, history, Selection(), [(kind, f) for kind, f, _ in layers], resolved=resolved,
                  carries_secret=carries)


def _interpolate(history: dict[str, list[Assignment]], builtins: dict[str, str]
                 ) -> tuple[dict[str, str], dict[tuple[str, int], str], set[tuple[str, int]]]:
    """Resolve every assignment's references; also return the assignments whose value took in a secret."""
    memo: dict[tuple[str, int], str] = {}
    carries: set[tuple[str, int]] = set()

    def value(key: str, idx: int, stack: list[tuple[str, int]]) -> str:
        if (key, idx) in memo:
            return memo[(key, idx)]
        a = history[key][idx]
        if (key, idx) in stack:
            chain = " -> ".join(f"{k} ({history[k][i].where})" for k, i in stack[stack.index((key, idx)):])
            raise ConfigError(f"interpolation cycle: {chain} -> {key}",
                              fix="break the cycle: one of these values must not refer back")
        if a.literal:
            out = a.raw
        else:
            def sub(ref):
                if ref in builtins:
                    return builtins[ref]
                if ref not in SCHEMA:
                    raise ConfigError(f"{a.where}: ${{{ref}}} refers to an {_unknown_key_message(ref, 'key')}")
                # ${KEY} inside KEY's own value is the value it overrides
                j = idx - 1 if ref == key else len(history[ref]) - 1
                if j < 0:
                    return ""
                text = value(ref, j, stack + [(key, idx)])
                if text and (SCHEMA[ref].secret or (ref, j) in carries):
                    carries.add((key, idx))
                return text
            out = expand(a.raw, sub)
        memo[(key, idx)] = out
        return out

    final = {k: value(k, len(h) - 1, []) for k, h in history.items()}
    for k, h in history.items():        # earlier assignments too, for OVERRODE
        for i in range(len(h) - 1):
            try:
                value(k, i, [])
            except ConfigError:
                pass                    # an overridden value that no longer resolves is shown raw
    return final, memo, carries


TRUE, FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off", ""}


def _typed(key: Key, raw: str, origin: Assignment, secret: bool = False) -> Any:
    def bad(expected: str) -> ConfigError:
        shown = "*** (holds a secret, not shown)" if secret else repr(raw)
        return ConfigError(f"{origin.where}: {key.name}={shown}: expected {expected}",
                           fix=f"{key.name}: {key.doc}")
    t = key.type
    if t in ("str", "path"):
        return raw
    if t == "list":
        return raw.split()
    if t == "int" or (t == "port" and raw.strip() != AUTO):
        try:
            return int(raw) if raw.strip() else 0
        except ValueError:
            raise bad("an integer" if t == "int" else "a port number or `auto` (picked once for this checkout)") from None
    if t == "port":
        return AUTO                     # replaced by this checkout's recorded port (ports.assign_auto)
    if t == "float":
        try:
            number = float(raw) if raw.strip() else 0.0
        except ValueError:
            raise bad("a number") from None
        if not math.isfinite(number):
            # nan/inf parse as floats, but no setting means them and they are not valid JSON
            raise bad("a finite number")
        return number
    if t == "bool":
        if raw.lower() in TRUE:
            return True
        if raw.lower() in FALSE:
            return False
        raise bad("a boolean (1/0, true/false, yes/no)")
    if t == "enum":
        if raw not in key.choices:
            raise bad("one of " + ", ".join(repr(c) for c in key.choices))
        return raw
    raise AssertionError(t)


def _parse_set(s: str) -> Assignment:
    key, eq, value = s.partition("=")
    where = f"cli --set {key}"
    if not eq or not key:
        raise ConfigError(f"--set {s!r}: expected KEY=VALUE")
    if value[:1] in ("'", '"'):
        raw, literal = parse_value(value, where, secret_name(key))
    else:
        # The shell already removed its own quoting; of the escapes only `\$` (a literal dollar) is
        # kept, every other backslash is the character itself (raw writes that as `\\`).
        raw, literal = re.sub(r"\\(?!\$)", r"\\\\", value), False
    return Assignment(key, raw, literal, where)


def redact_set(s: str) -> str:
    """A `--set KEY=VALUE` as it may be printed or saved: a secret key's value masked."""
    key, _, _ = s.partition("=")
    return f"{key}=***" if secret_name(key) else s


def shell_set(s: str) -> str:
    """A `--set KEY=VALUE` as a printed command's shell word: quoted; a secret key's value not shown but taken from
    the shell's variable of that name, and the command refused by the shell while that is unset (so a pasted command
    never sets the secret to a placeholder)."""
    key, _, _ = s.partition("=")
    if secret_name(key) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
        return f'"{key}=${{{key}:?export {key} first: its value is not printed}}"'
    return shlex.quote(redact_set(s))


def _unknown_key_message(key: str, what: str) -> str:
    close = difflib.get_close_matches(key, list(SCHEMA), n=1, cutoff=0.6)
    return f"unknown {what} {key}" + (f" (did you mean {close[0]}?)" if close else "")


def hw_for_gpu(gpu_name: str, root: Path = ROOT) -> str | None:
    """The hw layer whose HW_GPU_NAME is in `gpu_name` (as the driver reports it), None if none is."""
    matches = [(len(a.raw), hw) for hw in available("hw", root)
               for a in parse_file(root / "hw" / f"{hw}.env")
               if a.key == "HW_GPU_NAME" and a.raw and a.raw.lower() in gpu_name.lower()]
    return max(matches)[1] if matches else None  # the longest name wins: "H200" must not be taken for "H20"


def detect_hw(root: Path = ROOT) -> str:
    """The hw layer matching this machine's GPU (by each hw file's HW_GPU_NAME), or cpu."""
    if not shutil.which("nvidia-smi"):
        return "cpu"
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return "cpu"
    names = out.strip().splitlines()
    if not names:
        return "cpu"
    hw = hw_for_gpu(names[0], root)
    if hw:
        return hw
    raise ConfigError(f"--hw auto: no hw/*.env matches this machine's GPU {names[0]!r}",
                      fix=f"pass --hw NAME (available: {', '.join(available('hw', root))}) "
                          "or add a hw file whose HW_GPU_NAME matches")
