# Sourced by run.sh and test.sh: make sure .venv exists with the project installed, then set $venv.
# On first use it creates .venv with a Python 3.12 found on this machine; later calls return at once.
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=$root/.venv
stamp=$venv/.v4-installed

find_python() {
  local c
  for c in "${V4_BOOTSTRAP_PYTHON:-}" python3.12 python3; do
    [[ -n $c ]] || continue
    # pyenv shims answer `command -v` even when that version is not selected: ask the interpreter.
    if "$c" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then
      command -v "$c"; return 0
    fi
  done
  if command -v pyenv >/dev/null 2>&1; then
    for c in "$(pyenv root)"/versions/3.12*/bin/python3; do
      [[ -x $c ]] && { echo "$c"; return 0; }
    done
  fi
  return 1
}

if [[ ! -f $stamp || $root/pyproject.toml -nt $stamp ]]; then
  py=$(find_python) || { echo "no Python 3.12 found (megatron-core needs >= 3.12); set V4_BOOTSTRAP_PYTHON=/path/to/python3.12" >&2; exit 2; }
  echo "first use: creating $venv with $py and installing the project (a few minutes)..." >&2
  [[ -x $venv/bin/python ]] || "$py" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip >&2
  "$venv/bin/python" -m pip install -q -e "$root[test]" >&2
  touch "$stamp"
fi
