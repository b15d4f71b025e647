"""`voice-agent client`: talks to the agent over `/ws`, from the microphone or from WAV files."""

import asyncio
import json
import time
import wave
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import soxr
from websockets.asyncio.client import ClientConnection, connect

from services.audio import INPUT_SAMPLE_RATE, OUTPUT_SAMPLE_RATE

INPUT_RATE = INPUT_SAMPLE_RATE  # what /ws takes
OUTPUT_RATE = OUTPUT_SAMPLE_RATE  # what the agent sends
CHUNK_SECS = 0.02  # a microphone's 20 ms
REPLY_QUIET_SECS = 1.5  # after the agent stops this long, its response is over


def to_pcm16(audio: np.ndarray) -> bytes:
    """Float samples (nominally -1..1) → PCM16, clipped: an overshoot must not wrap around into a click."""
    return (np.clip(audio, -1.0, 1.0) * 32767).astype("<i2").tobytes()


def read_wav_16k(path: Path) -> bytes:
    """A WAV file (any rate, mono or stereo, PCM16) as mono PCM16 at 16 kHz."""
    with wave.open(str(path)) as wav:
        if wav.getsampwidth() != 2:
            raise ValueError(f"{path}: only 16-bit PCM WAV files are supported")
        audio = np.frombuffer(wav.readframes(wav.getnframes()), dtype="<i2").astype(np.float32) / 32768
        audio = audio.reshape(-1, wav.getnchannels()).mean(axis=1)
        return to_pcm16(soxr.resample(audio, wav.getframerate(), INPUT_RATE))


def write_wav(path: Path, pcm: bytes, rate: int = OUTPUT_RATE) -> None:
    with wave.open(str(path), "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(rate)
        wav.writeframes(pcm)


@dataclass
class Reply:
    """What the agent said in answer to one user turn."""

    heard: str = ""  # the user's words, as the agent transcribed them
    language: str | None = None  # the language the agent heard them in (a multilingual agent)
    text: str = ""  # the agent's words, as it spoke them
    audio: bytearray = field(default_factory=bytearray)  # PCM16 at OUTPUT_RATE


class VoiceClient:
    """One connection to the agent, kept for every turn (a new connection per turn costs a
    session start, and the conversation's context with it).

    `events` holds every JSON message received; `on_audio` (if set) gets each audio message as it
    arrives, e.g. a speaker's queue; `on_interrupted` is called when the agent says to drop it.
    """

    def __init__(self, url: str, *, api_key: str | None = None):
        self.url = url
        self.api_key = api_key
        self.events: list[dict] = []
        self.on_audio = None
        self.on_interrupted = None
        self._ws: ClientConnection | None = None
        self._receiver: asyncio.Task | None = None
        self._reply = Reply()
        self.audio_times: list[float] = []  # monotonic arrival time of each audio message
        self._changed = asyncio.Event()

    async def __aenter__(self) -> "VoiceClient":
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else None
        self._ws = await connect(self.url, additional_headers=headers, max_size=2**22)
        await self._ws.send(json.dumps({"type": "start", "sample_rate": INPUT_RATE}))
        self._receiver = asyncio.create_task(self._receive())
        return self

    async def __aexit__(self, *exc) -> None:
        await self._ws.close()
        if self._receiver is not None:
            await asyncio.gather(self._receiver, return_exceptions=True)

    @property
    def last_audio_at(self) -> float:
        return self.audio_times[-1] if self.audio_times else 0.0

    @property
    def closed(self) -> bool:
        return self._receiver is None or self._receiver.done()

    async def send(self, message: str | bytes) -> None:
        await self._ws.send(message)

    async def stream(self, pcm: bytes) -> None:
        """Send 16 kHz PCM16 in real time, 20 ms at a time, as a microphone would."""
        step = int(CHUNK_SECS * INPUT_RATE) * 2
        began = time.monotonic()
        for n, offset in enumerate(range(0, len(pcm), step)):
            await self._ws.send(pcm[offset : offset + step])
            await asyncio.sleep(max(0.0, began + (n + 1) * CHUNK_SECS - time.monotonic()))

    async def silence(self, seconds: float) -> None:
        await self.stream(bytes(2 * int(seconds * INPUT_RATE)))

    async def until_quiet(self, *, timeout: float = 60.0) -> None:
        """Keep the microphone open (silent) until the agent has said nothing for a while: a greeting."""
        deadline = time.monotonic() + timeout
        await self.silence(0.5)
        while time.monotonic() - self.last_audio_at < REPLY_QUIET_SECS and time.monotonic() < deadline:
            await self.silence(0.1)

    async def ask(self, pcm: bytes, *, timeout: float = 60.0) -> Reply:
        """Say `pcm` (16 kHz PCM16), keep the microphone open, and return the agent's whole reply."""
        self._reply = reply = Reply()
        await self.stream(pcm)
        deadline = time.monotonic() + timeout
        while not (reply.audio and time.monotonic() - self.last_audio_at > REPLY_QUIET_SECS):
            if self.closed:
                raise ConnectionError("the agent closed the connection")
            if time.monotonic() > deadline:
                raise TimeoutError(f"no complete reply within {timeout:.0f} s")
            await self.silence(0.1)
        return reply

    async def wait_for(self, event_type: str, *, after: int = 0, timeout: float = 30.0) -> dict:
        """The first event of `event_type` at index `after` or later in `events`."""
        deadline = time.monotonic() + timeout
        while True:
            for event in self.events[after:]:
                if event.get("type") == event_type:
                    return event
            if self.closed or time.monotonic() > deadline:
                raise TimeoutError(f"no {event_type!r} message")
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), deadline - time.monotonic())
            except TimeoutError:
                pass

    async def _receive(self) -> None:
        async for message in self._ws:
            if isinstance(message, bytes):
                self._reply.audio += message
                self.audio_times.append(time.monotonic())
                if self.on_audio is not None:
                    self.on_audio(message)
                continue
            event = json.loads(message)
            self.events.append(event)
            self._changed.set()
            data = event.get("data") or {}
            kind = event.get("type")
            if kind == "user-transcription" and data.get("final"):
                self._reply.heard = f"{self._reply.heard} {data.get('text', '')}".strip()
                self._reply.language = data.get("language") or self._reply.language
            elif kind == "bot-tts-text":  # one word, as it is played
                self._reply.text = f"{self._reply.text} {data.get('text', '')}".strip()
            elif kind == "interrupted":
                if self.on_interrupted is not None:
                    self.on_interrupted()


