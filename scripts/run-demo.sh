#!/usr/bin/env bash
# Sets up .venv (reused when present) and runs the main job's demo.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/python scripts/user_totals.py --demo "$@"
