"""The HTTP server: health, LiveKit session tokens or WebRTC signalling, and the browser client."""

import asyncio
import hmac
import secrets
from contextlib import asynccontextmanager
from datetime import timedelta
from pathlib import Path

from fastapi import FastAPI, Header, HTTPException, WebSocket
from fastapi.responses import FileResponse, JSONResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from loguru import logger
from pipecat.transports.base_transport import TransportParams
from pipecat.transports.smallwebrtc.connection import SmallWebRTCConnection
from pipecat.transports.smallwebrtc.request_handler import (
    SmallWebRTCPatchRequest,
    SmallWebRTCRequest,
    SmallWebRTCRequestHandler,
)
from pipecat.transports.smallwebrtc.transport import SmallWebRTCTransport
from pipecat.transports.websocket.fastapi import FastAPIWebsocketParams, FastAPIWebsocketTransport
from pipecat_ai_prebuilt.frontend import PipecatPrebuiltUI

from agent.config import Settings
from agent.engines import Engines, load_engines_warm
from agent.metrics import CONTENT_TYPE_LATEST, AgentMetrics
from agent.pipeline import build_conversation, run_conversation
from agent.sessions import SessionRegistry, session_capacity
from frames.websocket import PCMJsonSerializer

RETRY_AFTER_SECS = 5
WEB_DIR = Path(__file__).resolve().parent.parent / "web"  # the browser demo; its dist/ is committed
SHUTDOWN_GRACE_SECS = 5


