#!/usr/bin/env bash
# Prepare a fresh Debian/Ubuntu machine (as root) to run agentbox: the system packages the
# sandbox uses (mmdebstrap and uidmap to build images, user-mode networking, fuse-overlayfs for
# hosts whose kernel refuses an overlay, setpriv, a python3 for the host-based fallback,
# mkfs.ext4 and losetup for the workspace images, libseccomp for the sandbox filter, jq for the
# README's examples), a virtualenv in .venv with agentbox installed, and the `base` image
# (skipped when it is up to date; AGENTBOX_SKIP_IMAGE=1 skips it altogether).
set -euo pipefail
cd "$(dirname "$0")/.."

DEBIAN_PACKAGES="mmdebstrap uidmap python3 python3-venv slirp4netns fuse-overlayfs util-linux mount e2fsprogs libseccomp2 procps iproute2 ca-certificates jq"
if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  missing=""
  for p in $DEBIAN_PACKAGES; do dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"; done
  if [ -n "$missing" ]; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $missing >/dev/null
  fi
fi

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# No --prefer-binary: pyproject.toml keeps every dependency to releases with wheels, and
# installing exactly as `pip install .` does keeps that tested.
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".${AGENTBOX_EXTRAS:-}"

if [ "${AGENTBOX_SKIP_IMAGE:-0}" != 1 ]; then
  if command -v mmdebstrap >/dev/null 2>&1; then
    .venv/bin/agentbox image build base
  else
    echo "setup: mmdebstrap is missing, so no image: sandboxes use the host's /usr" >&2
  fi
fi
