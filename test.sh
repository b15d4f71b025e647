#!/usr/bin/env bash
# Installs (once) what the tests need and runs them. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")"
scripts/install.sh piper,dev,sip,mcp,tools,multilingual
scripts/install-livekit.sh
scripts/install-sip.sh
scripts/install-browser.sh
exec .venv/bin/python -m pytest "$@"
