"""A conversation driven from Python over the in-memory transport (tests, benchmarks)."""

import asyncio

from pipecat.frames.frames import InputAudioRawFrame

from agent.config import Settings
from agent.conversation import Conversation, build_conversation, run_conversation
from agent.engines import Engines
from agent.transports.memory import MemoryTransport, PlayedChunk
from agent.turn_metrics import ConversationMetrics
from harness.observe import TurnLog
from services.audio import INPUT_SAMPLE_RATE


class LocalSession:
    """`async with LocalSession(engines, settings) as s: await s.speak(pcm16_16k)`.

    The user's audio goes in at real-time pace; what the bot played is in `s.played`, its turns
    in `s.turn_log`.
    """

    def __init__(self, engines: Engines, settings: Settings, *, metrics: ConversationMetrics | None = None):
        self.turn_log = TurnLog()
        self.conversation: Conversation = build_conversation(
            MemoryTransport,
            engines,
            settings,
            metrics=[self.turn_log, *([metrics] if metrics is not None else [])],
            observers=[self.turn_log],
            ends_without_audio=False,  # tests pause the microphone at will
        )
        self.transport: MemoryTransport = self.conversation.transport
        self._task: asyncio.Task | None = None

    async def __aenter__(self) -> "LocalSession":
        self._task = asyncio.create_task(run_conversation(self.conversation, "local"))
        await asyncio.wait_for(self.transport.input().started.wait(), timeout=30)
        await self.conversation.greet()  # the user "joins" as the session starts
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    async def stop(self) -> None:
        if self._task is None:
            return
        if not self._task.done():
            # Cancel, not EndFrame: an EndFrame would wait for the bot to finish talking.
            await self.conversation.worker.cancel(reason="local session closed")
            await self._task
        self._task = None

    def now(self) -> float:
        """Pipeline clock, seconds: the time base of `played` and the turn metrics."""
        return self.transport.output().get_clock().get_time() / 1e9

    async def speak(self, pcm: bytes, sample_rate: int = INPUT_SAMPLE_RATE) -> None:
        await self.transport.input().speak(pcm, sample_rate)

    async def silence(self, seconds: float) -> None:
        await self.transport.input().silence(seconds)

    async def send(self, frame: InputAudioRawFrame) -> None:
        """Push one raw input frame as a (possibly broken) client would."""
        await self.transport.input().push_audio_frame(frame)

    @property
    def played(self) -> list[PlayedChunk]:
        return self.transport.output().played

    def played_audio(self, start: float = 0.0, end: float = float("inf")) -> bytes:
        """Bot audio whose playback started in [start, end) on the pipeline clock."""
        return b"".join(c.audio for c in self.played if start <= c.started_at < end)
