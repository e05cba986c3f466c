#!/usr/bin/env bash
# Set up .venv with Python 3.12 (SGLang ships cp312 wheels only) and install Leyline with the
# sglang and dev extras. Idempotent: re-running with an unchanged pyproject.toml does nothing.
set -euo pipefail
cd "$(dirname "$0")/.."

find_python312() {
  if [[ -n "${LEYLINE_PYTHON:-}" ]]; then echo "$LEYLINE_PYTHON"; return; fi
  if command -v pyenv >/dev/null 2>&1; then
    local root; root=$(pyenv root)
    local p; p=$(ls -d "$root"/versions/3.12.* 2>/dev/null | sort -V | tail -n 1 || true)
    if [[ -n "$p" && -x "$p/bin/python" ]]; then echo "$p/bin/python"; return; fi
  fi
  for c in python3.12 python3; do
    if command -v "$c" >/dev/null 2>&1 && "$c" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))'; then
      command -v "$c"; return
    fi
  done
  echo "error: Python 3.12 not found (install it, e.g. 'pyenv install 3.12', or set LEYLINE_PYTHON)" >&2
  exit 1
}

if [[ ! -x .venv/bin/python ]]; then
  py=$(find_python312)
  echo "bootstrap: creating .venv with $py" >&2
  "$py" -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
fi

stamp=.venv/.leyline-installed
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [[ ! -f $stamp || "$(cat $stamp)" != "$want" ]]; then
  echo "bootstrap: installing leyline-agent[sglang,dev] (first time: ~3-5 min, ~11 GiB)" >&2
  .venv/bin/python -m pip install -q -e '.[sglang,dev]'
  echo "$want" > $stamp
fi
