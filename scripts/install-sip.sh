#!/usr/bin/env bash
# Installs (once) the SIP phones the tests call the agent with, baresip and SIPp (Debian sip-tester),
# and Redis, which livekit-server needs for its SIP API (tests/test_livekit_sip.py).
set -euo pipefail
missing=()
command -v baresip >/dev/null || missing+=(baresip)
command -v sipp >/dev/null || missing+=(sip-tester)
command -v redis-server >/dev/null || missing+=(redis-server)
if [ ${#missing[@]} -eq 0 ]; then
    exit 0
fi
echo "installing ${missing[*]} (once)..."
sudo=""
if [ "$(id -u)" -ne 0 ]; then
    sudo="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
# A fresh machine (a CI container) has no package lists yet.
if ! apt-cache show "${missing[0]}" >/dev/null 2>&1; then
    $sudo apt-get update -q
fi
$sudo apt-get install -y -q --no-install-recommends "${missing[@]}"
