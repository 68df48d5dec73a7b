#!/usr/bin/env bash
# Sets up .venv (see setup.sh) and runs the main job: three learner islands and a synchronizer on
# this host train a tiny Llama; island 1 is killed mid-run and restarted; the run never stops.
# Extra arguments replace the island command's options, e.g. `bash scripts/run.sh --steps 600`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
mkdir -p runs
exec .venv/bin/lightning-diloco run --islands 3 --workdir runs/main --report runs/main-report.json \
  --chaos "kill 1 at step 150" --restart-backoff 0.5 \
  --sync=--num-fragments=8 --sync=--sync-every=8 --sync=--overlap-steps=1 --sync=--outer-momentum=0.5 \
  -- .venv/bin/python examples/train_lm.py --steps 400 --step-seconds 0.02 "$@"
