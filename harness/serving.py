"""The agent's app served by uvicorn in the caller's event loop, as `voice-agent serve` runs it (tests, benchmarks)."""

import asyncio
import time
from contextlib import asynccontextmanager

import uvicorn

from agent.app import uvicorn_config

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
        while app.state.livekit is not None and app.state.livekit.worker_id in (None, "unregistered"):
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
