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
  echo "setup: installing $CPU_TORCH (CPU build, about 200 MB to download)"
  "$VENV/bin/pip" install --quiet --disable-pip-version-check "$CPU_TORCH"
fi

stamp="$VENV/.setup-stamp"
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "setup: installing lightning-diloco and its dependencies (a minute or two the first time; log in $VENV/setup.log)"
  # each package named as pip takes it, the rest of pip's output to the log
  if ! "$VENV/bin/pip" install --progress-bar off --disable-pip-version-check -e ".[dev]" 2>&1 | tee "$VENV/setup.log" |
      { grep --line-buffered -E "^(Collecting|Installing collected packages)" || true; } |
      sed -u -e 's/^Collecting \([A-Za-z0-9_.-]*\).*/setup:   \1/' -e 's/^Installing collected packages:.*/setup: installing them/'; then
    cat "$VENV/setup.log" >&2
    exit 1
  fi
  # LitGPT (recipes/litgpt_pretrain.py) without its dependencies: its pins (huggingface-hub<1.4,
  # jsonargparse<=4.41, psutil==7.2.2) would downgrade what transformers and LightningCLI use; what
  # its model imports is installed above (psutil by the recipes extra)
  # LitData (tests/learner/test_data_litdata.py) likewise: it requires torchvision, whose PyPI build
  # requires the newest torch and would replace the CPU build with a multi-GB CUDA one (3 min 42 s
  # here); it imports boto3 (the dev extra) and not torchvision
  if ! "$VENV/bin/pip" install --progress-bar off --disable-pip-version-check --no-deps "litgpt==0.5.13" "litdata==0.2.76" >>"$VENV/setup.log" 2>&1; then
    cat "$VENV/setup.log" >&2
    exit 1
  fi
  "$VENV/bin/python" -c "import lightning_diloco, litgpt.model, litdata" # fail here, not later, if the install broke
  echo "$want" > "$stamp"
fi
