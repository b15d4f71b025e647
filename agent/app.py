"""The HTTP server: health, metrics, the browser client, and the routes of each transport."""

import asyncio
from contextlib import asynccontextmanager
from pathlib import Path

import uvicorn

from fastapi import FastAPI, Header, Request
from fastapi.responses import FileResponse, JSONResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.middleware.trustedhost import TrustedHostMiddleware
from loguru import logger
from pipecat_ai_prebuilt.frontend import PipecatPrebuiltUI

from agent.config import Settings, scrub_secrets_from_environment
from agent.engines import Engines, load_engines_warm
from agent.server.admission import Admission
from agent.server.auth import check_api_key
from agent.server.metrics import CONTENT_TYPE_LATEST, AgentMetrics
from agent.server.sessions import SessionRegistry, session_capacity
from agent.transports.webrtc import PeerToPeer
from agent.transports.websocket import WS_MAX_MESSAGE_BYTES, add_websocket_route

WEB_DIR = Path(__file__).resolve().parents[1] / "web"  # the browser demo; its dist/ is committed


def uvicorn_config(app: FastAPI, *, host: str, port: int, log_level: str) -> uvicorn.Config:
    """How the app is served (the CLI, tests and benchmarks alike)."""
    # uvicorn refuses a WebSocket message over this before reading it (its default is 16 MiB).
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, ws_max_size=WS_MAX_MESSAGE_BYTES)


def create_app(settings: Settings, engines: Engines | None = None) -> FastAPI:
    """The app; without `engines` it loads them itself at startup, in the background."""
    # No /docs, /redoc or /openapi.json: nothing for a stranger to browse.
    app = FastAPI(title="voice-agent", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.settings = settings
    app.state.engines = engines
    app.state.owns_engines = engines is None  # we load them, so we close them
    app.state.load_failed = False
    app.state.sessions = sessions = SessionRegistry(session_capacity(settings))  # live conversations by key
    app.state.metrics = metrics = AgentMetrics(sessions, engines_of=lambda: app.state.engines)
    admission = Admission(settings, sessions, metrics, engines_of=lambda: app.state.engines)

    app.state.peer_to_peer = PeerToPeer(admission)
    app.state.peer_to_peer.add_routes(app)
    add_websocket_route(app, admission)
    app.state.livekit = None
    if settings.livekit_enabled:
        from agent.transports.livekit import LiveKitRooms

        app.state.livekit = LiveKitRooms(admission)
        app.state.livekit.add_routes(app)
    app.state.sip = None
    if settings.sip_enabled:
        try:
            from agent.transports.sip import SipEndpoint
        except ModuleNotFoundError as e:
            raise RuntimeError(f"SIP_PORT is set but the `sip` extra is not installed (pip install -e '.[sip]'): {e}") from e
        app.state.sip = SipEndpoint(admission)
        app.state.sip.add_routes(app)

    app.add_middleware(TrustedHostMiddleware, allowed_hosts=settings.host_names)
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/metrics", prometheus_metrics, methods=["GET"], include_in_schema=False)
    app.add_api_route("/", root, methods=["GET"], include_in_schema=False)
    app.mount("/client", PipecatPrebuiltUI)
    app.mount("/static", StaticFiles(directory=WEB_DIR / "dist"), name="static")
    return app


@asynccontextmanager
async def lifespan(app: FastAPI):
    # Loading runs in the background, so /health can answer "loading" meanwhile.
    loading = asyncio.create_task(start_engines(app))
    if app.state.sip is not None:
        await app.state.sip.start()  # calls before the models are ready get 503 with Retry-After
    yield
    loading.cancel()
    if app.state.sip is not None:
        await app.state.sip.stop()  # hangs up every call
    if app.state.livekit is not None:
        await app.state.livekit.stop()
    await app.state.peer_to_peer.close()  # ends each peer's conversation
    if app.state.owns_engines and app.state.engines is not None:
        app.state.engines.close()


async def start_engines(app: FastAPI) -> None:
    """Load and warm the engines (unless given), then start the LiveKit worker on them."""
    if app.state.engines is None:
        try:
            app.state.engines = await load_engines_warm(app.state.settings)
        except Exception:
            logger.exception("loading the engines failed; the server cannot take calls")
            app.state.load_failed = True
            return
    scrub_secrets_from_environment()  # read by Settings and the model hub by now
    if app.state.livekit is not None:
        app.state.livekit.start(app.state.engines)


async def health(request: Request):
    app, engines = request.app, request.app.state.engines
    if engines is None or not engines.ready:
        return JSONResponse({"status": "failed" if app.state.load_failed else "loading"}, status_code=503)
    if engines.llm.failure is not None:
        return JSONResponse({"status": "failed", "reason": f"LLM: {engines.llm.failure}"}, status_code=503)
    livekit = app.state.livekit
    if livekit is not None and livekit.stopped:
        return JSONResponse({"status": "failed", "reason": "the LiveKit worker stopped"}, status_code=503)
    return {
        "status": "ok",
        "models": {stage: engine.name for stage, engine in engines.by_stage().items()},
        "sessions": app.state.sessions.active,
        "transport": "livekit" if livekit is not None else "webrtc",
        "livekit_worker": livekit.worker_id if livekit is not None else None,
        "sip_port": app.state.settings.sip_port if app.state.sip is not None else None,
    }


async def prometheus_metrics(request: Request, authorization: str | None = Header(None)):
    settings = request.app.state.settings
    if not settings.metrics_public:
        check_api_key(settings, authorization)
    return Response(request.app.state.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)


async def root(request: Request):
    # The LiveKit demo page needs rooms; peer-to-peer, Pipecat's prebuilt client talks SmallWebRTC.
    if request.app.state.livekit is not None:
        return FileResponse(WEB_DIR / "index.html", headers={"Cache-Control": "no-cache"})
    return RedirectResponse(url="/client/")
