"""Writing files that readers see whole or not at all (stdlib only: the launcher, jobs and trainer share it)."""
from __future__ import annotations

import os
import secrets
from pathlib import Path


def atomic_write(path: str | Path, text: str, private: bool = False) -> None:
    """Write `text` so that readers see the old file or the new one, never a torn one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(3)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if private else 0o644)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
