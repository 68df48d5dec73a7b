#!/usr/bin/env bash
# Builds the image lightning-diloco:latest (deploy/container/Containerfile) with buildah, with no
# image registry: the base is a Debian bookworm made by debootstrap (once, cached as a rootfs
# tarball), the dependencies are wheels pip downloads on this host (once per requirements.txt),
# and the layers are cached, so that a code change rebuilds only the package's layers.
#
#   bash deploy/container/build.sh              # build; tags lightning-diloco:latest and :src-<hash>
#   bash deploy/container/build.sh --print-tag  # the :src-<hash> tag the current sources would get
#   bash deploy/container/build.sh --if-cached  # build only where the base and the wheels are cached
#                                               # (seconds: a code change); else exit 3 saying what is missing
#
# The src-<hash> tag is a hash of everything that goes into the image (the package's sources,
# examples/, pyproject.toml and deploy/container/): tests/integration/test_container.py runs the
# image of that tag, making it with --if-cached where it is missing. Needs root (or a user buildah is set up for), buildah,
# debootstrap (first build only), python3 with pip, setuptools and wheel (PYTHON, default .venv's),
# and pip able to reach the packages of requirements.txt: torch must resolve to the CPU build,
# as in scripts/setup.sh; where pip's index has only the CUDA one, set
# DILOCO_TORCH_INDEX=https://download.pytorch.org/whl/cpu.
# Cache: DILOCO_IMAGE_CACHE (default ~/.cache/lightning-diloco/image). Isolation of the build's
# RUN steps: BUILDAH_ISOLATION (default chroot: needs no OCI runtime, cgroups or user namespaces).
set -euo pipefail
case "${PYTHON:-}" in /* | "") ;; */*) PYTHON="$PWD/$PYTHON" ;; esac  # a path relative to where it was given
cd "$(dirname "$0")/../.."

IMAGE=lightning-diloco
BASE=localhost/lightning-diloco-base:bookworm
SUITE=bookworm  # python 3.11: pyproject's requires-python and torch's cp311 wheels
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
CACHE=${DILOCO_IMAGE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/lightning-diloco/image}
PYTHON=${PYTHON:-$PWD/.venv/bin/python}
[ -x "$PYTHON" ] || command -v "$PYTHON" >/dev/null || PYTHON=python3

source_hash() {
  find lightning_diloco examples pyproject.toml deploy/container -type f \
      ! -name '*.pyc' ! -path '*/__pycache__/*' ! -path '*.egg-info/*' -print0 |
    LC_ALL=C sort -z | xargs -0 sha256sum | sha256sum | cut -c1-12
}
TAG="$IMAGE:src-$(source_hash)"
deps_hash=$(sha256sum < deploy/container/requirements.txt | cut -c1-16)
context="$CACHE/context"
if_cached=false
case "${1:-}" in
  "") ;;
  --print-tag) echo "$TAG"; exit 0 ;;
  --if-cached) if_cached=true ;;
  *) echo "build.sh: unknown argument '$1' (it takes none, --print-tag or --if-cached)" >&2; exit 2 ;;
esac

need() {
  command -v "$1" >/dev/null || { echo "build.sh: $1 is missing: apt-get install -y $2" >&2; exit 1; }
}
need buildah buildah
if $if_cached; then
  buildah inspect --type image "$BASE" >/dev/null 2>&1 ||
    { echo "build.sh: the base image $BASE is not built" >&2; exit 3; }
  [ "$(cat "$context/deps/.stamp" 2>/dev/null)" = "$deps_hash" ] ||
    { echo "build.sh: the wheels of deploy/container/requirements.txt are not in $context/deps" >&2; exit 3; }
fi
"$PYTHON" -c "import setuptools, wheel, pip" 2>/dev/null ||
  { echo "build.sh: $PYTHON lacks pip, setuptools or wheel: set PYTHON to one that has them (.venv/bin/python)" >&2; exit 1; }
mkdir -p "$CACHE"
exec 9> "$CACHE/.lock"
flock 9  # one build at a time shares the cache's build context
started=$SECONDS

