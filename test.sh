#!/usr/bin/env bash
# The test suite: bootstraps .venv on first use, then pytest (extra arguments go to pytest).
# GPU tests skip without a GPU; network-namespace cluster tests skip without root, iproute2 and sshd.
# Without arguments the whole suite runs its test files in V4_TEST_WORKERS processes (pytest-xdist, default 2), each
# file whole in one of them, so its module fixtures are built once: most tests wait on subprocesses, Ray and ssh,
# and two workers halve the suite's time on a 2-core machine. V4_TEST_WORKERS=0 runs it in this process.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/scripts/bootstrap.sh"
cd "$root"
if (($# == 0)) && [[ ${V4_TEST_WORKERS:-2} != 0 ]]; then
  set -- -n "${V4_TEST_WORKERS:-2}" --dist loadfile
fi
exec "$venv/bin/python" -m pytest "$@"
