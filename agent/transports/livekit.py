"""LiveKit rooms: the agent worker (one conversation per dispatched room, all on the shared engines), its tokens and `/api/session`."""

import asyncio
import functools
import logging
import os
from collections import OrderedDict, deque
import secrets
import socket
import time
from datetime import timedelta

from fastapi import FastAPI, Header, HTTPException, Request
from livekit import api
from livekit.agents import AgentServer, JobContext, JobExecutorType, JobRequest
from loguru import logger
from pipecat.transports.livekit.transport import LiveKitParams, LiveKitTransport

from agent.config import Settings, scrub_secrets_from_environment
from agent.conversation import Conversation, build_conversation
from agent.engines import Engines
from agent.server.admission import Admission
from agent.server.sessions import SessionRegistry
from services.audio import INPUT_SAMPLE_RATE


WORKER_ID = f"{socket.gethostname()}:{os.getpid()}"
MAX_TRACKED_CLIENTS = 4096  # client addresses remembered for the session rate limit


def agent_token(settings: Settings, room: str, identity: str) -> str:
    """A token for the agent's own participant: this room only, marked as an agent."""
    return (
        api.AccessToken(settings.livekit_api_key, settings.livekit_api_secret.get_secret_value())
        .with_identity(identity)
        .with_name("Voice agent")
        .with_kind("agent")
        # Which process holds the room, for operators (and the multi-worker tests).
        .with_attributes({"agent.worker": WORKER_ID})
        .with_grants(api.VideoGrants(room_join=True, room=room, agent=True))
        .to_jwt()
    )


def user_token(settings: Settings, room: str, identity: str) -> str:
    """A browser's token: joins this one room only, expires soon, and dispatches our agent into it."""
    return (
        api.AccessToken(settings.livekit_api_key, settings.livekit_api_secret.get_secret_value())
        .with_identity(identity)
        .with_ttl(timedelta(seconds=settings.session_token_ttl_secs))
        .with_grants(
            # A microphone and nothing else: no camera or screen to forward, and no data messages
            # (RTVI text) into the shared LLM; the agent's events still reach the browser.
            api.VideoGrants(
                room_join=True,
                room=room,
                can_publish=True,
                can_publish_sources=["microphone"],
                can_subscribe=True,
                can_publish_data=False,
            )
        )
        .with_room_config(
            api.RoomConfiguration(agents=[api.RoomAgentDispatch(agent_name=settings.agent_name)])
        )
        .to_jwt()
    )


def start_rtc_runtime() -> None:
    """Create livekit-rtc's one FFI client now, on this thread, before any job thread can.

    livekit 1.1.21 builds it lazily in `FfiClient.instance`, with no lock, and the build releases
    the GIL (a ctypes call into the native library). Rooms joined at the same moment from the
    THREAD executor's job threads each built one: every room but one subscribed to an orphaned
    event queue, never heard its ConnectCallback, and 15 s later the FFI's "timed out waiting for
    ReadyForRoomEventRequest" panic made the SDK SIGTERM the whole agent, every conversation in
    it. A private reach, checked against livekit 1.1.21; tests/test_library_internals.py fails
    when it moves.
    """
    from livekit.rtc._ffi_client import FfiClient

    FfiClient.instance  # noqa: B018 (the property builds and keeps the singleton)


def skip_livekit_local_models() -> None:
    """Keep livekit-agents from loading its own VAD and end-of-turn model, which we never use.

    livekit-agents 1.8.9 warms up every process that runs jobs (`livekit.agents.ipc._preload`),
    and with the THREAD executor that process is ours: the first room paid for the load (~0.5 s
    of CPU) and the process kept ~250 MB more. The switch is the documented
    LIVEKIT_AGENTS_PRELOAD_LOCAL_INFERENCE; an operator's own value stands.
    tests/test_library_internals.py measures what the preload costs with it.
    """
    os.environ.setdefault("LIVEKIT_AGENTS_PRELOAD_LOCAL_INFERENCE", "0")


