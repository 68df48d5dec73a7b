#!/usr/bin/env bash
# Regenerates lightning_diloco/transport/synchronizer_pb2{,_grpc}.py from the .proto.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
"$PY" -m grpc_tools.protoc -I . --python_out=. --pyi_out=. --grpc_python_out=. \
  lightning_diloco/transport/synchronizer.proto
