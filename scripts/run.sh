#!/usr/bin/env bash
# Sets up .venv (see setup.sh) and runs the main job.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m benchmarks.codec "$@"
