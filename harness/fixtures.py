"""A real livekit-server on loopback, and the agent (HTTP server + LiveKit worker) in the test process."""

from dataclasses import dataclass

import pytest
from pydantic import SecretStr

from agent.livekit_dev_server import DEV_API_KEY, DEV_API_SECRET, LiveKitServerProcess, free_port
from agent.app import create_app
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
    agent_settings = settings.model_copy(
        update={
            "livekit_url": livekit_url,
            "livekit_api_key": DEV_API_KEY,
            "livekit_api_secret": SecretStr(DEV_API_SECRET),
            "api_key": SecretStr(API_KEY),
            "port": free_port(),
        }
    )
    app = create_app(agent_settings, engines)
    async with serving(app, agent_settings.port):
        yield LiveAgent(f"http://127.0.0.1:{agent_settings.port}", livekit_url, app)
