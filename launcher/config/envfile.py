"""Strict parser for the layer files: `KEY=value` lines that stay valid for `bash source`.

Accepted: blank lines, `# comments`, `KEY=value` or `export KEY=value`, values unquoted (no spaces),
"double quoted" (with `${KEY}` references and \\" \\\\ \\$ escapes) or 'single quoted' (literal),
and a trailing ` # comment`. Refused, each with file:line: command substitution, arrays, bare `$KEY`
(write `${KEY}`), unterminated quotes, anything that is not an assignment. Interpolation itself
happens later, in resolve.py, once every layer is known.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from launcher.errors import ConfigError

KEY_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
REF_RE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


@dataclass(frozen=True)
class Assignment:
    key: str
    raw: str            # the value with quotes removed; `${KEY}` references still in it
    literal: bool       # single-quoted: no interpolation
    where: str          # "path:line", or "env", "cli", "default"

    @property
    def refs(self) -> list[str]:
        return [] if self.literal else REF_RE.findall(self.raw)


def parse_file(path: Path, display: str | None = None) -> list[Assignment]:
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e.strerror}") from None
    return parse_text(text, display or str(path))


def parse_text(text: str, source: str) -> list[Assignment]:
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        where = f"{source}:{n}"
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if stripped.startswith("export "):
            stripped = stripped[len("export "):].lstrip()
        key, eq, rest = stripped.partition("=")
        if not eq or not KEY_RE.fullmatch(key):
            raise ConfigError(
                f"{where}: malformed line {line.strip()!r}",
                fix="each line must be KEY=value, `# comment` or blank",
            )
        raw, literal = parse_value(rest, where)
        out.append(Assignment(key, raw, literal, where))
    return out


def parse_value(s: str, where: str) -> tuple[str, bool]:
    """Return (value, literal) for the text after `=`; the rest of the line may only be a comment."""
    if s.startswith("("):
        raise ConfigError(f"{where}: arrays are not supported",
                          fix='write a space-separated quoted list: KEY="a b c"')
    if s.startswith("'"):
        end = s.find("'", 1)
        if end < 0:
            raise ConfigError(f"{where}: unterminated single quote")
        _trailing(s[end + 1:], where)
        return s[1:end], True
    if s.startswith('"'):
        buf, i = [], 1
        while i < len(s):
            c = s[i]
            if c == "\\" and i + 1 < len(s) and s[i + 1] in '"\\$`':
                buf.append("\\$" if s[i + 1] == "$" else s[i + 1])  # keep \$ marked as a literal dollar
                i += 2
                continue
            if c == '"':
                _trailing(s[i + 1:], where)
                value = "".join(buf)
                _check_dollars(value, where)
                return value, False
            buf.append(c)
            i += 1
        raise ConfigError(f"{where}: unterminated double quote")
    value, _, comment = s.partition(" #")
    value = value.rstrip()
    if re.search(r"\s", value):
        raise ConfigError(f"{where}: unquoted value with spaces: {value!r}",
                          fix=f'quote it: "{value}" (bash would run the second word as a command)')
    if any(c in value for c in "\"'`;&|<>"):
        raise ConfigError(f"{where}: shell metacharacter in unquoted value {value!r}",
                          fix="quote the value")
    _check_dollars(value, where)
    return value, False


def _trailing(rest: str, where: str) -> None:
    rest = rest.strip()
    if rest and not rest.startswith("#"):
        raise ConfigError(f"{where}: unexpected text after the closing quote: {rest!r}")


def _check_dollars(value: str, where: str) -> None:
    if "$(" in value or "`" in value:
        raise ConfigError(f"{where}: command substitution is not supported",
                          fix="write the literal value; the launcher computes derived values itself")
    for m in re.finditer(r"(?<!\\)\$", value):
        if not REF_RE.match(value, m.start()):
            raise ConfigError(f"{where}: bare or unsupported `$` reference in {value!r}",
                              fix="write ${KEY} for a reference, or \\$ for a literal dollar")


def unescape(value: str) -> str:
    return value.replace("\\$", "$")
