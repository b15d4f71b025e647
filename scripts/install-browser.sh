#!/usr/bin/env bash
# Installs what the browser tests need: Debian's Chromium, and web/'s npm packages
# (livekit-client, esbuild, playwright-core) from package-lock.json. Each step runs once.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v chromium >/dev/null; then
    echo "installing Debian's chromium (once)..."
    sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo"
    export DEBIAN_FRONTEND=noninteractive
    $sudo apt-get install -y -q chromium >/dev/null 2>&1 \
        || { $sudo apt-get update -q >/dev/null && $sudo apt-get install -y -q chromium >/dev/null; }
fi
stamp="web/node_modules/.installed-$(sha1sum web/package-lock.json | cut -c1-12)"
if [ ! -f "$stamp" ]; then
    (cd web && npm ci --no-audit --no-fund --loglevel=error)
    touch "$stamp"
fi
