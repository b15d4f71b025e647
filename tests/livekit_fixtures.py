"""A real livekit-server on loopback, and the agent (HTTP server + LiveKit worker) in the test process."""

import asyncio
import os
import shutil
import socket
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
import uvicorn

from agent.server import create_app

REPO = Path(__file__).resolve().parent.parent
LIVEKIT_CONFIG = REPO / "deploy" / "livekit.yaml"  # the same file the Docker set-up uses
API_KEY = "test-api-key"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def livekit_binary() -> str:
    found = shutil.which("livekit-server") or shutil.which("server")
    gopath_bin = Path(os.environ.get("GOPATH", Path.home() / "go")) / "bin" / "server"
    if found is None and gopath_bin.is_file():
        found = str(gopath_bin)
    if found is None:
        pytest.fail("livekit-server is not installed: `go install github.com/livekit/livekit-server/cmd/server@v1.13.5`")
    return found


@pytest.fixture(scope="session")
def livekit_url(tmp_path_factory):
    """livekit-server in dev mode (keys devkey/secret) on its own loopback ports."""
    port, rtc_tcp, udp = free_port(), free_port(), 52000 + os.getpid() % 1000 * 10
    log = (tmp_path_factory.mktemp("livekit") / "livekit.log").open("w")
    process = subprocess.Popen(
        [
            livekit_binary(), "--config", str(LIVEKIT_CONFIG), "--dev", "--bind", "127.0.0.1",
            "--node-ip", "127.0.0.1", "--port", str(port), "--rtc.tcp_port", str(rtc_tcp),
            "--rtc.port_range_start", str(udp), "--rtc.port_range_end", str(udp + 9),
        ],
        stdout=log, stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 30
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}", timeout=1)
            break
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"livekit-server did not start; see {log.name}")
            time.sleep(0.2)
    yield f"ws://127.0.0.1:{port}"
    process.terminate()
    try:
        process.wait(10)
    except subprocess.TimeoutExpired:
        process.kill()
    log.close()


@dataclass
class LiveAgent:
    http: str  # base URL of the agent's HTTP server
    livekit_url: str
    app: object  # the FastAPI app: app.state.rooms holds the live conversations


@pytest.fixture(scope="session")
async def live_agent(livekit_url, engines, settings):
    """The agent as `voice-agent serve` runs it with LiveKit configured, sharing the test's engines."""
    agent_settings = settings.model_copy(
        update={
            "livekit_url": livekit_url,
            "livekit_api_key": "devkey",
            "livekit_api_secret": "secret",
            "api_key": API_KEY,
            "port": free_port(),
        }
    )
    # model_copy skips validation: wrap the secrets as the settings class would.
    from pydantic import SecretStr

    agent_settings.livekit_api_secret = SecretStr("secret")
    agent_settings.api_key = SecretStr(API_KEY)
    app = create_app(agent_settings, engines)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=agent_settings.port, log_level="warning"))
    serving = asyncio.create_task(server.serve())
    while not server.started:
        assert not serving.done(), "the agent's HTTP server failed to start"
        await asyncio.sleep(0.05)
    deadline = time.monotonic() + 30
    while app.state.agent_server is None or app.state.agent_server.id == "unregistered":
        assert time.monotonic() < deadline, "the LiveKit worker never registered"
        await asyncio.sleep(0.1)
    yield LiveAgent(f"http://127.0.0.1:{agent_settings.port}", livekit_url, app)
    server.should_exit = True
    await serving