def create_app(settings: Settings, engines: Engines | None = None) -> FastAPI:
    """The app; without `engines` it loads them itself at startup, in the background."""
    handler = SmallWebRTCRequestHandler()
    # Every conversation of this process, peer-to-peer or LiveKit: they share the engines, so
    # they share the capacity too.
    sessions = SessionRegistry(session_capacity(settings))
    metrics = AgentMetrics(sessions, engines_of=lambda: app.state.engines)
    peer_tasks: set[asyncio.Task] = set()  # peer-to-peer conversations, awaited at shutdown

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        loading = None
        if app.state.engines is None:
            # In the background, so /health can answer "loading" while the models load.
            loading = asyncio.create_task(load_engines(app))
        else:
            start_livekit_worker(app)
        yield
        if loading is not None:
            loading.cancel()
        if app.state.livekit_worker is not None:
            app.state.livekit_worker.cancel()
            await asyncio.gather(app.state.livekit_worker, return_exceptions=True)
        # Closing the peer connections fires on_client_disconnected, which ends each session.
        await handler.close()
        if peer_tasks:
            _, stuck = await asyncio.wait(peer_tasks, timeout=SHUTDOWN_GRACE_SECS)
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
            return
        start_livekit_worker(app)

    def start_livekit_worker(app: FastAPI) -> None:
        """With LiveKit configured, this process is also the agent worker: one copy of the models."""
        if not settings.livekit_enabled:
            return
        from agent.livekit_worker import create_agent_server

        app.state.agent_server = create_agent_server(settings, app.state.engines, sessions, metrics)
        app.state.livekit_worker = asyncio.create_task(run_livekit_worker(app.state.agent_server))

    app = FastAPI(title="voice-agent", lifespan=lifespan)
    app.state.engines = engines
    app.state.load_failed = False
    app.state.livekit_worker = None
    app.state.agent_server = None  # livekit-agents AgentServer, when LiveKit is configured
    app.state.sessions = sessions  # live conversations by room name (LiveKit) or pc_id
    app.state.metrics = metrics

    def ready_engines() -> Engines:
        engines = app.state.engines
        if engines is None or not engines.ready:
            raise HTTPException(
                503, "models are loading", headers={"Retry-After": str(RETRY_AFTER_SECS)}
            )
        return engines

    def refuse_when_full(transport: str) -> None:
        """503 with Retry-After when every conversation slot is taken; running ones are untouched."""
        if sessions.full:
            metrics.sessions_refused.labels(transport=transport).inc()
            raise HTTPException(
                503,
                f"all {sessions.capacity} conversations of this agent are in use",
                headers={"Retry-After": str(RETRY_AFTER_SECS)},
            )

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
                "tts": engines.tts.voice,
            },
            "sessions": sessions.active,
            "transport": "livekit" if settings.livekit_enabled else "webrtc",
            "livekit_worker": livekit_worker_id(app),
        }

    @app.post("/api/session")
    async def new_session(authorization: str | None = Header(None)):
        """A fresh LiveKit room and a short-lived token for it that dispatches the agent."""
        check_api_key(settings, authorization)
        if not settings.livekit_enabled:
            raise HTTPException(404, "LiveKit is not configured; use /api/offer (peer-to-peer WebRTC)")
        refuse_when_full("livekit")
        room = f"voice-{secrets.token_hex(8)}"
        return {
            "url": settings.livekit_public_url or settings.livekit_url,
            "token": user_token(settings, room, identity=f"user-{secrets.token_hex(4)}"),
            "room": room,
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
        refuse_when_full("webrtc")
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
        if not sessions.reserve(connection.pc_id):
            raise RuntimeError(f"no free session slot ({sessions.capacity} in use)")
        conversation = build_conversation(
            lambda audio: SmallWebRTCTransport(webrtc_connection=connection, params=TransportParams(**audio)),
            engines,
            settings,
            metrics=metrics,
        )
        sessions.attach(connection.pc_id, conversation)
        conversation.follow_client(connection.pc_id)
        task = asyncio.create_task(run_conversation(conversation, connection.pc_id))
        peer_tasks.add(task)
        task.add_done_callback(peer_tasks.discard)
        task.add_done_callback(lambda _: sessions.release(connection.pc_id))

    @app.websocket("/ws")
    async def websocket_session(websocket: WebSocket, authorization: str | None = Header(None)):
        """A conversation over one plain WebSocket, for hosts that expose only HTTP (protocol:
        frames/websocket.py). It lasts as long as the connection: one per client, for every turn."""
        await websocket.accept()
        name = f"ws-{secrets.token_hex(4)}"
        try:
            check_api_key(settings, authorization)
            engines = ready_engines()
            refuse_when_full("websocket")
            if not sessions.reserve(name):
                raise HTTPException(503, "no free conversation slot")
        except HTTPException as e:
            await websocket.send_json({"type": "error", "message": e.detail})
            await websocket.close(code=1008 if e.status_code == 401 else 1013)  # policy / try again later
            return
        try:
            conversation = build_conversation(
                lambda audio: FastAPIWebsocketTransport(
                    websocket, FastAPIWebsocketParams(**audio, serializer=PCMJsonSerializer())
                ),
                engines,
                settings,
                metrics=metrics,
            )
            sessions.attach(name, conversation)
            conversation.follow_client(name)
            await run_conversation(conversation, name)
        finally:
            sessions.release(name)

    app.mount("/client", PipecatPrebuiltUI)
    app.mount("/static", StaticFiles(directory=WEB_DIR / "dist"), name="static")

    @app.get("/metrics", include_in_schema=False)
    async def prometheus_metrics():
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/", include_in_schema=False)
    async def root():
        # The LiveKit demo page needs rooms; peer-to-peer, Pipecat's prebuilt client talks SmallWebRTC.
        if settings.livekit_enabled:
            return FileResponse(WEB_DIR / "index.html", headers={"Cache-Control": "no-cache"})
        return RedirectResponse(url="/client/")

    return app


def check_api_key(settings: Settings, authorization: str | None) -> None:
    """401 unless `Authorization: Bearer <API_KEY>` matches (when an API key is configured)."""
    if settings.api_key is None:
        return
    expected = f"Bearer {settings.api_key.get_secret_value()}"
    if authorization is None or not hmac.compare_digest(authorization.encode(), expected.encode()):
        raise HTTPException(401, "missing or wrong API key", headers={"WWW-Authenticate": "Bearer"})


def user_token(settings: Settings, room: str, identity: str) -> str:
    """A browser's token: joins this one room only, expires soon, and dispatches our agent into it."""
    from livekit import api

    return (
        api.AccessToken(settings.livekit_api_key, settings.livekit_api_secret.get_secret_value())
        .with_identity(identity)
        .with_ttl(timedelta(seconds=settings.session_token_ttl_secs))
        .with_grants(
            api.VideoGrants(
                room_join=True, room=room, can_publish=True, can_subscribe=True, can_publish_data=True
            )
        )
        .with_room_config(
            api.RoomConfiguration(agents=[api.RoomAgentDispatch(agent_name=settings.agent_name)])
        )
        .to_jwt()
    )


def livekit_worker_id(app: FastAPI) -> str | None:
    """The worker id LiveKit gave us, "unregistered" until then, None without LiveKit."""
    return app.state.agent_server.id if app.state.agent_server is not None else None


async def run_livekit_worker(worker) -> None:
    try:
        await worker.run()
    except asyncio.CancelledError:
        await worker.aclose()
        raise
    except Exception:
        logger.exception("the LiveKit worker stopped; no new rooms will be served")
