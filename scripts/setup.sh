#!/usr/bin/env bash
# Creates .venv and installs lightning-diloco with its dev extra. Idempotent: re-running with an
# unchanged pyproject.toml costs well under a second.
#
# torch first, on purpose: on a CPU-only machine an unpinned torch resolves to a multi-GB CUDA
# build, so we pin the CPU build before anything depends on torch. A machine whose python already
# has torch (a GPU box) keeps it: the venv then sees the system site-packages.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=.venv
CPU_TORCH=${DILOCO_CPU_TORCH:-torch==2.13.0}

if [ ! -x "$VENV/bin/python" ]; then
  if "$PYTHON" -c "import torch" >/dev/null 2>&1; then
    echo "setup: using the torch already installed for $PYTHON"
    "$PYTHON" -m venv --system-site-packages "$VENV"
  else
    "$PYTHON" -m venv "$VENV"
  fi
fi

if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
  echo "setup: installing $CPU_TORCH (CPU build)"
  "$VENV/bin/pip" install --quiet --disable-pip-version-check "$CPU_TORCH"
fi

# The vision recipe's data: Fashion-MNIST from Debian's dataset-fashion-mnist (30 MB).
if [ ! -d /usr/share/datasets/fashion-mnist ] && command -v apt-get >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then
    echo "setup: installing Debian's dataset-fashion-mnist"
    (apt-get install -y -qq dataset-fashion-mnist >/dev/null 2>&1 ||
      { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq dataset-fashion-mnist >/dev/null 2>&1; }) ||
      echo "setup: could not install dataset-fashion-mnist; the vision recipe will say so" >&2
  else
    echo "setup: for the vision recipe run: sudo apt-get install dataset-fashion-mnist" >&2
  fi
fi

stamp="$VENV/.setup-stamp"
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "setup: installing lightning-diloco and its dependencies"
  if ! "$VENV/bin/pip" install --quiet --disable-pip-version-check -e ".[dev]" >"$VENV/setup.log" 2>&1; then
    cat "$VENV/setup.log" >&2
    exit 1
  fi
  "$VENV/bin/python" -c "import lightning_diloco" # fail here, not later, if the install broke
  echo "$want" > "$stamp"
fi
