"""A real livekit-server on loopback, and the agent (HTTP server + LiveKit worker) in the test process."""

from dataclasses import dataclass

import pytest
from pydantic import SecretStr

from agent.livekit_dev_server import LiveKitServerProcess
from agent.app import create_app
from harness.serving import agent_settings as with_livekit
from harness.serving import serving

API_KEY = "test-api-key"


@pytest.fixture(scope="session")
def livekit_url(tmp_path_factory):
    """livekit-server in dev mode (keys devkey/secret) on its own loopback ports."""
    try:
        server = LiveKitServerProcess(log_path=tmp_path_factory.mktemp("livekit") / "livekit.log")
    except FileNotFoundError as e:
        pytest.fail(str(e))
    with server:
        yield server.url


@dataclass
class LiveAgent:
    http: str  # base URL of the agent's HTTP server
    livekit_url: str
    app: object  # the FastAPI app: app.state.sessions holds the live conversations


@pytest.fixture(scope="session")
async def live_agent(livekit_url, engines, settings):
    """The agent as `voice-agent serve` runs it with LiveKit configured, sharing the test's engines."""
    agent_settings = with_livekit(settings, livekit_url, api_key=SecretStr(API_KEY))
    app = create_app(agent_settings, engines)
    async with serving(app, agent_settings.port):
        yield LiveAgent(f"http://127.0.0.1:{agent_settings.port}", livekit_url, app)