# 1. The base: a minimal Debian with python3 and venv, from Debian packages only.
if ! buildah inspect --type image "$BASE" >/dev/null 2>&1; then
  rootfs_tar="$CACHE/rootfs-$SUITE.tar"
  if [ ! -f "$rootfs_tar" ]; then
    need debootstrap debootstrap
    rootfs=$(mktemp -d "$CACHE/rootfs.XXXXXX")
    echo "build.sh: debootstrap $SUITE into $rootfs (about a minute)"
    debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates "$SUITE" "$rootfs" "$MIRROR" \
      > "$CACHE/debootstrap.log" 2>&1 || { tail -20 "$CACHE/debootstrap.log" >&2; exit 1; }
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
    tar -C "$rootfs" --numeric-owner -cf "$rootfs_tar.part" . && mv "$rootfs_tar.part" "$rootfs_tar"
    rm -rf "$rootfs"
  fi
  echo "build.sh: importing $rootfs_tar as $BASE"
  container=$(buildah from scratch)
  buildah add --quiet "$container" "$rootfs_tar" / >/dev/null  # a local tarball is unpacked
  buildah config --cmd /bin/bash "$container"
  buildah commit --quiet "$container" "$BASE" >/dev/null
  buildah rm "$container" >/dev/null
fi

# 2. The build context: the dependencies' wheels (downloaded again only when requirements.txt
# changes), this package's wheel and examples/.
if [ "$(cat "$context/deps/.stamp" 2>/dev/null)" != "$deps_hash" ]; then
  echo "build.sh: downloading the wheels of deploy/container/requirements.txt (log in $CACHE/pip.log)"
  rm -rf "$context/deps"
  mkdir -p "$context/deps"
  # the image's interpreter, not this host's: CPython 3.11 on glibc x86_64
  "$PYTHON" -m pip download --disable-pip-version-check --only-binary=:all: --implementation cp --python-version 3.11 \
      --abi cp311 --platform manylinux_2_36_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 ${DILOCO_TORCH_INDEX:+--extra-index-url "$DILOCO_TORCH_INDEX"} \
      -r deploy/container/requirements.txt -d "$context/deps" > "$CACHE/pip.log" 2>&1 ||
    { grep -v "^WARNING: Location" "$CACHE/pip.log" | tail -20 >&2; exit 1; }
  echo "$deps_hash" > "$context/deps/.stamp"
fi
cp deploy/container/requirements.txt "$context/deps/requirements.txt"
rm -rf "$context/pkg" "$context/examples" "$CACHE/source"
mkdir -p "$context/pkg" "$CACHE/source"
# the wheel from a copy of the sources: nothing left from an earlier build (setuptools' build/ keeps
# deleted modules) goes in, and nothing is written into the clone
cp -r pyproject.toml README.md lightning_diloco "$CACHE/source/"
cp -r examples "$context/examples"
find "$CACHE/source" "$context/examples" -name __pycache__ -prune -exec rm -rf {} +
# SOURCE_DATE_EPOCH: the same sources make the same wheel, so an unchanged package reuses its layer
(cd "$CACHE/source" && SOURCE_DATE_EPOCH=315532800 "$PYTHON" -m pip wheel --quiet --disable-pip-version-check --no-deps \
  --no-build-isolation -w "$context/pkg" .) > "$CACHE/wheel.log" 2>&1 || { tail -20 "$CACHE/wheel.log" >&2; exit 1; }
rm -rf "$CACHE/source"

# 3. The image.
echo "build.sh: building $TAG"
buildah bud --quiet --layers --isolation "${BUILDAH_ISOLATION:-chroot}" -f deploy/container/Containerfile \
  -t "$IMAGE:latest" -t "$TAG" "$context" >/dev/null
# earlier sources' tags: their layers below the package's stay, shared
for old in $(buildah images --format '{{.Name}}:{{.Tag}}' | grep "^localhost/$IMAGE:src-" | grep -v ":${TAG#*:}\$"); do
  buildah rmi "$old" >/dev/null 2>&1 || true  # one a container still runs is kept
done
size=$(buildah images --format "{{.Size}}" "localhost/$TAG" 2>/dev/null | head -1 || true)
echo "build.sh: built localhost/$TAG (also localhost/$IMAGE:latest) in $((SECONDS - started)) s${size:+, $size}"
