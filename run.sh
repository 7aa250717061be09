#!/usr/bin/env bash
# Thin entry: bootstraps .venv on first use, then `python -m launcher run "$@"`.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/scripts/bootstrap.sh"
exec "$venv/bin/python" -m launcher run "$@"
