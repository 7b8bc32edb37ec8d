#!/usr/bin/env bash
# Creates (or reuses) the project's virtual environment in .venv and installs statebackend
# with everything the main job and the tests need. Needs Python >= 3.10; Spark needs Java 17.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
"$python" -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
  || { echo "setup: Python >= 3.10 is required (found $("$python" --version 2>&1))" >&2; exit 2; }
if ! java -version >/dev/null 2>&1 && [ -z "${JAVA_HOME:-}" ]; then
  echo "setup: Java 17 was not found; Spark jobs and tests need it (install openjdk-17-jre-headless)" >&2
fi
if [ ! -x .venv/bin/python ]; then
  "$python" -m venv .venv
fi
stamp=.venv/.statebackend-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/python -m pip install --quiet --upgrade pip
  .venv/bin/python -m pip install --quiet -e '.[test]'
  touch "$stamp"
fi
# The report test (tests/unit/test_report_browser.py) opens `statebackend report`'s HTML in
# a real headless Chromium. Install Debian's package when it is missing and we may; a
# failure only skips that test, it never fails the setup.
if ! command -v chromium >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup: installing chromium (for the report test)" >&2
    if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } \
      >/tmp/statebackend-chromium-install.log 2>&1; then
      echo "setup: could not install chromium (see /tmp/statebackend-chromium-install.log);" \
        "the report's browser test will be skipped" >&2
    fi
  else
    echo "setup: chromium is missing and cannot be installed here (needs root and apt-get);" \
      "the report's browser test will be skipped" >&2
  fi
fi
