#!/usr/bin/env bash
# Sets up .venv (see setup.sh), lints (ruff, mypy) and runs the test suite. Extra arguments go to pytest,
# e.g. `bash scripts/test.sh -m slow` for the multi-process tier, `-m long` for benchmarks and recipes end to
# end, `-m ""` for every test, `-n 0` for one process.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/vision_data.sh
# lint first: ruff and mypy as configured in pyproject.toml (mypy checks the package); a finding fails the run
.venv/bin/python -m ruff check .
.venv/bin/python -m mypy
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# two workers: serially, the suite leaves the 2-core machine idle about 60% of the time (its tests wait
# on islands, rounds and restarts); tests that share fixed network namespaces are one group (conftest.py)
exec .venv/bin/python -m pytest -p no:cacheprovider -n "${DILOCO_TEST_WORKERS:-2}" --dist loadgroup "$@"
