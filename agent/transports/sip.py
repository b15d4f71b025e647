"""Phone calls over SIP (pjsua2): the process' one SIP endpoint, who may call, and one conversation per answered call."""

import asyncio
import functools
import hashlib
import hmac
import ipaddress
import queue
import re
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

import numpy as np
import pjsua2 as pj
import soxr
from fastapi import FastAPI, Header, HTTPException, Request
from fastapi.responses import JSONResponse
from loguru import logger
from pydantic import BaseModel, Field
from pipecat.frames.frames import (
    Frame,
    InputAudioRawFrame,
    InputDTMFFrame,
    InterruptionFrame,
    OutputAudioRawFrame,
    StartFrame,
)
from pipecat.audio.dtmf.types import KeypadEntry
from pipecat.processors.frame_processor import FrameDirection
from pipecat.transports.base_input import BaseInputTransport
from pipecat.transports.base_output import BaseOutputTransport
from pipecat.transports.base_transport import BaseTransport, TransportParams

from agent.conversation import build_conversation
from agent.server.admission import RETRY_AFTER_SECS, Admission
from agent.server.auth import check_api_key
from services.audio import INPUT_SAMPLE_RATE, OUTPUT_SAMPLE_RATE

# pjmedia's conference bridge runs every call at one clock rate and converts each codec to it on
# the way in and out (PCMU/PCMA at 8 kHz, G.722 at 16 kHz): at the pipeline's input rate, the
# caller's audio is resampled once, by the bridge, and the agent's 24 kHz once, by soxr, here.
BRIDGE_RATE = INPUT_SAMPLE_RATE
FRAME_MS = 20
FRAME_BYTES = BRIDGE_RATE * FRAME_MS // 1000 * 2
# The agent's audio is written at most this far ahead of what the bridge has played: the bridge's
# clock paces the conversation, and an interruption has little queued audio left to cut.
PLAYBACK_AHEAD_SECS = 0.1
# Caller audio waiting for a conversation whose pipeline is not running yet (or is stalled); past
# this the newest frames are dropped rather than growing without bound.
MAX_QUEUED_FRAMES = 500
# What the endpoint offers, best first; every other codec the build has is disabled. Opus is used
# when the build has it (pjsua2-python 2.15.1.post1 does not).
CODEC_PRIORITIES = {"opus/48000/2": 210, "G722/16000/1": 200, "PCMU/8000/1": 190, "PCMA/8000/1": 180}
MAX_CALLS = 32  # pjsua's compiled-in ceiling (PJSUA_MAX_CALLS): calls past capacity still get a 486
EVENT_POLL_MS = 10
DIGEST_REALM = "voice-agent"
NONCE_TTL_SECS = 60
MAX_NONCES = 1024
SHUTDOWN_GRACE_SECS = 5
# RFC 3261 timer H (64 × T1): how long an answered call may wait for its ACK, and how long a call
# the agent places may ring unanswered.
CONFIRM_TIMEOUT_SECS = 32.0
# What may be dialled: a number (through SIP_TRUNK), or a sip:/sips: URI with no spaces or angle brackets.
DIALLED_NUMBER = re.compile(r"^\+?[0-9*#]{1,32}$")
SIP_URI = re.compile(r"^sips?:[^\s<>\"]+$")
DIGEST_FIELD = re.compile(r'(\w+)=(?:"([^"]*)"|([^\s,]+))')  # key="quoted" or key=bare


# --- who may call -------------------------------------------------------------------------------


def parse_sources(allowed: str) -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
    """SIP_ALLOWED_SOURCES as networks; a bad entry is a clear error at start-up."""
    networks = []
    for entry in allowed.split(","):
        entry = entry.strip()
        if entry:
            try:
                networks.append(ipaddress.ip_network(entry, strict=False))
            except ValueError as e:
                raise ValueError(f"SIP_ALLOWED_SOURCES: {entry!r} is not an address or CIDR") from e
    return networks


def source_host(address: str) -> str:
    """The host of pjsip's "ip:port" / "[v6]:port" source address."""
    if address.startswith("["):
        return address[1 : address.index("]")]
    return address.rsplit(":", 1)[0] if address.count(":") == 1 else address


def source_allowed(address: str, networks) -> bool:
    try:
        host = ipaddress.ip_address(source_host(address))
    except ValueError:
        return False
    return any(host in network for network in networks)


