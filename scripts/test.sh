#!/usr/bin/env bash
# The test command: lint, format check, types, then the whole suite.
# Run from the repository root with the project's venv active (see README).
set -euo pipefail
cd "$(dirname "$0")/.."

ruff check .
ruff format --check .
mypy
set +e
python -m pytest --cov --cov-report=term:skip-covered "$@"
status=$?
set -e
if [ "$status" -eq 5 ]; then
  echo "pytest collected no tests: that is a failure, not a pass" >&2
  exit 1
fi
exit "$status"
