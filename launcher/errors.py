"""Exit codes and the exceptions that carry them.

Every error the launcher raises says what was wrong, where (file:line, node) and what to do;
`launcher.cli` turns a V4Error into its message on stderr and its exit code.
"""
from __future__ import annotations

OK = 0
JOB_FAILED = 1
USAGE = 2
PREFLIGHT_FAILED = 3
GATE_FAILED = 4
CLUSTER_FAILED = 5
NONFINITE = 16
TIMEOUT = 124

EXIT_CODES = {
    OK: "ok",
    JOB_FAILED: "a job failed",
    USAGE: "usage or config error",
    PREFLIGHT_FAILED: "preflight failed",
    GATE_FAILED: "a gate failed",
    CLUSTER_FAILED: "cluster bring-up failed",
    NONFINITE: "non-finite loss/gradient detected",
    TIMEOUT: "timed out",
}


class V4Error(Exception):
    code = JOB_FAILED

    def __init__(self, message: str, *, fix: str | None = None, code: int | None = None):
        super().__init__(message)
        self.message = message
        self.fix = fix
        if code is not None:
            self.code = code

    def render(self) -> str:
        return f"error: {self.message}" + (f"\n  fix: {self.fix}" if self.fix else "")


class ConfigError(V4Error):
    code = USAGE


class PreflightError(V4Error):
    code = PREFLIGHT_FAILED


class GateError(V4Error):
    code = GATE_FAILED


class ClusterError(V4Error):
    code = CLUSTER_FAILED


class JobError(V4Error):
    code = JOB_FAILED


class NonFiniteError(V4Error):
    code = NONFINITE


class Timeout(V4Error):
    code = TIMEOUT
