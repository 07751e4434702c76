#!/usr/bin/env bash
# Install everything the tests need (see setup.sh), then lint, type-check and run the suite.
set -euo pipefail
cd "$(dirname "$0")/.."
AGENTBOX_EXTRAS="[test]" bash scripts/setup.sh
# systemd-analyze, to verify deploy/agentbox.service (tests/test_packaging.py).
if ! command -v systemd-analyze >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends systemd >/dev/null
fi
# Debian's docker.io: tests/test_docker_machine.py runs a private dockerd of its own (never the
# operator's), on a socket of its own with no bridge and no iptables rules.
if ! command -v dockerd >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends docker.io >/dev/null
fi
# Debian's chromium: tests/test_console.py drives it headless through Playwright (never
# `playwright install`, which would download a browser of its own).
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >/dev/null
fi
# A real sshd, inotifywait and ripgrep on the "remote" host for the ssh machine kind's tests
# (tests/test_ssh_machine.py, tests/test_remote_files.py): searches run the remote host's rg.
if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  missing=""
  for p in openssh-server inotify-tools ripgrep; do dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"; done
  if [ -n "$missing" ]; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $missing >/dev/null
  fi
fi
# The data image (about 3 GB, 3 minutes the first time): tests use every tool it has. Cached by
# its request, so a rerun on the same machine skips it.
.venv/bin/agentbox image build data --profile data
# An older e2b SDK release, the last line that speaks the v1 control-plane routes, in a venv of
# its own (two releases cannot share one): tests/test_e2b_sdk_releases.py drives agentbox with it.
E2B_OLD_SDK=2.45.1
E2B_OLD_CODE_SDK=2.10.0
if ! .venv-e2b-old/bin/python -c "import importlib.metadata as m, sys; sys.exit((m.version('e2b'), m.version('e2b-code-interpreter')) != ('$E2B_OLD_SDK', '$E2B_OLD_CODE_SDK'))" 2>/dev/null; then
  rm -rf .venv-e2b-old
  .venv/bin/python -m venv .venv-e2b-old
  .venv-e2b-old/bin/python -m pip install -q "e2b==$E2B_OLD_SDK" "e2b-code-interpreter==$E2B_OLD_CODE_SDK"
fi
# The AIO SDK declares a heavy cloud SDK it does not import; install it without dependencies.
.venv/bin/python -m pip install -q --no-deps "agent-sandbox==0.0.30"
.venv/bin/ruff check agentbox tests bench
.venv/bin/mypy agentbox bench
# Test files spread over AGENTBOX_TEST_WORKERS processes (a file's tests stay in one, with its
# module fixtures); every worker starts its own servers, sshd and dockerd on ports of their own.
exec .venv/bin/python -m pytest -q -n "${AGENTBOX_TEST_WORKERS:-3}" --dist loadfile "$@"
