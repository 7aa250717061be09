#!/usr/bin/env bash
# The test suite: bootstraps .venv on first use, then pytest (extra arguments go to pytest).
# GPU tests skip without a GPU; network-namespace cluster tests skip without root, iproute2 and sshd.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/scripts/bootstrap.sh"
cd "$root"
exec "$venv/bin/python" -m pytest "$@"
