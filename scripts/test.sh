#!/usr/bin/env bash
# Lint, format check, type check (mypy) and the whole test suite (CPU; starts a real SGLang server on
# loopback; about an hour on 2 cores, -m "not live": the unit tests only, about 2 min).
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/python -m mypy
exec .venv/bin/python -m pytest -q -rs --durations=25 "$@"  # ends with the 25 slowest tests