async def talk_from_files(url: str, inputs: list[Path], output: Path | None, api_key: str | None) -> list[Reply]:
    """One connection; each WAV is one user turn, answered before the next is said."""
    replies = []
    async with VoiceClient(url, api_key=api_key) as client:
        await client.until_quiet()
        for path in inputs:
            reply = await client.ask(read_wav_16k(path))
            print(f"you:   {reply.heard}", flush=True)
            print(f"agent: {reply.text}", flush=True)
            replies.append(reply)
    if output is not None:
        write_wav(output, b"".join(bytes(r.audio) for r in replies))
    return replies


async def talk_from_microphone(url: str, api_key: str | None) -> None:
    """Microphone in, speaker out, until Ctrl-C. Needs `sounddevice` (and PortAudio)."""
    try:
        import sounddevice
    except (ImportError, OSError) as e:
        raise SystemExit(f"microphone mode needs sounddevice and PortAudio ({e}); or use --input/--output")

    loop = asyncio.get_running_loop()
    microphone: asyncio.Queue[bytes] = asyncio.Queue()
    speaker = bytearray()  # PCM16 at OUTPUT_RATE, not yet played

    def captured(indata, frames, when, status):
        loop.call_soon_threadsafe(microphone.put_nowait, to_pcm16(indata[:, 0]))

    def play(outdata, frames, when, status):
        wanted = frames * 2
        chunk, speaker[:wanted] = bytes(speaker[:wanted]), b""
        samples = np.frombuffer(chunk.ljust(wanted, b"\0"), dtype="<i2").astype(np.float32) / 32768
        outdata[:, 0] = np.clip(samples, -1.0, 1.0)

    async with VoiceClient(url, api_key=api_key) as client:
        client.on_audio = speaker.extend
        client.on_interrupted = speaker.clear
        blocksize = int(CHUNK_SECS * INPUT_RATE)
        with sounddevice.InputStream(INPUT_RATE, blocksize, channels=1, dtype="float32", callback=captured), \
                sounddevice.OutputStream(OUTPUT_RATE, channels=1, dtype="float32", callback=play):
            print("talking to the agent; Ctrl-C to stop", flush=True)
            while not client.closed:
                await client.send(await microphone.get())