# livekit-agents 1.8.9 warns 10 s into every job that has not called `JobContext.connect()`
# (`livekit.agents.ipc.job_proc_lazy_main`). Ours never do, by design: Pipecat's LiveKitTransport
# joins the room with a connection of its own. The warning, once a room, told operators of a
# fault that is not there.
UNCONNECTED_JOB_WARNING = "The room connection was not established within 10 seconds after calling job_entry."


class _DropUnconnectedJobWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(UNCONNECTED_JOB_WARNING)


def quiet_the_unconnected_job_warning() -> None:
    """Drop livekit-agents' warning that a job never connected its own room (see UNCONNECTED_JOB_WARNING).

    Matched by its text, checked against livekit-agents 1.8.9; tests/test_library_internals.py
    fails when the text moves."""
    log = logging.getLogger("livekit.agents")
    if not any(isinstance(f, _DropUnconnectedJobWarning) for f in log.filters):
        log.addFilter(_DropUnconnectedJobWarning())


def receive_room_audio_at(sample_rate: int, frame_size_ms: int = 20) -> None:
    """Have livekit-rtc hand Pipecat each participant's audio at `sample_rate`, `frame_size_ms` a frame.

    Pipecat 1.14's LiveKit transport opens each participant's `rtc.AudioStream(track)` at
    livekit's default, 48 kHz in 10 ms frames, and resamples every frame to the pipeline's 16 kHz
    in Python: per room, 100 FFI events a second, each a wake-up of the room's event loop under
    the GIL, and a soxr call on each (with four rooms, profiled: the third largest cost of the
    agent's process after FFI event delivery and Silero). Opened at the pipeline's rate, livekit-rtc
    resamples in its native thread, and 20 ms frames halve the events; Pipecat's resampler then
    has nothing to do (same rate in and out).

    A private reach: the name `rtc` in pipecat.transports.livekit.transport, which
    `LiveKitTransportClient._async_on_track_subscribed` calls `rtc.AudioStream(track)` through,
    replaced by livekit.rtc's names with AudioStream opening at this rate. Checked against
    pipecat-ai 1.14.0 and livekit 1.1.21; tests/test_library_internals.py fails when it moves.
    """
    from livekit import rtc
    from pipecat.transports.livekit import transport as pipecat_livekit

    names = {name: getattr(rtc, name) for name in dir(rtc) if not name.startswith("__")}
    names["AudioStream"] = functools.partial(rtc.AudioStream, sample_rate=sample_rate, frame_size_ms=frame_size_ms)
    pipecat_livekit.rtc = type(rtc)(rtc.__name__)  # a module of its own, not livekit's
    vars(pipecat_livekit.rtc).update(names)


# livekit-rtc's FFI events that carry media frames; only AudioStream and VideoStream read them.
MEDIA_FRAME_EVENTS = ("audio_stream_event", "video_stream_event")


def _not_a_media_frame(event) -> bool:
    return event.WhichOneof("message") not in MEDIA_FRAME_EVENTS


def send_media_frames_to_their_stream_only() -> None:
    """Send each livekit-rtc media frame event to the stream it belongs to, and to no one else.

    livekit 1.1.21 hands an FFI event to every subscriber whose filter lets it through, each
    hand-over a wake-up of that subscriber's event loop under the GIL, and two kinds of
    subscriber let through frames only to drop them: an AudioStream filters by event type, so
    it is sent every room's audio frames (N² for N rooms); a request waiting for its reply
    subscribes with no filter, and `AudioSource.capture_frame` (50 a second in a speaking room)
    waits ~20 ms for room in the source's queue, sent every frame of every room meanwhile. At
    four rooms that was most of what the rooms' loops were woken for. livekit 1.2 filters both
    by handle and request id, but livekit-agents 1.8.9 pins 1.1.21.

    Here an AudioStream's filter also checks its handle, and a subscription without a filter is
    not sent media frames. A private reach (FfiQueue.subscribe and its subscribers, AudioStream's
    queue and handle check), checked against livekit 1.1.21; tests/test_library_internals.py
    fails when it moves.
    """
    from livekit.rtc import AudioStream
    from livekit.rtc._ffi_client import FfiClient, FfiQueue

    if getattr(FfiQueue.subscribe, "without_media_frames", False):
        return
    subscribe_any = FfiQueue.subscribe

    def subscribe(self, loop=None, filter_fn=None):
        return subscribe_any(self, loop, filter_fn or _not_a_media_frame)

    subscribe.without_media_frames = True
    FfiQueue.subscribe = subscribe
    subscribe_and_start = AudioStream.__init__

    def __init__(self, *args, **kwargs):
        subscribe_and_start(self, *args, **kwargs)
        own = lambda e: e.WhichOneof("message") == "audio_stream_event" and self._is_event(e)  # noqa: E731
        queue = FfiClient.instance.queue
        with queue._lock:
            queue._subscribers = [
                (q, loop, own if q is self._ffi_queue else only) for q, loop, only in queue._subscribers
            ]

    AudioStream.__init__ = __init__


