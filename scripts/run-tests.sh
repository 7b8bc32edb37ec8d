#!/usr/bin/env bash
# Sets up .venv (reused when present) and runs the whole test suite: unit tests (no JVM),
# S3 tests (a moto S3 server on 127.0.0.1) and Spark tests (local[2] and local-cluster).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
.venv/bin/ruff check statebackend tests scripts
.venv/bin/mypy statebackend
# Tests run in parallel worker processes (pytest-xdist), one per core up to 4 (each
# Spark test worker holds its own Spark driver JVM); TEST_WORKERS overrides, 0 runs in-process.
workers=${TEST_WORKERS:-$(.venv/bin/python -c 'import os; print(min(4, os.cpu_count() or 1))')}
exec .venv/bin/python -m pytest -q -n "$workers" "$@"
