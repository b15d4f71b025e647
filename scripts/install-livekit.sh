#!/usr/bin/env bash
# Builds livekit-server into $GOPATH/bin (binary `server`) unless it is already there.
set -euo pipefail
gobin="$(go env GOPATH)/bin"
if [ -x "$gobin/server" ] && "$gobin/server" --version 2>/dev/null | grep -q "1.13.5"; then
    exit 0
fi
echo "building livekit-server v1.13.5 (once)..."
go install github.com/livekit/livekit-server/cmd/server@v1.13.5
