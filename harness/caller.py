"""`python -m harness.caller`: a caller in its own process that asks a running agent WAV questions over ws, p2p or LiveKit and logs what it sent and heard on time.monotonic()."""

import argparse
import asyncio
import json
import sys
import time
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from urllib.parse import urlsplit

import av
import httpx
import numpy as np
import soxr
from aiortc import MediaStreamTrack, RTCPeerConnection, RTCSessionDescription
from aiortc.mediastreams import MediaStreamError
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosed

from agent.transports.webrtc_audio import release_audio_packets_at_once
from agent.ws_client import read_wav_16k, write_wav
from services.audio import rms

MIC_RATE = 16000  # what the caller says, and what reply WAVs are saved at
FRAME_SECS = 0.02
FRAME_SAMPLES = int(MIC_RATE * FRAME_SECS)
FRAME_BYTES = FRAME_SAMPLES * 2
VOICED_RMS = 300.0  # on the int16 scale
GREETING_WAIT_SECS = 20.0  # the most the first question waits for the agent to fall quiet


class ConnectionFailed(Exception):
    """The agent could not be reached, refused the caller, or dropped the connection."""


@dataclass
class Heard:
    at: float  # time.monotonic() when the chunk arrived
    audio: bytes  # mono PCM16 at the transport's `rate`


@dataclass
class Clip:
    """One question being said; its times are those its frames were handed to the transport."""

    pcm: bytes
    started: float | None = None  # first frame
    voiced_end: float | None = None  # last frame with RMS > VOICED_RMS
    ended: float | None = None  # last frame
    done: asyncio.Event = field(default_factory=asyncio.Event)


class Microphone:
    """The caller's microphone, 20 ms at a time: the clip being said, else silence."""

    def __init__(self):
        self._clip: Clip | None = None
        self._offset = 0

    def say(self, pcm: bytes) -> Clip:
        self._clip, self._offset = Clip(pcm), 0
        return self._clip

    def next_frame(self) -> bytes:
        clip = self._clip
        if clip is None:
            return bytes(FRAME_BYTES)
        frame = clip.pcm[self._offset : self._offset + FRAME_BYTES].ljust(FRAME_BYTES, b"\0")
        self._offset += FRAME_BYTES
        now = time.monotonic()
        if clip.started is None:
            clip.started = now
        if rms(frame) > VOICED_RMS:
            clip.voiced_end = now
        if self._offset >= len(clip.pcm):
            clip.ended = now
            clip.done.set()
            self._clip = None
        return frame


class Transport:
    """A connection to the agent. `connect(mic)` joins and starts the microphone streaming
    (real-time, 20 ms frames, silence between clips); `heard` collects the agent's audio as it
    arrives, at `rate`; `failure` says why the connection ended, if it did; `session` is the
    agent's key for this conversation where the transport learns it (a LiveKit room, a peer id)."""

    rate: int
    heard: list
    failure: str | None = None
    session: str | None = None

    async def connect(self, mic: Microphone) -> None:
        raise NotImplementedError

    async def send_frame(self, frame: bytes) -> None:
        raise NotImplementedError

    def events(self) -> list[dict]:
        return []

    async def close(self) -> None:
        pump = getattr(self, "_pump_task", None)
        if pump is not None:
            pump.cancel()
            await asyncio.gather(pump, return_exceptions=True)

    def start_pump(self, mic: Microphone) -> None:
        """For transports that are pushed to: send `mic`'s frames at real-time pace, forever."""
        self._pump_task = asyncio.create_task(self._pump(mic))

    async def _pump(self, mic: Microphone) -> None:
        began, sent = time.monotonic(), 0
        try:
            while True:
                await self.send_frame(mic.next_frame())
                sent += 1
                late = time.monotonic() - (began + sent * FRAME_SECS)
                if late > 0.2:  # a stall: carry on from now rather than burst to catch up
                    began += late
                await asyncio.sleep(max(0.0, began + sent * FRAME_SECS - time.monotonic()))
        except ConnectionClosed:
            pass  # the receiver notes why


