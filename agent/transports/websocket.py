"""WebSocket (`WS /ws`): one conversation per connection; the wire protocol (PCM16 binary, JSON text) is `PCMJsonSerializer`."""

import asyncio
import json
import secrets
import time
from urllib.parse import urlsplit

from loguru import logger
from pipecat.frames.frames import (
    Frame,
    InputAudioRawFrame,
    InterruptionFrame,
    OutputAudioRawFrame,
    OutputTransportMessageFrame,
    OutputTransportMessageUrgentFrame,
)
from fastapi import FastAPI, Header, HTTPException, WebSocket
from pipecat.serializers.base_serializer import FrameSerializer
from pipecat.transports.websocket.fastapi import FastAPIWebsocketParams, FastAPIWebsocketTransport

from agent.conversation import build_conversation
from agent.server.admission import Admission
from services.audio import INPUT_SAMPLE_RATE

MAX_AUDIO_MESSAGE_BYTES = 64000  # 2 s of 16 kHz PCM16; clients send 20-100 ms at a time
MAX_TEXT_MESSAGE_CHARS = 4096
WS_MAX_MESSAGE_BYTES = 2 * MAX_AUDIO_MESSAGE_BYTES  # past this the server refuses a message unread
# A connection holds no conversation slot until its first audio message, which must come within
# NO_AUDIO_TIMEOUT_SECS, the deadline that also ends a conversation whose audio stops.
MAX_MESSAGES_BEFORE_AUDIO = 8  # a `start`, maybe a few more; the rest is a client doing something else
# How far a client's audio may run ahead of real time. Clients stream as they record, so this only
# absorbs network jitter and a client's pre-roll; past it the server stops reading (back-pressure).
MAX_AUDIO_AHEAD_SECS = 3.0


def error_frame(message: str) -> OutputTransportMessageUrgentFrame:
    """An `{"type": "error"}` message for this client, sent through the pipeline like any other."""
    return OutputTransportMessageUrgentFrame(message={"type": "error", "message": message})


class RealTimePacer:
    """A token bucket of audio seconds, refilled in real time: `await pace(seconds)` returns once
    that much audio may go on.

    Awaited in the serializer, it holds up the transport's receive loop, so a client sending faster
    than it speaks is slowed by TCP flow control instead of filling the server's audio queue
    (which grows without bound in Pipecat's input transport) and every model after it.
    """

    def __init__(self, burst_secs: float = MAX_AUDIO_AHEAD_SECS):
        self.burst_secs = burst_secs
        self._balance = burst_secs
        self._at = time.monotonic()

    async def pace(self, seconds: float) -> None:
        now = time.monotonic()
        self._balance = min(self.burst_secs, self._balance + now - self._at) - seconds
        self._at = now
        if self._balance < 0:
            await asyncio.sleep(-self._balance)


class PCMJsonSerializer(FrameSerializer):
    """Client → agent:
    - binary: mono PCM16 little-endian at 16 kHz, any length up to 2 s per message;
    - text: `{"type": "start", "sample_rate": 16000}` (optional: it only checks the client's
      rate, since the server does not resample what it is sent).

    Agent → client:
    - binary: mono PCM16 at the agent's output rate (24 kHz), streamed in real time;
    - text, JSON objects with a `type`:
      - Pipecat's RTVI events (`"label": "rtvi-ai"`): `user-started-speaking` /
        `user-stopped-speaking` (turn boundaries), `user-transcription` (`data.text`,
        `data.final`), `bot-started-speaking`, `bot-output` (`data.text`, the agent's words as
        they are spoken) and `bot-stopped-speaking` (the end of a response);
      - `interrupted`: the user cut in; drop any agent audio not yet played;
      - `error` (`message`): a message was refused; the connection stays usable.

    The conversation (and its slot, and the greeting) starts with the first audio message; a
    connection that sends none within `NO_AUDIO_TIMEOUT_SECS` gets `error` and is closed (1008).

    Refused messages (text that is not a JSON object, unknown types, a declared rate other than
    16 kHz, audio with an odd byte count or over 2 s) are answered with `error` and dropped.
    Audio sent faster than real time is read at real time once it is 3 s ahead (back-pressure).
    """

    def __init__(self):
        # RTVI messages are the protocol's events, so they are not filtered out.
        super().__init__(FrameSerializer.InputParams(ignore_rtvi_messages=False))
        self.pacer = RealTimePacer()

    async def serialize(self, frame: Frame) -> str | bytes | None:
        if isinstance(frame, OutputAudioRawFrame):
            return frame.audio
        if isinstance(frame, InterruptionFrame):
            return json.dumps({"type": "interrupted"})
        if isinstance(frame, (OutputTransportMessageFrame, OutputTransportMessageUrgentFrame)):
            return json.dumps(frame.message, default=str)
        return None

    async def deserialize(self, data: str | bytes) -> Frame | None:
        if isinstance(data, bytes):
            if len(data) > MAX_AUDIO_MESSAGE_BYTES:
                return error_frame(f"audio message of {len(data)} bytes refused: at most {MAX_AUDIO_MESSAGE_BYTES}")
            if len(data) % 2:
                return error_frame(f"audio message of {len(data)} bytes refused: PCM16 needs an even count")
            await self.pacer.pace(len(data) / (2 * INPUT_SAMPLE_RATE))
            return InputAudioRawFrame(audio=data, sample_rate=INPUT_SAMPLE_RATE, num_channels=1)
        if len(data) > MAX_TEXT_MESSAGE_CHARS:
            return error_frame(f"text message of {len(data)} characters refused: at most {MAX_TEXT_MESSAGE_CHARS}")
        try:
            message = json.loads(data)
        except (ValueError, RecursionError):  # RecursionError: "[[[[…" nested past the parser's stack
            logger.warning(f"websocket: refused a text message that is not JSON ({len(data)} chars)")
            return error_frame("text messages must be JSON objects")
        if not isinstance(message, dict):
            return error_frame("text messages must be JSON objects")
        if message.get("type") == "start":
            rate = message.get("sample_rate")
            if rate != INPUT_SAMPLE_RATE:
                return error_frame(f"sample_rate {rate!r} refused: send mono PCM16 at {INPUT_SAMPLE_RATE} Hz")
            return None
        return error_frame(f"unknown message type {message.get('type')!r}")


