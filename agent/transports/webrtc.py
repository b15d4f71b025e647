"""Peer-to-peer WebRTC (Pipecat's SmallWebRTC): the signalling routes, one conversation per peer connection."""

import asyncio

from fastapi import FastAPI, Header, HTTPException
from loguru import logger
from pipecat.transports.base_transport import TransportParams
from pipecat.transports.smallwebrtc.connection import SmallWebRTCConnection
from pipecat.transports.smallwebrtc.request_handler import (
    SmallWebRTCPatchRequest,
    SmallWebRTCRequest,
    SmallWebRTCRequestHandler,
)
from pipecat.transports.smallwebrtc.transport import SmallWebRTCTransport

from agent.conversation import build_conversation
from agent.server.admission import Admission
from agent.server.auth import check_api_key
from agent.transports.webrtc_audio import release_audio_packets_at_once

SHUTDOWN_GRACE_SECS = 5
MAX_SDP_CHARS = 64 * 1024  # a browser's offer is 2-10 KB
CONNECT_DEADLINE_SECS = 20.0  # an answered peer must connect by then; it holds no slot until it does


class PeerToPeer:
    """`POST /api/offer` (SDP offer → answer), `PATCH /api/offer` (ICE candidates) and `/start`."""

    def __init__(self, admission: Admission):
        self._admission = admission
        self._handler = SmallWebRTCRequestHandler()
        self._conversations: set[asyncio.Task] = set()  # awaited at shutdown
        # Answered peers not connected yet: they hold no slot, so they are capped apart (each
        # holds an aiortc peer connection and its UDP ports until it connects or gives up).
        self._connecting: set[str] = set()

    def add_routes(self, app: FastAPI) -> None:
        app.add_api_route("/start", self.start, methods=["POST"])
        app.add_api_route("/api/offer", self.offer, methods=["POST"])
        app.add_api_route("/api/offer", self.ice_candidate, methods=["PATCH"])

    async def start(self, authorization: str | None = Header(None)):
        # The prebuilt client asks /start where to send its offer; without an answer it would
        # POST to /sessions/{id}/api/offer (Pipecat Cloud's layout), which we don't serve.
        check_api_key(self._admission.settings, authorization)
        self._admission.ready_engines()
        return {"webrtcRequestParams": {"endpoint": "/api/offer"}}

    async def offer(self, request: SmallWebRTCRequest, authorization: str | None = Header(None)):
        admission = self._admission
        admission.check("webrtc", authorization)
        if len(request.sdp) > MAX_SDP_CHARS or request.type != "offer" or "m=audio" not in request.sdp:
            # aiortc answers nearly anything (even "x"), and the peer connection then lingers.
            raise HTTPException(400, f"expected an SDP offer with an audio section, at most {MAX_SDP_CHARS} characters")
        if len(self._connecting) >= admission.sessions.capacity:
            admission.refuse("webrtc", "too many peers are connecting at once")

        async def on_new_connection(connection: SmallWebRTCConnection) -> None:
            for receiver in connection.pc.getReceivers():
                if receiver.track.kind == "audio":
                    release_audio_packets_at_once(receiver)
            task = asyncio.create_task(self._converse(connection, authorization))
            self._conversations.add(task)
            task.add_done_callback(self._conversations.discard)

        try:
            return await self._handler.handle_web_request(request=request, webrtc_connection_callback=on_new_connection)
        except HTTPException:
            raise
        except Exception as e:  # aiortc's parser and ICE setup raise plain errors on bad SDP
            logger.warning(f"refused an offer: {e!r}")
            raise HTTPException(400, "the SDP offer could not be used") from e

    async def ice_candidate(self, request: SmallWebRTCPatchRequest, authorization: str | None = Header(None)):
        check_api_key(self._admission.settings, authorization)
        try:
            await self._handler.handle_patch_request(request)
        except HTTPException:
            raise
        except Exception as e:
            raise HTTPException(400, "the ICE candidate could not be used") from e
        return {"status": "success"}

    async def _converse(self, connection: SmallWebRTCConnection, authorization: str | None) -> None:
        """Once the peer has connected (an answered offer holds no slot before), reserve → run → release."""
        name = connection.pc_id
        self._connecting.add(name)
        try:
            connected = await peer_connected(connection, CONNECT_DEADLINE_SECS)
        finally:
            self._connecting.discard(name)
        if not connected:
            logger.info(f"peer {name} did not connect within {CONNECT_DEADLINE_SECS:.0f} s")
            await connection.disconnect()
            return
        try:
            # The offer was checked; a slot may have gone to someone else while this peer connected.
            engines = self._admission.admit("webrtc", name, authorization)
        except HTTPException as e:
            logger.info(f"peer {name} connected but was refused: {e.detail}")
            await connection.disconnect()
            return

        def build():
            conversation = build_conversation(
                lambda audio: SmallWebRTCTransport(webrtc_connection=connection, params=TransportParams(**audio)),
                engines,
                self._admission.settings,
                metrics=[self._admission.metrics],
            )
            conversation.follow_client(name)
            return conversation

        try:
            await self._admission.serve(name, build)
        except Exception:
            logger.exception(f"conversation {name} could not start")
            await connection.disconnect()

    async def close(self) -> None:
        """Close every peer connection (which ends its conversation) and wait for them to end."""
        await self._handler.close()
        if self._conversations:
            _, stuck = await asyncio.wait(self._conversations, timeout=SHUTDOWN_GRACE_SECS)
            for task in stuck:
                task.cancel()
            await asyncio.gather(*stuck, return_exceptions=True)


async def peer_connected(connection: SmallWebRTCConnection, deadline_secs: float) -> bool:
    """Whether the peer's ICE and DTLS connect within `deadline_secs` (False once it fails or closes).

    Pipecat's connection fires its "connected" event only after a transport has called
    `connect()`, i.e. after a conversation is built, so the peer connection's own state is read.
    """
    waited = 0.0
    while waited < deadline_secs:
        state = connection.pc.connectionState
        if state == "connected":
            return True
        if state in ("failed", "closed"):
            return False
        await asyncio.sleep(0.1)
        waited += 0.1
    return False
