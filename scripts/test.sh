#!/usr/bin/env bash
# Lint, format check, type check (mypy) and the whole test suite (CPU; starts a real SGLang server on loopback).
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/python -m mypy
exec .venv/bin/python -m pytest -q -rs "$@"