def origin_allowed(origin: str, host: str | None, settings) -> bool:
    """A browser page may open /ws if it was served by this agent or its origin is allowed."""
    allowed = {o.strip().rstrip("/") for o in settings.allowed_origins.split(",") if o.strip()}
    return urlsplit(origin).netloc == host or origin.rstrip("/") in allowed


class ReplayedWebSocket:
    """The client's WebSocket, handing back first the messages read before the conversation was
    admitted; everything else is the WebSocket's own. Pipecat's transport (1.14) reads every
    message with `receive()` (tests/test_library_internals.py checks it still does)."""

    def __init__(self, websocket: WebSocket, early: list[dict]):
        self._websocket = websocket
        self._early = early

    async def receive(self) -> dict:
        return self._early.pop(0) if self._early else await self._websocket.receive()

    def __getattr__(self, name):
        return getattr(self._websocket, name)


async def messages_until_audio(websocket: WebSocket, deadline_secs: float) -> list[dict] | None:
    """The client's messages up to and including its first audio, or None when it sends no audio
    within `deadline_secs` (or too much else first, or leaves)."""
    messages: list[dict] = []
    deadline = time.monotonic() + deadline_secs
    while len(messages) <= MAX_MESSAGES_BEFORE_AUDIO:
        try:
            message = await asyncio.wait_for(websocket.receive(), max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            return None
        if message["type"] == "websocket.disconnect":
            return None
        messages.append(message)
        if message.get("bytes") is not None:
            return messages
    return None


def add_websocket_route(app: FastAPI, admission: Admission) -> None:
    @app.websocket("/ws")
    async def websocket_session(websocket: WebSocket, authorization: str | None = Header(None)):
        """A conversation over one plain WebSocket, for hosts that expose only HTTP. It lasts as
        long as the connection: one per client, for every turn. The slot is taken at the first
        audio message, so an idle connection holds none."""
        origin = websocket.headers.get("origin")
        if origin is not None and not origin_allowed(origin, websocket.headers.get("host"), admission.settings):
            await websocket.close(code=1008)  # before accepting: the page gets an HTTP 403
            return
        await websocket.accept()
        name = f"ws-{secrets.token_hex(4)}"
        try:
            # A connection waiting for its first audio costs a socket and this coroutine, no more.
            admission.check("websocket", authorization)
            deadline_secs = admission.settings.no_audio_timeout_secs
            early = await messages_until_audio(websocket, deadline_secs)
            if early is None:
                await refuse(websocket, 1008, f"no audio within {deadline_secs:.0f} s of connecting")
                return
            # The key was checked; a slot may have gone to someone else while this client got going.
            engines = admission.admit("websocket", name, authorization)
        except HTTPException as e:
            await refuse(websocket, 1008 if e.status_code == 401 else 1013, e.detail)  # policy / try again later
            return

        def build():
            conversation = build_conversation(
                lambda audio: FastAPIWebsocketTransport(
                    ReplayedWebSocket(websocket, early), FastAPIWebsocketParams(**audio, serializer=PCMJsonSerializer())
                ),
                engines,
                admission.settings,
                metrics=[admission.metrics],
            )
            conversation.follow_client(name)
            return conversation

        await admission.serve(name, build)


async def refuse(websocket: WebSocket, code: int, message: str) -> None:
    try:
        await websocket.send_json({"type": "error", "message": message})
        await websocket.close(code=code)
    except (RuntimeError, OSError):  # the client has gone already
        pass
