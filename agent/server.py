"""The HTTP server: health, WebRTC signalling and the browser client; one conversation per peer."""

import asyncio
from contextlib import asynccontextmanager

from fastapi import FastAPI, HTTPException
from fastapi.responses import JSONResponse, RedirectResponse
from loguru import logger
from pipecat.transports.base_transport import TransportParams
from pipecat.transports.smallwebrtc.connection import SmallWebRTCConnection
from pipecat.transports.smallwebrtc.request_handler import (
    SmallWebRTCPatchRequest,
    SmallWebRTCRequest,
    SmallWebRTCRequestHandler,
)
from pipecat.transports.smallwebrtc.transport import SmallWebRTCTransport
from pipecat_ai_prebuilt.frontend import PipecatPrebuiltUI

from agent.config import Settings
from agent.engines import Engines, load_engines_warm
from agent.pipeline import Conversation, build_conversation, run_conversation

RETRY_AFTER_SECS = 5
SHUTDOWN_GRACE_SECS = 5


def create_app(settings: Settings, engines: Engines | None = None) -> FastAPI:
    """The app; without `engines` it loads them itself at startup, in the background."""
    handler = SmallWebRTCRequestHandler()
    sessions: set[asyncio.Task] = set()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        loading = None
        if app.state.engines is None:
            # In the background, so /health can answer "loading" while the models load.
            loading = asyncio.create_task(load_engines(app))
        yield
        if loading is not None:
            loading.cancel()
        # Closing the peer connections fires on_client_disconnected, which ends each session.
        await handler.close()
        if sessions:
            _, stuck = await asyncio.wait(sessions, timeout=SHUTDOWN_GRACE_SECS)
            for task in stuck:
                task.cancel()
            await asyncio.gather(*stuck, return_exceptions=True)
        if loading is not None and app.state.engines is not None:
            app.state.engines.close()  # we loaded them, so we own them

    async def load_engines(app: FastAPI) -> None:
        try:
            app.state.engines = await load_engines_warm(settings)
        except Exception:
            logger.exception("loading the engines failed; the server cannot take calls")
            app.state.load_failed = True

    app = FastAPI(title="voice-agent", lifespan=lifespan)
    app.state.engines = engines
    app.state.load_failed = False

    def ready_engines() -> Engines:
        engines = app.state.engines
        if engines is None or not engines.ready:
            raise HTTPException(
                503, "models are loading", headers={"Retry-After": str(RETRY_AFTER_SECS)}
            )
        return engines

    @app.get("/health")
    async def health():
        engines = app.state.engines
        if engines is None or not engines.ready:
            status = "failed" if app.state.load_failed else "loading"
            return JSONResponse({"status": status}, status_code=503)
        return {
            "status": "ok",
            "models": {
                # A bundled model's directory is just ".../model", so the whole path says more.
                "stt": engines.stt.model_name,
                "llm": engines.llm.name,
                "tts": engines.tts.voice_path.stem,
            },
            "sessions": len(sessions),
        }

    @app.post("/start")
    async def start():
        # The prebuilt client asks /start where to send its offer; without an answer it would
        # POST to /sessions/{id}/api/offer (Pipecat Cloud's layout), which we don't serve.
        ready_engines()
        return {"webrtcRequestParams": {"endpoint": "/api/offer"}}

    @app.post("/api/offer")
    async def offer(request: SmallWebRTCRequest):
        engines = ready_engines()
        failures: list[Exception] = []

        async def on_new_connection(connection: SmallWebRTCConnection) -> None:
            try:
                start_session(connection, engines)
            except Exception as e:
                logger.exception(f"could not start a conversation for {connection.pc_id}")
                failures.append(e)
                await connection.disconnect()

        answer = await handler.handle_web_request(
            request=request, webrtc_connection_callback=on_new_connection
        )
        if failures:
            raise HTTPException(500, "could not start the conversation")
        return answer

    @app.patch("/api/offer")
    async def ice_candidate(request: SmallWebRTCPatchRequest):
        await handler.handle_patch_request(request)
        return {"status": "success"}

    def start_session(connection: SmallWebRTCConnection, engines: Engines) -> None:
        transport = SmallWebRTCTransport(
            webrtc_connection=connection,
            params=TransportParams(audio_in_enabled=True, audio_out_enabled=True),
        )
        conversation = build_conversation(transport, engines, settings)

        @transport.event_handler("on_client_disconnected")
        async def on_client_disconnected(transport, client):
            logger.info(f"client {connection.pc_id} disconnected")
            await conversation.worker.cancel()

        task = asyncio.create_task(run_session(conversation, connection.pc_id))
        sessions.add(task)
        task.add_done_callback(sessions.discard)

    app.mount("/client", PipecatPrebuiltUI)

    @app.get("/", include_in_schema=False)
    async def root():
        return RedirectResponse(url="/client/")

    return app


async def run_session(conversation: Conversation, pc_id: str) -> None:
    """One conversation; its failure is logged here and never reaches another session."""
    logger.info(f"conversation {pc_id} started")
    try:
        await run_conversation(conversation)
    except Exception:
        logger.exception(f"conversation {pc_id} failed")
    finally:
        logger.info(f"conversation {pc_id} ended")