class PlacedCall(BaseModel):
    to: str = Field(max_length=256, description="a phone number (dialled through SIP_TRUNK) or a sip: URI")


def dial_uri(target: str, trunk: str | None) -> str:
    """The URI to call for `target`: a sip: URI as given, a number at the trunk's host
    ("+4930123" with SIP_TRUNK sip:trunk.example.com;transport=tcp → sip:+4930123@trunk.example.com;transport=tcp)."""
    target = target.strip()
    if SIP_URI.match(target):
        return target
    if not DIALLED_NUMBER.match(target):
        raise ValueError(f"not a phone number or sip: URI: {target!r}")
    if trunk is None or not SIP_URI.match(trunk):
        raise ValueError("dialling a number needs SIP_TRUNK (sip:HOST[:PORT][;transport=...])")
    scheme, _, rest = trunk.partition(":")
    host = rest.split("@")[-1]  # a trunk given as sip:user@host keeps its host only
    return f"{scheme}:{target}@{host}"


class DigestChallenge:
    """RFC 2617 digest authentication of INVITEs against SIP_USERNAME/SIP_PASSWORD, with nonces
    this endpoint issued, each good for one call within NONCE_TTL_SECS (a captured INVITE cannot
    be replayed)."""

    def __init__(self, username: str, password: str):
        self._username = username
        self._password = password
        self._nonces: OrderedDict[str, float] = OrderedDict()

    def challenge(self) -> str:
        """The WWW-Authenticate value of a 401."""
        nonce = secrets.token_hex(16)
        self._nonces[nonce] = time.monotonic()
        while len(self._nonces) > MAX_NONCES:
            self._nonces.popitem(last=False)
        return f'Digest realm="{DIGEST_REALM}", nonce="{nonce}", algorithm=MD5, qop="auth"'

    def verify(self, authorization: str, method: str = "INVITE") -> bool:
        fields = {key.lower(): quoted or bare for key, quoted, bare in DIGEST_FIELD.findall(authorization)}
        issued = self._nonces.get(fields.get("nonce", ""))
        if issued is None or time.monotonic() - issued > NONCE_TTL_SECS:
            return False
        if fields.get("username") != self._username or fields.get("realm") != DIGEST_REALM:
            return False

        def md5(text: str) -> str:
            return hashlib.md5(text.encode()).hexdigest()

        ha1 = md5(f"{self._username}:{DIGEST_REALM}:{self._password}")
        ha2 = md5(f"{method}:{fields.get('uri', '')}")
        if fields.get("qop") == "auth":
            expected = md5(f"{ha1}:{fields['nonce']}:{fields.get('nc', '')}:{fields.get('cnonce', '')}:auth:{ha2}")
        else:
            expected = md5(f"{ha1}:{fields['nonce']}:{ha2}")
        if not hmac.compare_digest(expected, fields.get("response", "")):
            return False
        del self._nonces[fields["nonce"]]
        return True


def header_of(message: str, name: str) -> str | None:
    """The first `name:` header of a raw SIP message (its head only)."""
    head = message.split("\r\n\r\n", 1)[0]
    for line in head.split("\r\n")[1:]:
        key, _, value = line.partition(":")
        if key.strip().lower() == name.lower():
            return value.strip()
    return None


# --- one call's audio between pjsua2's threads and the conversation's event loop ----------------


