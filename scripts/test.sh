#!/usr/bin/env bash
# Install everything the tests need (see setup.sh), then lint, type-check and run the suite.
set -euo pipefail
cd "$(dirname "$0")/.."
AGENTBOX_EXTRAS="[test]" bash scripts/setup.sh
# The AIO SDK declares a heavy cloud SDK it does not import; install it without dependencies.
.venv/bin/python -m pip install -q --no-deps "agent-sandbox==0.0.30"
.venv/bin/ruff check agentbox tests bench
.venv/bin/mypy agentbox
exec .venv/bin/python -m pytest -q "$@"
