"""A scripted LiveKit participant: speaks PCM16 into a room and records what it hears (tests, benchmarks)."""

import asyncio
import json
import time
from dataclasses import dataclass, field

import numpy as np
from livekit import rtc

from services.audio import INPUT_SAMPLE_RATE, rms

SAMPLE_RATE = INPUT_SAMPLE_RATE
FRAME_SAMPLES = SAMPLE_RATE // 50  # 20 ms, like a browser's microphone


@dataclass
class HeardChunk:
    at: float  # time.monotonic() when the chunk arrived
    audio: bytes  # PCM16 mono at SAMPLE_RATE

    @property
    def energy(self) -> float:
        return rms(self.audio)


@dataclass
class LiveKitCaller:
    url: str
    token: str
    heard: list[HeardChunk] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)  # JSON data messages (the agent's RTVI events)
    room: rtc.Room = field(default_factory=rtc.Room)
    # Created before connecting: the agent's track can be subscribed while connect() runs.
    _readers: list[asyncio.Task] = field(default_factory=list)

    async def join(self, timeout: float = 20.0) -> None:
        """Connect, publish a microphone track, and record the first remote audio track."""
        self.room.on("track_subscribed", self._on_track)
        self.room.on("data_received", self._on_data)
        await asyncio.wait_for(self.room.connect(self.url, self.token), timeout)
        self._source = rtc.AudioSource(SAMPLE_RATE, 1)
        track = rtc.LocalAudioTrack.create_audio_track("microphone", self._source)
        options = rtc.TrackPublishOptions(source=rtc.TrackSource.SOURCE_MICROPHONE)
        await self.room.local_participant.publish_track(track, options)

    def _on_track(self, track: rtc.Track, _publication, participant: rtc.RemoteParticipant) -> None:
        if track.kind == rtc.TrackKind.KIND_AUDIO:
            self._readers.append(asyncio.ensure_future(self._record(track)))

    def _on_data(self, packet: rtc.DataPacket) -> None:
        try:
            message = json.loads(packet.data)
        except ValueError:
            return
        if isinstance(message, dict):
            self.messages.append(message)

    def agents(self) -> list[rtc.RemoteParticipant]:
        """The agent participants in the room now."""
        return [
            p for p in self.room.remote_participants.values()
            if p.kind == rtc.ParticipantKind.PARTICIPANT_KIND_AGENT
        ]

    async def _record(self, track: rtc.Track) -> None:
        stream = rtc.AudioStream(track, sample_rate=SAMPLE_RATE, num_channels=1)
        async for event in stream:
            self.heard.append(HeardChunk(time.monotonic(), bytes(event.frame.data)))

    async def wait_for_agent(self, timeout: float = 30.0) -> None:
        """Until the agent's audio track is being received."""
        deadline = time.monotonic() + timeout
        while not self._readers:
            if time.monotonic() > deadline:
                raise TimeoutError("the agent never published audio into the room")
            await asyncio.sleep(0.05)

    async def send_frame(self, pcm: bytes) -> None:
        """One microphone frame (PCM16 mono at SAMPLE_RATE) now; the caller keeps the pace."""
        samples = len(pcm) // 2
        await self._source.capture_frame(rtc.AudioFrame(pcm, SAMPLE_RATE, 1, samples))

    async def speak(self, pcm: bytes) -> tuple[float, float]:
        """Send mono PCM16 at 16 kHz at real-time pace; returns (first, last) sample sent, monotonic."""
        samples = np.frombuffer(pcm, dtype=np.int16)
        started = time.monotonic()
        for i, offset in enumerate(range(0, samples.size, FRAME_SAMPLES)):
            chunk = samples[offset : offset + FRAME_SAMPLES]
            if chunk.size < FRAME_SAMPLES:
                chunk = np.pad(chunk, (0, FRAME_SAMPLES - chunk.size))
            frame = rtc.AudioFrame(chunk.tobytes(), SAMPLE_RATE, 1, FRAME_SAMPLES)
            await self._source.capture_frame(frame)
            await asyncio.sleep(max(0.0, started + (i + 1) * 0.02 - time.monotonic()))
        return started, time.monotonic()

    async def silence(self, seconds: float) -> None:
        await self.speak(b"\x00\x00" * int(seconds * SAMPLE_RATE))

    def audio(self, start: float = 0.0, end: float = float("inf")) -> bytes:
        return b"".join(c.audio for c in self.heard if start <= c.at < end)

    def first_voice_after(self, start: float, threshold: float = 300.0) -> float | None:
        """When agent audio above `threshold` RMS first arrived after `start`."""
        return next((c.at for c in self.heard if c.at >= start and c.energy > threshold), None)

    def last_voice_between(self, start: float, end: float, threshold: float = 300.0) -> float | None:
        voiced = [c.at for c in self.heard if start <= c.at < end and c.energy > threshold]
        return voiced[-1] if voiced else None

    async def leave(self) -> None:
        for reader in self._readers:
            reader.cancel()
        await self.room.disconnect()
