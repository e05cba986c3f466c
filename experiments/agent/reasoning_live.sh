#!/usr/bin/env bash
# Issue 23's reasoning-template case through the real proxy and a real server, for every template
# family in tests/templates (one server each, ~1.5 min apiece on 2 cores). CI runs qwen3 only.
# Prints each family's per-turn figures (prompt, prefilled, exact_prefill, directives) as JSON.
set -euo pipefail
cd "$(dirname "$0")/../.."
LEYLINE_REASONING_FAMILIES=${LEYLINE_REASONING_FAMILIES:-glm45,kimi_k2_thinking,qwen3} \
  exec .venv/bin/python -m pytest -q -s tests/test_reasoning_live.py "$@"
