#!/usr/bin/env bash
# The vision recipe's data, Fashion-MNIST, from Debian's dataset-fashion-mnist (30 MB): installed
# with apt-get when run as root, said before it is; otherwise the command to run is printed. Run by
# scripts/test.sh (the vision recipe's tests use it); the main job does not need it.
set -euo pipefail
if [ -d /usr/share/datasets/fashion-mnist ] || ! command -v apt-get >/dev/null 2>&1; then
  exit 0
fi
if [ "$(id -u)" = 0 ]; then
  echo "setup: the vision recipe's tests need Debian's dataset-fashion-mnist (30 MB): installing it with apt-get"
  (apt-get install -y -qq dataset-fashion-mnist >/dev/null 2>&1 ||
    { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq dataset-fashion-mnist >/dev/null 2>&1; }) ||
    echo "setup: could not install dataset-fashion-mnist; the vision tests will skip and say so" >&2
else
  echo "setup: for the vision recipe and its tests run: sudo apt-get install dataset-fashion-mnist" >&2
fi
