"""The agent's app served by uvicorn in the caller's event loop, as `voice-agent serve` runs it (tests, benchmarks)."""

import asyncio
import time
from contextlib import asynccontextmanager

import uvicorn
from pydantic import SecretStr

from agent.app import uvicorn_config
from agent.config import Settings
from agent.livekit_dev_server import DEV_API_KEY, DEV_API_SECRET, free_port

STARTUP_SECS = 60.0


@asynccontextmanager
async def serving(app, port: int):
    """`app` on 127.0.0.1:`port` for the block; with LiveKit configured, once its worker registered."""
    server = uvicorn.Server(uvicorn_config(app, host="127.0.0.1", port=port, log_level="warning"))
    task = asyncio.create_task(server.serve())
    try:
        deadline = time.monotonic() + STARTUP_SECS
        while not server.started:
            if task.done() or time.monotonic() > deadline:
                raise RuntimeError("the agent's HTTP server failed to start")
            await asyncio.sleep(0.05)
        livekit = getattr(app.state, "livekit", None)  # the stock baseline's app has no LiveKit side
        while livekit is not None and livekit.worker_id in (None, "unregistered"):
            if time.monotonic() > deadline:
                raise RuntimeError("the LiveKit worker never registered")
            await asyncio.sleep(0.05)
        yield app
    finally:
        server.should_exit = True
        try:
            await asyncio.wait_for(task, 15)
        except asyncio.TimeoutError:
            task.cancel()


def agent_settings(settings: Settings, livekit_url: str | None = None, **update) -> Settings:
    """`settings` for an agent served on a free port, pointed at a local livekit-server (dev keys) if given."""
    if livekit_url is not None:
        update = {
            "livekit_url": livekit_url,
            "livekit_api_key": DEV_API_KEY,
            "livekit_api_secret": SecretStr(DEV_API_SECRET),
            **update,
        }
    return settings.model_copy(update={"port": free_port(), **update})