def bearer(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def post_json(url: str, api_key: str | None, body: dict | None = None) -> dict:
    async with httpx.AsyncClient(timeout=30) as http:
        try:
            response = await http.post(url, json=body, headers=bearer(api_key))
        except httpx.HTTPError as e:
            raise ConnectionFailed(f"POST {url} failed: {e!r}") from e
    if response.status_code != 200:
        raise ConnectionFailed(f"POST {url} answered {response.status_code}: {response.text[:300]}")
    return response.json()


class WebSocketTransport(Transport):
    """`/ws`: PCM16 16 kHz binary messages in, PCM16 24 kHz out; JSON text messages are events."""

    rate = 24000

    def __init__(self, agent: str, api_key: str | None):
        parts = urlsplit(agent)
        scheme = "wss" if parts.scheme == "https" else "ws"
        self.url = f"{scheme}://{parts.netloc}/ws"
        self.api_key = api_key
        self.heard: list[Heard] = []
        self._events: list[dict] = []

    async def connect(self, mic: Microphone) -> None:
        try:
            self._ws = await ws_connect(
                self.url, additional_headers=bearer(self.api_key) or None, max_size=2**22, open_timeout=20
            )
        except (OSError, TimeoutError) as e:
            raise ConnectionFailed(f"could not connect to {self.url}: {e!r}") from e
        except Exception as e:  # websockets' handshake errors (e.g. InvalidStatus)
            raise ConnectionFailed(f"could not connect to {self.url}: {e}") from e
        self._receiver = asyncio.create_task(self._receive())
        try:
            await self._ws.send(json.dumps({"type": "start", "sample_rate": MIC_RATE}))
        except ConnectionClosed as e:  # refused (wrong key, no capacity): the receiver has the reason
            await asyncio.gather(self._receiver, return_exceptions=True)
            raise ConnectionFailed(self.failure or f"{self.url} closed at once") from e
        self.start_pump(mic)

    async def _receive(self) -> None:
        try:
            async for message in self._ws:
                if isinstance(message, bytes):
                    self.heard.append(Heard(time.monotonic(), message))
                else:
                    try:
                        self._events.append(json.loads(message))
                    except ValueError:
                        pass
        except ConnectionClosed:
            pass
        errors = [e.get("message") for e in self._events if e.get("type") == "error"]
        detail = f": {errors[-1]}" if errors else ""
        self.failure = self.failure or f"the agent closed the WebSocket (code {self._ws.close_code}){detail}"

    async def send_frame(self, frame: bytes) -> None:
        await self._ws.send(frame)

    def events(self) -> list[dict]:
        return self._events

    async def close(self) -> None:
        await super().close()
        await self._ws.close()
        await asyncio.gather(self._receiver, return_exceptions=True)


class MicrophoneTrack(MediaStreamTrack):
    """An aiortc audio track that plays a `Microphone`, paced like a sound card."""

    kind = "audio"

    def __init__(self, mic: Microphone):
        super().__init__()
        self._mic = mic
        self._sent = 0
        self._began: float | None = None

    async def recv(self) -> av.AudioFrame:
        if self._began is None:
            self._began = time.monotonic()
        delay = self._began + self._sent / MIC_RATE - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        samples = np.frombuffer(self._mic.next_frame(), dtype=np.int16)
        frame = av.AudioFrame.from_ndarray(samples[None, :], format="s16", layout="mono")
        frame.sample_rate = MIC_RATE
        frame.pts = self._sent
        frame.time_base = Fraction(1, MIC_RATE)
        self._sent += FRAME_SAMPLES
        return frame


class PeerTransport(Transport):
    """A direct WebRTC peer (aiortc): offer to `/api/offer`; the agent's track decodes at 48 kHz."""

    rate = 48000

    def __init__(self, agent: str, api_key: str | None):
        self.url = agent.rstrip("/") + "/api/offer"
        self.api_key = api_key
        self.heard: list[Heard] = []
        self._events: list[dict] = []
        self._recorder: asyncio.Task | None = None

    async def connect(self, mic: Microphone) -> None:
        self.pc = RTCPeerConnection()
        self.pc.addTrack(MicrophoneTrack(mic))
        # As the browser client does; without it the agent's RTVI messages pile up unsent.
        channel = self.pc.createDataChannel("rtvi")
        channel.on("message", self._on_message)
        agent_track: asyncio.Future = asyncio.get_running_loop().create_future()

        @self.pc.on("track")
        def on_track(track: MediaStreamTrack) -> None:
            if track.kind == "audio" and not agent_track.done():
                agent_track.set_result(track)

        @self.pc.on("connectionstatechange")
        def on_state() -> None:
            if self.pc.connectionState in ("failed", "closed"):
                self.failure = self.failure or f"the peer connection is {self.pc.connectionState}"

        # aiortc gathers every ICE candidate before setLocalDescription returns: the offer is complete.
        await self.pc.setLocalDescription(await self.pc.createOffer())
        offer = {"sdp": self.pc.localDescription.sdp, "type": self.pc.localDescription.type}
        answer = await post_json(self.url, self.api_key, offer)
        self.session = answer.get("pc_id")
        await self.pc.setRemoteDescription(RTCSessionDescription(answer["sdp"], answer["type"]))
        # aiortc's jitter buffer holds four packets (80 ms) before it plays one; a browser's, on a
        # clean loopback link, one or two. The agent's audio is heard as it arrives, in order.
        for receiver in self.pc.getReceivers():
            if receiver.track.kind == "audio":
                release_audio_packets_at_once(receiver)
        try:
            track = await asyncio.wait_for(agent_track, timeout=15)
        except TimeoutError as e:
            raise ConnectionFailed("the agent's audio track never arrived") from e
        self._recorder = asyncio.create_task(self._record(track))
        # The agent attaches its output once its pipeline runs: the first frame means it listens.
        deadline = time.monotonic() + 30
        while not self.heard:
            if self.failure or time.monotonic() > deadline:
                raise ConnectionFailed(self.failure or "no audio from the agent within 30 s of connecting")
            await asyncio.sleep(0.02)

    def _on_message(self, message: str | bytes) -> None:
        try:
            event = json.loads(message)
        except ValueError:
            return
        if isinstance(event, dict):
            self._events.append(event)

    def events(self) -> list[dict]:
        return self._events

    async def _record(self, track: MediaStreamTrack) -> None:
        try:
            while True:
                frame = await track.recv()
                channels = len(frame.layout.channels)
                # Decoded Opus is packed (interleaved) s16: one row of samples × channels.
                samples = frame.to_ndarray().reshape(-1, channels).mean(axis=1).astype(np.int16)
                self.rate = frame.sample_rate
                self.heard.append(Heard(time.monotonic(), samples.tobytes()))
        except MediaStreamError:
            self.failure = self.failure or "the agent's audio track ended"

    async def close(self) -> None:
        if self._recorder is not None:
            self._recorder.cancel()
            await asyncio.gather(self._recorder, return_exceptions=True)
        await self.pc.close()


class LiveKitTransport(Transport):
    """A LiveKit room from `/api/session`, joined as `harness.livekit_caller.LiveKitCaller` (16 kHz out)."""

    rate = 16000

    def __init__(self, agent: str, api_key: str | None):
        self.url = agent.rstrip("/") + "/api/session"
        self.api_key = api_key
        self.caller = None

    @property
    def heard(self) -> list:  # LiveKitCaller's chunks: `.at` and `.audio` (PCM16 16 kHz)
        return self.caller.heard if self.caller is not None else []

    async def connect(self, mic: Microphone) -> None:
        from harness.livekit_caller import LiveKitCaller  # the LiveKit SDK loads only when used

        session = await post_json(self.url, self.api_key)
        self.session = session.get("room")
        self.caller = LiveKitCaller(session["url"], session["token"])
        try:
            await self.caller.join()
            await self.caller.wait_for_agent()
        except Exception as e:
            raise ConnectionFailed(f"could not join LiveKit room {session.get('room')} at {session['url']}: {e!r}") from e
        self.start_pump(mic)

    async def send_frame(self, frame: bytes) -> None:
        # One frame at a time, paced by the caller's microphone (`speak()` paces itself per clip).
        await self.caller.send_frame(frame)

    def events(self) -> list[dict]:
        return self.caller.messages if self.caller is not None else []

    async def close(self) -> None:
        await super().close()
        if self.caller is not None:
            await self.caller.leave()


TRANSPORTS = {"ws": WebSocketTransport, "p2p": PeerTransport, "livekit": LiveKitTransport}


@dataclass
class Options:
    quiet_secs: float = 1.5
    answer_cap_secs: float = 15.0
    reply_cap_secs: float = 45.0
    lead_in_secs: float = 1.0


class Caller:
    """One conversation: a greeting's worth of waiting, then each question and its reply."""

    def __init__(self, transport: Transport, options: Options):
        self.transport = transport
        self.options = options
        self.mic = Microphone()

    def _check(self) -> None:
        if self.transport.failure:
            raise ConnectionFailed(self.transport.failure)

    def _last_voiced(self, since: float) -> float | None:
        voiced = [c.at for c in self.transport.heard if c.at >= since and rms(c.audio) > VOICED_RMS]
        return voiced[-1] if voiced else None

    async def wait_out_greeting(self) -> None:
        """Silence for the lead-in, then until the agent has been quiet for `quiet_secs` (at most 20 s)."""
        await asyncio.sleep(self.options.lead_in_secs)
        quiet_from = time.monotonic()
        deadline = quiet_from + GREETING_WAIT_SECS
        scanned, last_voiced = 0, quiet_from
        while time.monotonic() < deadline:
            self._check()
            heard = self.transport.heard
            for chunk in heard[scanned:]:
                if rms(chunk.audio) > VOICED_RMS:
                    last_voiced = max(last_voiced, chunk.at)
            scanned = len(heard)
            if time.monotonic() - last_voiced >= self.options.quiet_secs:
                return
            await asyncio.sleep(0.05)

    async def ask(self, pcm: bytes) -> dict:
        """Say `pcm`, keep the microphone open (silent), and time the agent's reply."""
        clip = self.mic.say(pcm)
        while not clip.done.is_set():
            self._check()
            await asyncio.sleep(0.05)
        voiced_end = clip.voiced_end if clip.voiced_end is not None else clip.ended
        first = last = None
        scanned, end = 0, None
        while end is None:
            self._check()
            heard = self.transport.heard
            for chunk in heard[scanned:]:
                if chunk.at >= voiced_end and rms(chunk.audio) > VOICED_RMS:
                    first = chunk.at if first is None else first
                    last = chunk.at
            scanned = len(heard)
            now = time.monotonic()
            if first is None and now >= voiced_end + self.options.answer_cap_secs:
                end = voiced_end + self.options.answer_cap_secs
            elif first is not None and (now - last >= self.options.quiet_secs or now >= first + self.options.reply_cap_secs):
                end = now
            else:
                await asyncio.sleep(0.02)
        reply = [c for c in self.transport.heard if voiced_end <= c.at < end]
        rate = self.transport.rate
        voiced_seconds = sum(len(c.audio) / 2 / rate for c in reply if rms(c.audio) > VOICED_RMS)
        audio = np.frombuffer(b"".join(c.audio for c in reply), dtype=np.int16)
        if rate != MIC_RATE and audio.size:
            audio = soxr.resample(audio, rate, MIC_RATE)
        return {
            "speech_started": clip.started,
            "voiced_end": voiced_end,
            "first_heard": first,
            "last_heard": last,
            "voice_to_voice": None if first is None else first - voiced_end,
            "reply_audio": audio.astype(np.int16).tobytes(),
            "reply_voiced_seconds": round(voiced_seconds, 3),
        }


async def run(args: argparse.Namespace) -> int:
    questions = [(path, read_wav_16k(Path(path))) for path in args.wav]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    options = Options(args.quiet_secs, args.answer_cap_secs, args.reply_cap_secs, args.lead_in_secs)
    transport = TRANSPORTS[args.transport](args.agent, args.api_key)
    caller = Caller(transport, options)
    turns: list[dict] = []
    failure = None
    try:
        await transport.connect(caller.mic)
        await caller.wait_out_greeting()
        for n, (path, pcm) in enumerate(questions, start=1):
            turn = await caller.ask(pcm)
            reply_wav = out / f"reply-{n:02d}.wav"
            write_wav(reply_wav, turn.pop("reply_audio"), MIC_RATE)
            turns.append({"wav": str(path), **turn, "reply_wav": str(reply_wav)})
            if turn["first_heard"] is None:
                print(f"turn {n} {args.transport} {path}: no reply within {options.answer_cap_secs:g} s", flush=True)
            else:
                print(
                    f"turn {n} {args.transport} {path}: voice_to_voice {turn['voice_to_voice']:.2f} s, "
                    f"reply {turn['last_heard'] - turn['first_heard']:.1f} s "
                    f"({turn['reply_voiced_seconds']:.1f} s voiced) -> {reply_wav}",
                    flush=True,
                )
    except ConnectionFailed as e:
        failure = str(e)
    finally:
        events = transport.events()
        try:
            await transport.close()
        except Exception:
            pass
    (out / "turns.json").write_text(json.dumps({"transport": args.transport, "session": transport.session, "turns": turns}, indent=2) + "\n")
    if events:
        (out / "events.json").write_text(json.dumps(events, indent=1, default=str) + "\n")
    if failure:
        print(f"harness.caller: {args.transport} connection to {args.agent} failed: {failure}", file=sys.stderr)
        return 2
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m harness.caller", description=__doc__)
    parser.add_argument("--transport", choices=sorted(TRANSPORTS), required=True)
    parser.add_argument("--agent", required=True, help="the agent's base URL, e.g. http://127.0.0.1:7860")
    parser.add_argument("--api-key", help="sent as `Authorization: Bearer KEY`")
    parser.add_argument("--wav", action="append", required=True, help="a question (16 kHz mono PCM16 WAV); repeat for more turns")
    parser.add_argument("--out", required=True, help="folder for turns.json and reply-NN.wav")
    parser.add_argument("--quiet-secs", type=float, default=1.5, help="a reply is over after this long without voiced audio")
    parser.add_argument("--answer-cap-secs", type=float, default=15.0, help="no reply if nothing voiced arrives this long after the question")
    parser.add_argument("--reply-cap-secs", type=float, default=45.0, help="a reply is cut off this long after it began")
    parser.add_argument("--lead-in-secs", type=float, default=1.0, help="silence sent before waiting out a greeting")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return asyncio.run(run(args))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