def create_agent_server(engines: Engines, admission: Admission) -> AgentServer:
    """An AgentServer whose jobs all run in this process (THREAD executor) and share `engines`."""
    settings, sessions = admission.settings, admission.sessions
    server = AgentServer(
        ws_url=settings.livekit_url,
        api_key=settings.livekit_api_key,
        api_secret=settings.livekit_api_secret.get_secret_value(),
        job_executor_type=JobExecutorType.THREAD,
        load_fnc=lambda: sessions.load,
        load_threshold=1.0,  # our load is engine capacity: unavailable only when really full
        # livekit-agents estimates the load of a job it is about to accept as
        # load_threshold / num_idle_processes; with 0 idle runners that is 1.0 and a second
        # room arriving at the same moment is refused. One idle runner (a thread here) per
        # session makes the estimate 1 / max_sessions, which is exactly what a session costs.
        num_idle_processes=settings.max_sessions,
        port=0,  # the worker's own health endpoint: any free port; ours is on the HTTP server
    )
    # Registered means the worker has copied its credentials into os.environ (and used them).
    server.on("worker_registered", lambda *_: scrub_secrets_from_environment())

    async def on_request(request: JobRequest) -> None:
        if sessions.full:
            logger.warning(f"refusing room {request.room.name}: {sessions.active}/{sessions.capacity} sessions")
            admission.metrics.sessions_refused.labels(transport="livekit").inc()
            await request.reject()
            return
        await request.accept(identity=f"{settings.agent_name}-{request.job.id}")

    @server.rtc_session(agent_name=settings.agent_name, on_request=on_request)
    async def entrypoint(ctx: JobContext) -> None:
        room = ctx.job.room.name
        if not sessions.reserve(room):
            logger.warning(f"room {room}: no free session slot, leaving")
            ctx.shutdown("over capacity")
            return
        try:
            await admission.serve(room, lambda: room_conversation(ctx, room, engines, admission))
        finally:
            ctx.shutdown("conversation ended")

    return server


def room_conversation(ctx: JobContext, room: str, engines: Engines, admission: Admission) -> Conversation:
    """The conversation of one room: it greets the first participant and ends when the last one
    leaves, when the job is shut down, or after its current reply when the worker drains."""
    settings, sessions = admission.settings, admission.sessions
    identity = f"{settings.agent_name}-{ctx.job.id}"
    conversation = build_conversation(
        lambda audio: LiveKitTransport(
            settings.livekit_url,
            agent_token(settings, room, identity),
            room,
            # LiveKit's AudioSource buffers audio of its own (Pipecat's default: 1 s), which a pause
            # cannot reach (an interruption clears it); 200 ms bounds how long the agent talks on.
            params=LiveKitParams(**audio, audio_out_queue_size_ms=200),
        ),
        engines,
        settings,
        metrics=[admission.metrics],
        ends_without_audio=False,
    )
    transport = conversation.transport

    @transport.event_handler("on_first_participant_joined")
    async def _on_joined(_transport, _participant_id):
        await conversation.greet()

    async def end(reason: str) -> None:
        logger.info(f"room {room}: {reason}")
        await conversation.worker.cancel(reason=reason)

    @transport.event_handler("on_participant_left")
    async def _on_left(_transport, participant_id, _reason=None):
        others = [p for p in transport.get_participants() if p != participant_id]
        if not others:  # the last user left: nobody to talk to
            await end(f"{participant_id} left")

    async def end_when_draining() -> None:
        while not sessions.draining:
            await asyncio.sleep(0.25)
        # A second to spare for leaving the room before the process must be gone.
        left = max(0.0, sessions.drain_deadline - time.monotonic() - 1.0)
        await conversation.end_after_reply(timeout=left, reason="the worker is draining")

    ctx.add_shutdown_callback(lambda: end("job shut down"))
    conversation.background(end_when_draining())
    return conversation


