"""Strict parser for the layer files: `KEY=value` lines that stay valid for `bash source`.

Accepted: blank lines, `# comments`, `KEY=value` or `export KEY=value`, values unquoted (no spaces),
"double quoted" (with `${KEY}` references and \\" \\\\ \\$ \\` escapes) or 'single quoted' (literal),
and a trailing ` # comment` (a `#` starts a comment only after whitespace, as in bash). Refused, each
with file:line: command substitution, arrays, bare `$KEY` (write `${KEY}`), unterminated quotes, text
glued to a closing quote, anything that is not an assignment. Interpolation itself happens later, in
resolve.py, once every layer is known.

The `raw` text of a non-literal value keeps bash's escapes: `\\X` stands for the character X (so `\\$`
is a literal dollar and `\\${KEY}` no reference), and `expand()` removes them while it substitutes
references, in one left-to-right pass, as bash does. Values of secret keys never appear in errors.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from launcher.config.schema import secret_name
from launcher.errors import ConfigError

KEY_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# One token of a non-literal value: an escape `\X` (group 1) or a reference `${KEY}` (group 2). Scanning
# both together is what makes `\${KEY}` literal and `\\${KEY}` a backslash followed by a reference.
TOKEN_RE = re.compile(r"\\(.)|\$\{([A-Za-z_][A-Za-z0-9_]*)\}", re.S)
DQ_ESCAPES = '"\\$`'        # what a backslash escapes inside bash double quotes; elsewhere it is literal


@dataclass(frozen=True)
class Assignment:
    key: str
    raw: str            # the value with quotes removed; `${KEY}` references and `\X` escapes still in it
    literal: bool       # single-quoted or from the environment: no interpolation, no escapes
    where: str          # "path:line", or "env", "cli", "default"

    @property
    def refs(self) -> list[str]:
        return [] if self.literal else [m.group(2) for m in TOKEN_RE.finditer(self.raw) if m.group(2)]


def expand(raw: str, lookup: Callable[[str], str]) -> str:
    """`raw` with every `${KEY}` replaced by lookup(KEY) and every `\\X` escape by X."""
    return TOKEN_RE.sub(lambda m: m.group(1) if m.group(2) is None else lookup(m.group(2)), raw)


def parse_file(path: Path, display: str | None = None) -> list[Assignment]:
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e.strerror}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        col = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        # the byte's position, not the line: the line may hold a secret
        raise ConfigError(f"{display or path}:{line}: not UTF-8 (byte 0x{data[e.start]:02x} at column {col})",
                          fix=f"save {path} as UTF-8, e.g. `iconv -f latin1 -t utf-8 {path} > fixed.env`") from None
    return parse_text(text, display or str(path))


def parse_text(text: str, source: str) -> list[Assignment]:
    out = []
    # bash ends a line at "\n" only; str.splitlines() would also split at form feeds, \x1c-\x1e, \u2028...
    # and every line number after one would be wrong.
    for n, line in enumerate(text.split("\n"), 1):
        line = line.removesuffix("\r")
        where = f"{source}:{n}"
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if stripped.startswith("export "):
            stripped = stripped[len("export "):].lstrip()
        key, eq, rest = stripped.partition("=")
        if not eq or not KEY_RE.fullmatch(key):
            raise ConfigError(
                f"{where}: malformed line {_masked_line(stripped)!r}",
                fix="each line must be KEY=value, `# comment` or blank",
            )
        raw, literal = parse_value(rest, where, secret_name(key))
        out.append(Assignment(key, raw, literal, where))
    return out


def parse_value(s: str, where: str, secret: bool = False) -> tuple[str, bool]:
    """Return (raw, literal) for the text after `=`; the rest of the line may only be a comment.
    With `secret`, errors describe the value without showing it."""
    if s.startswith("("):
        raise ConfigError(f"{where}: arrays are not supported",
                          fix='write a space-separated quoted list: KEY="a b c"')
    if s.startswith("'"):
        end = s.find("'", 1)
        if end < 0:
            raise ConfigError(f"{where}: unterminated single quote")
        _trailing(s[end + 1:], where, secret)
        return s[1:end], True
    if s.startswith('"'):
        return _double_quoted(s, where, secret), False
    value = re.split(r"\s#", s, maxsplit=1)[0].rstrip()
    shown = _show(value, secret)
    if re.search(r"\s", value):
        raise ConfigError(f"{where}: unquoted value with spaces: {shown}",
                          fix=f'quote it: "{"..." if secret else value}" '
                              "(bash would run the second word as a command)")
    if any(c in value for c in "\"'`;&|<>"):
        raise ConfigError(f"{where}: shell metacharacter in unquoted value {shown}", fix="quote the value")
    if re.search(r"(?<!\\)(\\\\)*\\$", value):
        raise ConfigError(f"{where}: unquoted value {shown} ends in a backslash (bash would join the next line)",
                          fix="remove the backslash, or write \\\\ for a literal one")
    _check_dollars(value, where, secret)
    return value, False


def _double_quoted(s: str, where: str, secret: bool) -> str:
    """The raw text of a "double quoted" value (s starts at the opening quote)."""
    buf, i = [], 1
    while i < len(s):
        c = s[i]
        if c == "\\" and i + 1 < len(s):
            # bash drops the backslash before " \ $ ` and keeps it before anything else;
            # raw keeps `\X` for "literal X", so a kept backslash is written `\\`
            buf.append("\\" + s[i + 1] if s[i + 1] in DQ_ESCAPES else "\\\\")
            i += 2 if s[i + 1] in DQ_ESCAPES else 1
            continue
        if c == '"':
            _trailing(s[i + 1:], where, secret)
            value = "".join(buf)
            _check_dollars(value, where, secret)
            return value
        buf.append(c)
        i += 1
    raise ConfigError(f"{where}: unterminated double quote")


def _trailing(rest: str, where: str, secret: bool) -> None:
    # bash glues text after a closing quote onto the value ("UTC"#x is `UTC#x`): only whitespace
    # and then a `# comment` may follow.
    if rest and not re.match(r"\s+(#|$)", rest):
        raise ConfigError(f"{where}: unexpected text after the closing quote: {_show(rest.strip(), secret)}",
                          fix="end the line at the quote, or put a space before a `# comment` "
                              "(bash would make the text part of the value)")


def _check_dollars(value: str, where: str, secret: bool) -> None:
    """Refuse every unescaped `$` that is not a `${KEY}` reference, and command substitution."""
    for m in re.finditer(r"\\.|\$\{[A-Za-z_][A-Za-z0-9_]*\}|\$\(|`|\$", value, re.S):
        tok = m.group()
        if tok[0] == "\\" or tok.startswith("${"):
            continue
        if tok in ("$(", "`"):
            raise ConfigError(f"{where}: command substitution is not supported",
                              fix="write the literal value; the launcher computes derived values itself")
        raise ConfigError(f"{where}: bare or unsupported `$` reference in {_show(value, secret)}",
                          fix="write ${KEY} for a reference, or \\$ for a literal dollar")


def _show(value: str, secret: bool) -> str:
    """A value for an error message: quoted, or masked when it belongs to a secret key."""
    return "'***' (value of a secret key, not shown)" if secret else repr(value)


def _masked_line(line: str) -> str:
    """A malformed line for an error message, cut after the first secret-looking key name in it."""
    for m in KEY_RE.finditer(line):
        if secret_name(m.group()):
            return line[:m.end()] + " ***"
    return line
