"""An in-process transport: the microphone is a coroutine call, the speaker a list (tests, benchmarks, scripted use)."""

import asyncio
import time
from dataclasses import dataclass

from pipecat.frames.frames import InputAudioRawFrame, OutputAudioRawFrame, StartFrame
from pipecat.processors.frame_processor import FrameProcessor
from pipecat.transports.base_input import BaseInputTransport
from pipecat.transports.base_output import BaseOutputTransport
from pipecat.transports.base_transport import BaseTransport, TransportParams

from services.audio import INPUT_SAMPLE_RATE

FRAME_MS = 20


@dataclass
class PlayedChunk:
    started_at: float  # pipeline clock (seconds) when this chunk started playing
    audio: bytes
    sample_rate: int

    @property
    def seconds(self) -> float:
        return len(self.audio) / 2 / self.sample_rate


class MemoryInput(BaseInputTransport):
    def __init__(self, params: TransportParams, **kwargs):
        super().__init__(params, **kwargs)
        self.started = asyncio.Event()  # set once the pipeline is running

    async def start(self, frame: StartFrame):
        await super().start(frame)
        await self.set_transport_ready(frame)
        self.started.set()

    async def speak(self, pcm: bytes, sample_rate: int, *, realtime: bool = True) -> None:
        """Feed mono PCM16 as 20 ms frames, paced like a live microphone when `realtime`."""
        step = sample_rate * FRAME_MS // 1000 * 2
        started = time.monotonic()
        for i, offset in enumerate(range(0, len(pcm), step)):
            await self.push_audio_frame(
                InputAudioRawFrame(audio=pcm[offset : offset + step], sample_rate=sample_rate, num_channels=1)
            )
            if realtime:
                await asyncio.sleep(max(0.0, started + (i + 1) * FRAME_MS / 1000 - time.monotonic()))

    async def silence(self, seconds: float, sample_rate: int = INPUT_SAMPLE_RATE) -> None:
        await self.speak(b"\x00\x00" * int(seconds * sample_rate), sample_rate)


class MemoryOutput(BaseOutputTransport):
    """Plays into `self.played` at real-time pace, so interruptions cut audio as a speaker would."""

    def __init__(self, params: TransportParams, **kwargs):
        super().__init__(params, **kwargs)
        self.played: list[PlayedChunk] = []
        self._playing_until = 0.0

    async def start(self, frame: StartFrame):
        await super().start(frame)
        await self.set_transport_ready(frame)

    async def write_audio_frame(self, frame: OutputAudioRawFrame) -> bool:
        now = time.monotonic()
        start = max(now, self._playing_until)
        # Recorded on the pipeline clock, the same one observers timestamp frames with.
        pipeline_start = self.get_clock().get_time() / 1e9 + (start - now)
        chunk = PlayedChunk(pipeline_start, frame.audio, frame.sample_rate)
        self.played.append(chunk)
        self._playing_until = start + chunk.seconds
        # Keep one chunk queued ahead, as a sound card's buffer does.
        await asyncio.sleep(max(0.0, self._playing_until - chunk.seconds - now))
        return True


class MemoryTransport(BaseTransport):
    def __init__(self, audio: dict | None = None):
        super().__init__()
        self._params = TransportParams(**(audio or {"audio_in_enabled": True, "audio_out_enabled": True}))
        self._input = MemoryInput(self._params, name="MemoryInput")
        self._output = MemoryOutput(self._params, name="MemoryOutput")

    def input(self) -> MemoryInput:
        return self._input

    def output(self) -> MemoryOutput:
        return self._output
