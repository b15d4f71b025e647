#!/usr/bin/env bash
# Installs (once) and starts the agent with the offline CPU profile on http://localhost:7860.
set -euo pipefail
cd "$(dirname "$0")"
scripts/install.sh piper
exec .venv/bin/voice-agent serve --host "${HOST:-127.0.0.1}" --port "${PORT:-7860}" "$@"
