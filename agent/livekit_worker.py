"""LiveKit dispatch: an AgentServer that runs one Pipecat conversation per room, all on the shared engines."""

import asyncio
import os
import socket
import time

from livekit import api
from livekit.agents import AgentServer, JobContext, JobExecutorType, JobRequest
from loguru import logger
from pipecat.transports.livekit.transport import LiveKitParams, LiveKitTransport

from agent.config import Settings
from agent.engines import Engines
from agent.metrics import AgentMetrics
from agent.pipeline import build_conversation, run_conversation
from agent.sessions import SessionRegistry


WORKER_ID = f"{socket.gethostname()}:{os.getpid()}"


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


def create_agent_server(
    settings: Settings, engines: Engines, sessions: SessionRegistry, metrics: AgentMetrics | None = None
) -> AgentServer:
    """An AgentServer whose jobs all run in this process (THREAD executor) and share `engines`."""
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

    async def on_request(request: JobRequest) -> None:
        if sessions.full:
            logger.warning(f"refusing room {request.room.name}: {sessions.active}/{sessions.capacity} sessions")
            if metrics is not None:
                metrics.sessions_refused.labels(transport="livekit").inc()
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
            await run_room(ctx, room, settings, engines, sessions, metrics)
        finally:
            sessions.release(room)
            ctx.shutdown("conversation ended")

    return server


async def run_room(
    ctx: JobContext,
    room: str,
    settings: Settings,
    engines: Engines,
    sessions: SessionRegistry,
    metrics: AgentMetrics | None = None,
) -> None:
    """One conversation in one room; returns when the user leaves or the job is shut down."""
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
        metrics=metrics,
    )
    transport = conversation.transport
    sessions.attach(room, conversation)

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
    draining = asyncio.create_task(end_when_draining())
    try:
        await run_conversation(conversation, f"in room {room}")
    finally:
        draining.cancel()


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
