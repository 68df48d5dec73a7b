#!/usr/bin/env bash
# Sets up .venv (see setup.sh), lints (ruff, mypy) and runs the test suite. Extra arguments go to pytest,
# e.g. `bash scripts/test.sh -m "not slow"` for the fast tier only.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/vision_data.sh
# lint first: ruff and mypy as configured in pyproject.toml (mypy checks the package); a finding fails the run
.venv/bin/python -m ruff check .
.venv/bin/python -m mypy
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec .venv/bin/python -m pytest -p no:cacheprovider "$@"