async def drain(server: AgentServer, sessions: SessionRegistry, grace_secs: float) -> None:
    """On SIGTERM: take no new room, let each conversation finish the reply it is giving (then the
    agent leaves its room), and return once all have ended, or after `grace_secs` at the latest."""
    logger.info(f"draining: {sessions.active} conversations finish their replies (grace {grace_secs:.0f} s)")
    sessions.start_draining(grace_secs)
    try:
        # LiveKit stops dispatching here; then this waits for the jobs, which end as their replies do.
        await server.drain(timeout=grace_secs)
    except TimeoutError:
        logger.warning(f"draining: {sessions.active} conversations still running after {grace_secs:.0f} s")


class LiveKitRooms:
    """LiveKit inside `voice-agent serve`: the agent worker on this process' engines (one copy of
    the models) and `POST /api/session`, which hands a browser a room and a token for it."""

    def __init__(self, admission: Admission):
        self._admission = admission
        # POST /api/session times per client address (most recently seen last), for the rate limit.
        self._requests: OrderedDict[str, deque[float]] = OrderedDict()
        self.agent_server: AgentServer | None = None
        self._worker: asyncio.Task | None = None

    def _limit_rate(self, client: str, per_minute: int) -> None:
        """429 when `client` asked for more than `per_minute` sessions in the last minute."""
        now = time.monotonic()
        times = self._requests.pop(client, None) or deque()
        while times and now - times[0] > 60:
            times.popleft()
        self._requests[client] = times
        while len(self._requests) > MAX_TRACKED_CLIENTS:
            self._requests.popitem(last=False)
        if len(times) >= per_minute:
            raise HTTPException(429, "too many session requests; try again in a minute", headers={"Retry-After": "60"})
        times.append(now)

    def add_routes(self, app: FastAPI) -> None:
        app.add_api_route("/api/session", self.new_session, methods=["POST"])

    @property
    def stopped(self) -> bool:
        """The worker was started and is no longer running: no new room will be served."""
        return self._worker is not None and self._worker.done()

    @property
    def worker_id(self) -> str | None:
        """The worker id LiveKit gave us, "unregistered" until then, None until started."""
        return self.agent_server.id if self.agent_server is not None else None

    def start(self, engines: Engines) -> None:
        skip_livekit_local_models()
        quiet_the_unconnected_job_warning()
        start_rtc_runtime()
        receive_room_audio_at(INPUT_SAMPLE_RATE)
        send_media_frames_to_their_stream_only()
        self.agent_server = create_agent_server(engines, self._admission)
        self._worker = asyncio.create_task(self._run())

    async def _run(self) -> None:
        try:
            await self.agent_server.run()
        except asyncio.CancelledError:
            await self.agent_server.aclose()
            raise
        except Exception:
            logger.exception("the LiveKit worker stopped; no new rooms will be served")

    async def stop(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
            await asyncio.gather(self._worker, return_exceptions=True)

    async def new_session(self, request: Request, authorization: str | None = Header(None)):
        """A fresh LiveKit room and a short-lived token for it that dispatches the agent."""
        settings = self._admission.settings
        self._admission.check("livekit", authorization)
        self._limit_rate(request.client.host if request.client else "?", settings.session_requests_per_minute)
        room = f"voice-{secrets.token_hex(8)}"
        return {
            "url": settings.livekit_public_url or settings.livekit_url,
            "token": user_token(settings, room, identity=f"user-{secrets.token_hex(4)}"),
            "room": room,
        }
