"""`v4 cluster init NAME --from TEMPLATE ...`: write envs/cluster/NAME.env from a template, with no placeholder left.

The template's lines are kept (its comments explain the keys); each key given on the command line replaces its line
or is appended. The result is validated as the cluster layer of a real configuration before it is written: a
placeholder the options did not replace (a documentation-range address, a /your/ path), or any other error, writes
nothing and names the option that fixes it.
"""
from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

from launcher.config import Selection, resolve
from launcher.config.checks import NAME_RULES, InvalidConfig, placeholders
from launcher.config.resolve import ROOT
from launcher.config.schema import SCHEMA
from launcher.errors import ConfigError

# command-line option -> the key it sets (so that an error can name the option)
OPTION_KEYS = {"--master": "V4_MASTER_IP", "--workers": "V4_WORKER_IPS", "--gpus-per-node": "V4_NUM_GPUS_PER_NODE",
               "--work": "V4_WORK", "--local-dir": "V4_LOCAL_DIR", "--user": "V4_SSH_USER", "--ssh-key": "V4_SSH_KEY",
               "--known-hosts": "V4_SSH_KNOWN_HOSTS", "--python": "V4_PYTHON", "--image": "V4_IMAGE",
               "--container": "V4_CONTAINER"}
KEY_OPTIONS = {k: o for o, k in OPTION_KEYS.items()}
LINE_RE = re.compile(r"^\s*(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)=")


def template_path(template: str, root: Path = ROOT) -> Path:
    p = Path(template)
    if p.suffix == ".env" and p.is_file():
        return p
    named = root / "envs" / "cluster" / f"{template}.env"
    if named.is_file():
        return named
    have = sorted(f.stem for f in (root / "envs" / "cluster").glob("*.env"))
    raise ConfigError(f"no cluster template {template!r}", fix=f"--from one of {', '.join(have)}, or a path to a .env file")


def quote(value: str) -> str:
    """A value as a double-quoted env-file string: bash reads it back unchanged, and so does the launcher."""
    return '"' + re.sub(r'(["\\$`])', r"\\\1", value) + '"'


def render(template_text: str, values: dict[str, str | None], source: str) -> str:
    """The template with each key in `values` set: its line replaced in place, or appended."""
    out, seen = [f"# written by `v4 cluster init` from {source}"], set()
    for line in template_text.split("\n"):
        m = LINE_RE.match(line)
        if m and m.group(1) in values:
            key = m.group(1)
            if key not in seen and values[key] is not None:         # None: the line goes
                out.append(f"{key}={quote(values[key])}")
            seen.add(key)
            continue
        if line.startswith("# Template for") or line.startswith("# The addresses below are from the documentation"):
            continue                                    # the template's own header no longer applies
        out.append(line)
    extra = [k for k in values if k not in seen and values[k] is not None]
    if extra:
        out += ["", "# set by `v4 cluster init`"] + [f"{k}={quote(values[k])}" for k in extra]
    return "\n".join(out).rstrip("\n") + "\n"


def init(name: str, template: str, values: dict[str, str], force: bool = False, root: Path = ROOT) -> tuple[Path, str]:
    """Write envs/cluster/NAME.env (returns its path and text) or raise ConfigError naming what to fix."""
    pattern, what = next((p, w) for k, p, w in NAME_RULES if k == "V4_CLUSTER_NAME")
    if not pattern.fullmatch(name):
        raise ConfigError(f"cluster name {name!r} is not valid: it must be {what}")
    src = template_path(template, root)
    target = root / "envs" / "cluster" / f"{name}.env"
    if target.exists() and os.path.samefile(src, target):
        # --force replaces NAME.env; when that is the template itself, its placeholders and comments would be gone
        raise ConfigError(f"--from {template} is {target.relative_to(root)} itself: writing it would replace the "
                          "template it is made from (--force or not)",
                          fix="pick another NAME; to change this file, edit it, or copy it and init from the copy")
    if target.exists() and not force:
        raise ConfigError(f"{target.relative_to(root)} exists", fix="pick another NAME, or --force to overwrite it")
    unknown = [k for k in values if k not in SCHEMA]
    if unknown:
        raise ConfigError(f"unknown key(s) {', '.join(unknown)}", fix="`v4 config keys` lists them")
    values = {**values, "V4_CLUSTER_NAME": name, "V4_CLUSTER_TEMPLATE": None}
    if "V4_WORKER_IPS" in values:
        values["V4_NUM_NODES"] = str(1 + len(values["V4_WORKER_IPS"].split()))
    text = render(src.read_text(), values, str(src.relative_to(root) if src.is_relative_to(root) else src))
    # validate the file as the cluster layer it will be, before anything is visible under envs/cluster/
    staging = Path(tempfile.mkdtemp(prefix=".init-", dir=target.parent))
    tmp = staging / target.name
    try:
        tmp.write_text(text)
        shown = str(target.relative_to(root))
        try:
            cfg = resolve(Selection(cluster=str(tmp), hw="auto", environ={}, root=root))
        except InvalidConfig as e:
            def explain(m: str) -> str:
                m = m.replace(str(tmp.relative_to(root)), shown).replace(str(tmp), shown)
                key = m.split("=", 1)[0]
                if "template placeholder" in m:
                    return f"{key} is still {src.name}'s placeholder: pass {KEY_OPTIONS.get(key, f'--set {key}=...')}"
                return m
            raise ConfigError("the cluster file would not validate, so nothing was written:\n  - "
                              + "\n  - ".join(explain(m) for m in e.errors),
                              fix="pass the values with the options of `v4 cluster init` (or --set KEY=VALUE)") from None
        left = placeholders(cfg)
        if left:
            how = ", ".join(f"{k} ({KEY_OPTIONS.get(k, f'--set {k}=...')})" for k in dict.fromkeys(left))
            raise ConfigError(f"{src.name}'s placeholders would stay in {shown}: {how}; nothing was written",
                              fix="give the real values with those options")
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
        staging.rmdir()
    return target, text