class CallAudio:
    """What one call hears and says, handed between pjsip's threads and the conversation's loop.

    pjsip threads put events (`("audio", pcm)`, `("digit", "5")`, `("connected", None)`,
    `("disconnected", None)`) on `events` with `loop.call_soon_threadsafe`; the agent's speech
    waits in a small buffer that the bridge's clock thread drains 20 ms at a time.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, name: str):
        self.loop = loop
        self.name = name
        self.events: asyncio.Queue[tuple[str, object]] = asyncio.Queue()
        self._playback = bytearray()
        self._lock = threading.Lock()
        self._dropped = 0
        self.ended = False

    # pjsip threads

    def post(self, kind: str, value: object = None) -> None:
        try:
            self.loop.call_soon_threadsafe(self._enqueue, kind, value)
        except RuntimeError:  # the loop has closed: the process is shutting down
            pass

    def heard(self, pcm: bytes) -> None:
        """20 ms of the caller at BRIDGE_RATE (the bridge's clock thread)."""
        self.post("audio", pcm)

    def next_frame(self) -> bytes:
        """The agent's next 20 ms for the caller, silence when there is none (the clock thread)."""
        with self._lock:
            chunk = bytes(self._playback[:FRAME_BYTES])
            del self._playback[:FRAME_BYTES]
        return chunk + b"\x00" * (FRAME_BYTES - len(chunk))

    # the conversation's loop

    def _enqueue(self, kind: str, value: object) -> None:
        if kind == "audio" and self.events.qsize() >= MAX_QUEUED_FRAMES:
            self._dropped += 1
            if self._dropped in (1, 100) or self._dropped % 1000 == 0:
                logger.warning(f"call {self.name}: {self._dropped} frames of caller audio dropped (the conversation is not reading)")
            return
        if kind == "disconnected":
            self.ended = True
        self.events.put_nowait((kind, value))

    def play(self, pcm: bytes) -> None:
        with self._lock:
            self._playback += pcm

    def clear_playback(self) -> None:
        with self._lock:
            self._playback.clear()

    @property
    def queued_secs(self) -> float:
        return len(self._playback) / 2 / BRIDGE_RATE


# --- the Pipecat transport of one call -----------------------------------------------------------


class SipInput(BaseInputTransport):
    """The caller's audio and keypad into the pipeline; tells the transport when the call connects and ends."""

    def __init__(self, transport: "SipTransport", audio: CallAudio, params: TransportParams, **kwargs):
        super().__init__(params, **kwargs)
        self._transport = transport
        self._audio = audio
        self._receive_task = None

    async def start(self, frame: StartFrame):
        await super().start(frame)
        await self.set_transport_ready(frame)
        if self._receive_task is None:
            self._receive_task = self.create_task(self._receive())

    async def stop(self, frame):
        await super().stop(frame)
        await self._stop_receiving()

    async def cancel(self, frame):
        await super().cancel(frame)
        await self._stop_receiving()

    async def _stop_receiving(self) -> None:
        if self._receive_task is not None:
            await self.cancel_task(self._receive_task)
            self._receive_task = None

    async def _receive(self) -> None:
        while True:
            kind, value = await self._audio.events.get()
            if kind == "audio":
                await self.push_audio_frame(InputAudioRawFrame(audio=value, sample_rate=BRIDGE_RATE, num_channels=1))
            elif kind == "digit":
                await self.push_frame(InputDTMFFrame(button=KeypadEntry(value)))
            elif kind == "connected":
                await self._transport.call_event("on_client_connected", self._audio.name)
            elif kind == "disconnected":
                await self._transport.call_event("on_client_disconnected", self._audio.name)


class SipOutput(BaseOutputTransport):
    """The agent's 24 kHz speech to the caller at the bridge's rate, as fast as the bridge plays it."""

    def __init__(self, audio: CallAudio, params: TransportParams, **kwargs):
        super().__init__(params, **kwargs)
        self._audio = audio
        self._resampler = soxr.ResampleStream(OUTPUT_SAMPLE_RATE, BRIDGE_RATE, 1, dtype="int16")
        self._resampler_rate = OUTPUT_SAMPLE_RATE

    async def start(self, frame: StartFrame):
        await super().start(frame)
        await self.set_transport_ready(frame)

    async def process_frame(self, frame: Frame, direction: FrameDirection):
        await super().process_frame(frame, direction)
        if isinstance(frame, InterruptionFrame):
            self._audio.clear_playback()  # what the bridge has not played yet is not heard

    async def write_audio_frame(self, frame: OutputAudioRawFrame) -> bool:
        if self._audio.ended:
            return False
        if frame.sample_rate != self._resampler_rate:
            self._resampler = soxr.ResampleStream(frame.sample_rate, BRIDGE_RATE, 1, dtype="int16")
            self._resampler_rate = frame.sample_rate
        samples = np.frombuffer(frame.audio, dtype=np.int16)
        self._audio.play(self._resampler.resample_chunk(samples).tobytes())
        while self._audio.queued_secs > PLAYBACK_AHEAD_SECS and not self._audio.ended:
            await asyncio.sleep(FRAME_MS / 2000)
        return True


class SipTransport(BaseTransport):
    """One call as a Pipecat transport. Events: `on_client_connected` (media flows; the
    conversation greets), `on_client_disconnected` (the caller hung up; it ends).

    Call control for the agent's tools: `end_call` hangs up, `transfer_call` hands the caller
    to another number (REFER)."""

    def __init__(self, audio: CallAudio, params: TransportParams, endpoint: "SipEndpoint"):
        super().__init__(name=f"SipTransport-{audio.name}")
        self._audio = audio
        self._endpoint = endpoint
        self._input = SipInput(self, audio, params, name=f"SipInput-{audio.name}")
        self._output = SipOutput(audio, params, name=f"SipOutput-{audio.name}")
        self._register_event_handler("on_client_connected")
        self._register_event_handler("on_client_disconnected")

    def input(self) -> SipInput:
        return self._input

    def output(self) -> SipOutput:
        return self._output

    async def end_call(self) -> None:
        """Hang up; the conversation ends with the call."""
        self._endpoint.hang_up(self._audio.name)

    async def transfer_call(self, target: str | None = None) -> None:
        """Ask the caller's phone to call `target` (default SIP_TRANSFER_TO) instead: a blind
        transfer (REFER). The agent's call ends once the transfer succeeds; if it fails, the call
        goes on. Raises ValueError when there is nowhere to transfer to."""
        self._endpoint.transfer(self._audio.name, target)

    async def call_event(self, name: str, client: str) -> None:
        # BaseObject's protected event hooks, as Pipecat's transports use them
        # (frames/pipecat_internals.py: TRANSPORT_EVENT_HOOKS).
        await self._call_event_handler(name, client)


# --- pjsua2: the endpoint and its calls (only the events thread and pjmedia's clock call in) ------


def pjsip_callback(method):
    """A pjsua2 callback that logs its errors: an exception leaving a SWIG director method becomes
    a C++ exception inside pjsip, which aborts the whole process."""

    @functools.wraps(method)
    def guarded(self, *args):
        try:
            method(self, *args)
        except Exception:
            logger.exception(f"SIP: {method.__qualname__} failed")

    return guarded


class BridgePort(pj.AudioMediaPort):
    """A port on the conference bridge whose frames go to and come from one call's CallAudio.

    Ports are reused, never deleted while the bridge runs: pjmedia's clock thread may be inside
    a callback while Python tears the object down, which crashed the process. A port between
    calls (`audio` None) hears nothing and says silence.
    """

    def __init__(self, name: str):
        super().__init__()
        self.audio: CallAudio | None = None
        fmt = pj.MediaFormatAudio()
        fmt.init(pj.PJMEDIA_FORMAT_PCM, BRIDGE_RATE, 1, FRAME_MS * 1000, 16)
        self.createPort(name, fmt)

    @pjsip_callback
    def onFrameReceived(self, frame):
        audio = self.audio
        if audio is None:
            return
        if frame.type == pj.PJMEDIA_FRAME_TYPE_AUDIO and frame.size:
            audio.heard(bytes(frame.buf))
        else:
            audio.heard(b"\x00" * FRAME_BYTES)

    @pjsip_callback
    def onFrameRequested(self, frame):
        audio = self.audio
        frame.type = pj.PJMEDIA_FRAME_TYPE_AUDIO
        frame.buf = pj.ByteVector(audio.next_frame() if audio is not None else b"\x00" * FRAME_BYTES)
        frame.size = FRAME_BYTES


class AgentCall(pj.Call):
    """One call, answered (`outbound` False) or placed by the agent."""

    def __init__(self, endpoint: "SipEndpoint", account: pj.Account, call_id: int, audio: CallAudio, *, outbound: bool = False):
        super().__init__(account, call_id)
        self.endpoint = endpoint
        self.audio = audio
        self.outbound = outbound
        self.port: BridgePort | None = None
        self._announced = False

    @pjsip_callback
    def onCallState(self, prm):
        info = self.getInfo()
        if info.state == pj.PJSIP_INV_STATE_DISCONNECTED:
            self.endpoint.call_ended(self, info.lastStatusCode)
        elif info.state == pj.PJSIP_INV_STATE_CONFIRMED:
            self._announce()

    def _announce(self) -> None:
        """Tell the conversation the caller can hear it (it greets): once media flows, and for a
        call the agent placed, once it is answered too (early media is the callee's ringback)."""
        if self._announced or self.port is None:
            return
        if self.outbound and self.getInfo().state != pj.PJSIP_INV_STATE_CONFIRMED:
            return
        self._announced = True
        self.audio.post("connected")

    @pjsip_callback
    def onCallMediaState(self, prm):
        if not self.hasMedia():
            return
        # Connected again on every change: a re-INVITE (hold, codec change) replaces the stream.
        media = self.getAudioMedia(-1)
        first = self.port is None
        if first:
            self.port = self.endpoint.bridge_port(self.audio)
        media.startTransmit(self.port)
        self.port.startTransmit(media)
        self._announce()

    @pjsip_callback
    def onDtmfDigit(self, prm):
        # RFC 2833 events and SIP INFO (application/dtmf-relay) alike; pjsua reports both here.
        try:
            KeypadEntry(prm.digit)
        except ValueError:
            logger.warning(f"call {self.audio.name}: ignored keypad digit {prm.digit!r}")
            return
        self.audio.post("digit", prm.digit)

    @pjsip_callback
    def onCallTransferStatus(self, prm):
        # NOTIFYs of the REFER: the caller's phone reports how its call to the target goes.
        if not prm.finalNotify:
            return
        prm.cont = False
        if 200 <= prm.statusCode < 300:
            logger.info(f"call {self.audio.name}: transferred")
            self.hangup(pj.CallOpParam())
        else:
            logger.warning(f"call {self.audio.name}: the transfer failed ({prm.statusCode} {prm.reason}); the call goes on")


class AgentAccount(pj.Account):
    def __init__(self, endpoint: "SipEndpoint"):
        super().__init__()
        self.endpoint = endpoint

    @pjsip_callback
    def onIncomingCall(self, prm):
        self.endpoint.incoming(self, prm)


class SipEndpoint:
    """The process' one pjsua2 endpoint (UDP and TCP on SIP_PORT): answers calls from allowed
    sources (and with the right digest credentials, when set), one conversation per call through
    the same admission as every transport; 403 for strangers, 486 Busy Here at capacity.

    pjsua2 is driven by one thread of ours ("sip-events"): it polls pjsip's events and runs the
    commands the event loop posts (`_run_on_events_thread`), so no other thread of ours calls
    into pjsua2 or drops the last reference to a pjsua2 object. pjmedia's clock thread calls the
    bridge ports.
    """

    def __init__(self, admission: Admission):
        self._admission = admission
        settings = admission.settings
        self._settings = settings
        # Calls get their own echo setting (SIP_ECHO_CANCELLATION, off: carriers cancel line echo).
        self._call_settings = settings.model_copy(update={"echo_cancellation": settings.sip_echo_cancellation})
        self._sources = parse_sources(settings.sip_allowed_sources)
        self._digest = (
            DigestChallenge(settings.sip_username, settings.sip_password.get_secret_value())
            if settings.sip_username and settings.sip_password
            else None
        )
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._calls: dict[str, AgentCall] = {}  # by CallAudio.name; touched on the events thread only
        self._ports: list[BridgePort] = []  # every bridge port made (events thread)
        self._idle_ports: list[BridgePort] = []
        self._conversations: set[asyncio.Task] = set()
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._account: AgentAccount | None = None  # the events thread's
        self.listening = threading.Event()

    # --- the event loop's side

    async def start(self) -> None:
        """Start listening; raises if the port cannot be bound or pjsua2 fails to start."""
        self._loop = asyncio.get_running_loop()
        started: asyncio.Future = self._loop.create_future()
        self._thread = threading.Thread(target=self._events_thread, args=(started,), name="sip-events", daemon=True)
        self._thread.start()
        await started
        logger.info(f"SIP: answering calls on {self._settings.sip_host}:{self._settings.sip_port} (UDP, TCP)")

    async def stop(self) -> None:
        """Hang up every call, let their conversations end, then shut pjsua2 down."""
        if self._thread is None:
            return
        self._run_on_events_thread(lambda: pj.Endpoint.instance().hangupAllCalls())
        if self._conversations:
            _, stuck = await asyncio.wait(self._conversations, timeout=SHUTDOWN_GRACE_SECS)
            for task in stuck:
                task.cancel()
            await asyncio.gather(*stuck, return_exceptions=True)
        self._stopping.set()
        await asyncio.to_thread(self._thread.join, SHUTDOWN_GRACE_SECS + 5)
        self._thread = None

    @property
    def calls_held(self) -> int:
        """Calls pjsua2 holds for us: ringing, answered, or refused and not yet gone."""
        return len(self._calls)

    def _run_on_events_thread(self, command: Callable[[], None]) -> None:
        self._commands.put(command)

    def _admit(self, audio: CallAudio) -> None:
        """On the loop: take a slot and start the conversation, or refuse the call: 503 with
        Retry-After while the models load, 486 Busy Here when every slot is taken."""
        try:
            engines = self._admission.admit("sip", audio.name, None, authenticated=True)
        except HTTPException as e:
            loaded = self._admission.engines_of()
            if loaded is None or not loaded.ready:
                refusal = (503, e.detail, {"Retry-After": str(RETRY_AFTER_SECS)})
            else:
                refusal = (486, e.detail, {})
            logger.info(f"SIP: call {audio.name} refused: {e.detail}")
            self._run_on_events_thread(lambda: self._answer(audio.name, *refusal))
            return
        except Exception:
            logger.exception(f"SIP: call {audio.name} could not be admitted")
            self._run_on_events_thread(lambda: self._answer(audio.name, 500, "server error"))
            return
        self._start_conversation(audio, engines, lambda: self._answer(audio.name, 200))

    def place_call(self, target: str) -> str:
        """Call `target` (a number, through SIP_TRUNK, or a sip: URI) and converse once it is
        answered; the agent speaks first. Returns the call's name at once; raises ValueError for
        a target that cannot be dialled and HTTPException (503) when every slot is taken."""
        uri = dial_uri(target, self._settings.sip_trunk)
        audio = CallAudio(self._loop, f"sip-out-{secrets.token_hex(4)}")
        engines = self._admission.admit("sip", audio.name, None, authenticated=True)
        logger.info(f"SIP: placing call {audio.name}")  # not the number: it identifies a person
        self._start_conversation(audio, engines, lambda: self._dial(audio, uri))
        return audio.name

    def hang_up(self, name: str) -> None:
        self._run_on_events_thread(lambda: self._hang_up(name))

    def transfer(self, name: str, target: str | None = None) -> None:
        """REFER call `name` to `target` (a number through SIP_TRUNK, or a sip: URI), by default SIP_TRANSFER_TO."""
        target = target or self._settings.sip_transfer_to
        if not target:
            raise ValueError("nowhere to transfer to: set SIP_TRANSFER_TO")
        uri = dial_uri(target, self._settings.sip_trunk)
        self._run_on_events_thread(lambda: self._refer(name, uri))

    def _start_conversation(self, audio: CallAudio, engines, connect: Callable[[], None]) -> None:
        task = asyncio.create_task(self._converse(audio, engines, connect))
        self._conversations.add(task)
        task.add_done_callback(self._conversations.discard)

    async def _converse(self, audio: CallAudio, engines, connect: Callable[[], None]) -> None:
        """Run the conversation of a call whose slot is reserved; `connect` (on the events thread)
        answers or places it. The call ends with the conversation, however that ends."""

        def build():
            conversation = build_conversation(
                lambda params: SipTransport(audio, TransportParams(**params), self),
                engines,
                self._call_settings,
                metrics=[self._admission.metrics],
            )
            conversation.follow_client(audio.name)  # greets once media flows, ends when the caller hangs up
            return conversation

        self._run_on_events_thread(connect)
        unconfirmed = self._loop.call_later(
            CONFIRM_TIMEOUT_SECS, self._run_on_events_thread, lambda: self._hang_up_unless_confirmed(audio.name)
        )
        try:
            await self._admission.serve(audio.name, build)
        except Exception:
            logger.exception(f"call {audio.name}: the conversation could not start")
        finally:
            unconfirmed.cancel()
            self._run_on_events_thread(lambda: self._hang_up(audio.name))

    def add_routes(self, app: FastAPI) -> None:
        """POST /api/sip/calls {"to": NUMBER_OR_URI}: the agent places a call (202, {"call": name}).

        Placing calls costs money and reaches people, so it needs the API key; with none set,
        only a client on this machine may (the `voice-agent sip call` command)."""

        async def place(request: Request, body: PlacedCall, authorization: str | None = Header(None)):
            settings = self._settings
            if settings.api_key is not None:
                check_api_key(settings, authorization)
            elif request.client is None or request.client.host not in ("127.0.0.1", "::1"):
                raise HTTPException(403, "placing calls from another machine needs API_KEY to be set")
            try:
                name = self.place_call(body.to)
            except ValueError as e:
                raise HTTPException(400, str(e)) from e
            return JSONResponse({"call": name}, status_code=202)

        app.add_api_route("/api/sip/calls", place, methods=["POST"])

    # --- the events thread's side (pjsua2)

    def _events_thread(self, started: asyncio.Future) -> None:
        endpoint = pj.Endpoint()
        try:
            account = self._account = self._start_pjsua(endpoint)
        except Exception as e:
            logger.error(f"SIP: could not start the endpoint: {e!r}")
            self._loop.call_soon_threadsafe(started.set_exception, RuntimeError(f"SIP endpoint failed to start: {e}"))
            endpoint.libDestroy()
            return
        self._loop.call_soon_threadsafe(started.set_result, None)
        self.listening.set()
        try:
            while not self._stopping.is_set():
                endpoint.libHandleEvents(EVENT_POLL_MS)
                self._run_commands()
        finally:
            self.listening.clear()
            endpoint.hangupAllCalls()
            for _ in range(20):  # let the BYEs go out
                endpoint.libHandleEvents(EVENT_POLL_MS)
            endpoint.audDevManager().setNoDev()  # stops the bridge's clock: no port is called back now
            self._calls.clear()
            self._idle_ports.clear()
            self._ports.clear()
            account.shutdown()
            self._account = None
            del account
            endpoint.libDestroy()
            del endpoint

    def _run_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                command()
            except Exception:
                logger.exception("SIP: a call command failed")

    def _start_pjsua(self, endpoint: pj.Endpoint) -> AgentAccount:
        settings = self._settings
        endpoint.libCreate()
        config = pj.EpConfig()
        config.uaConfig.threadCnt = 0  # our events thread polls; pjsip starts no worker of its own
        config.uaConfig.maxCalls = MAX_CALLS
        config.uaConfig.userAgent = "voice-agent"
        config.logConfig.level = 2
        config.logConfig.consoleLevel = 2
        config.logConfig.msgLogging = False  # SIP messages carry callers' numbers and digest responses
        config.medConfig.clockRate = BRIDGE_RATE
        config.medConfig.sndClockRate = BRIDGE_RATE
        config.medConfig.channelCount = 1
        config.medConfig.audioFramePtime = FRAME_MS
        config.medConfig.ecTailLen = 0  # the conversation cancels echo itself (AEC3)
        config.medConfig.noVad = True  # keep RTP flowing through silences: carriers expect it
        endpoint.libInit(config)
        for kind in (pj.PJSIP_TRANSPORT_UDP, pj.PJSIP_TRANSPORT_TCP):
            transport = pj.TransportConfig()
            transport.port = settings.sip_port
            transport.boundAddress = settings.sip_host
            if settings.sip_public_address:
                transport.publicAddress = settings.sip_public_address
            endpoint.transportCreate(kind, transport)
        endpoint.libStart()
        endpoint.audDevManager().setNullDev()  # no sound card: the null device clocks the bridge
        for codec in endpoint.codecEnum2():
            endpoint.codecSetPriority(codec.codecId, CODEC_PRIORITIES.get(codec.codecId, 0))
        account_config = pj.AccountConfig()
        host = settings.sip_public_address or ("127.0.0.1" if settings.sip_host in ("0.0.0.0", "::") else settings.sip_host)
        account_config.idUri = f"sip:{settings.agent_name}@{host}:{settings.sip_port}"
        account_config.mediaConfig.transportConfig.port = settings.sip_rtp_port
        account_config.mediaConfig.transportConfig.portRange = settings.sip_rtp_port_range
        if settings.sip_public_address:
            account_config.mediaConfig.transportConfig.publicAddress = settings.sip_public_address
        elif settings.sip_host not in ("0.0.0.0", "::"):
            # Bound to one address, media stays on it too (SDP would name the default interface).
            account_config.mediaConfig.transportConfig.boundAddress = settings.sip_host
        if settings.sip_trunk_username and settings.sip_trunk_password:
            # Answers the trunk's digest challenge to the agent's own calls, whatever its realm.
            account_config.sipConfig.authCreds.append(
                pj.AuthCredInfo("digest", "*", settings.sip_trunk_username, 0, settings.sip_trunk_password.get_secret_value())
            )
        account = AgentAccount(self)
        account.create(account_config, True)
        return account

    def incoming(self, account: AgentAccount, prm) -> None:
        source = prm.rdata.srcAddress
        audio = CallAudio(self._loop, f"sip-{secrets.token_hex(4)}")
        call = AgentCall(self, account, prm.callId, audio)
        self._calls[audio.name] = call
        if not source_allowed(source, self._sources):
            logger.warning(f"SIP: refused a call from {source}: not in SIP_ALLOWED_SOURCES")
            self._answer(audio.name, 403, "source not allowed")
            return
        if self._digest is not None:
            authorization = header_of(prm.rdata.wholeMsg, "Authorization")
            if authorization is None:
                self._answer(audio.name, 401, "authentication required", {"WWW-Authenticate": self._digest.challenge()})
                return
            if not self._digest.verify(authorization):
                logger.warning(f"SIP: refused a call from {source}: wrong credentials")
                self._answer(audio.name, 403, "wrong credentials")
                return
        logger.info(f"SIP: call {audio.name} from {source}")
        self._loop.call_soon_threadsafe(self._admit, audio)

    def _answer(self, name: str, status: int, reason: str = "", headers: dict[str, str] | None = None) -> None:
        call = self._calls.get(name)
        if call is None:
            return  # the caller gave up (CANCEL) meanwhile
        param = pj.CallOpParam()
        param.statusCode = status
        if reason and status != 200:
            param.reason = reason
        for name, value in (headers or {}).items():
            header = pj.SipHeader()
            header.hName = name
            header.hValue = value
            param.txOption.headers.append(header)
        call.answer(param)

    def _dial(self, audio: CallAudio, uri: str) -> None:
        call = AgentCall(self, self._account, pj.PJSUA_INVALID_ID, audio, outbound=True)
        self._calls[audio.name] = call
        try:
            call.makeCall(uri, pj.CallOpParam(True))
        except pj.Error as e:
            logger.warning(f"SIP: call {audio.name} could not be placed: {e.reason}")
            self._calls.pop(audio.name, None)
            audio.post("disconnected")  # the conversation ends and frees its slot

    def _refer(self, name: str, uri: str) -> None:
        call = self._calls.get(name)
        if call is not None and call.isActive():
            logger.info(f"SIP: transferring call {name}")
            call.xfer(uri, pj.CallOpParam(True))

    def _hang_up_unless_confirmed(self, name: str) -> None:
        """A caller that never ACKs our 200 OK, or a callee that never answers: pjsip goes on
        waiting, so the call is ended here."""
        call = self._calls.get(name)
        if call is not None and call.isActive() and call.getInfo().state != pj.PJSIP_INV_STATE_CONFIRMED:
            logger.warning(f"SIP: call {name} was never confirmed (no ACK, or no answer); hanging up")
            call.hangup(pj.CallOpParam())

    def _hang_up(self, name: str) -> None:
        call = self._calls.get(name)
        if call is not None and call.isActive():
            call.hangup(pj.CallOpParam())

    def bridge_port(self, audio: CallAudio) -> BridgePort:
        """A bridge port for `audio`: an idle one, or a new one (as many as calls at once, at most)."""
        port = self._idle_ports.pop() if self._idle_ports else None
        if port is None:
            port = BridgePort(f"call-port-{len(self._ports)}")
            self._ports.append(port)
        port.audio = audio
        return port

    def call_ended(self, call: AgentCall, status: int) -> None:
        call.audio.post("disconnected")
        if call.port is not None:
            call.port.audio = None  # pjsua disconnected it from the call's stream already
            self._idle_ports.append(call.port)
            call.port = None
        # Dropped later on this thread (deleting a pjsua2 object elsewhere trips pjlib), once this
        # callback has returned: pjsua still uses the call while it runs.
        self._run_on_events_thread(lambda: self._calls.pop(call.audio.name, None))
