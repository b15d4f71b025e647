"""Pausable bot playback: holds the agent's audio while a possible barge-in is judged, then resumes or drops it."""

import asyncio
import re
import time
from collections import deque
from collections.abc import Callable
from enum import Enum

from pipecat.audio.filters.base_audio_filter import BaseAudioFilter
from pipecat.frames.frames import (
    FilterControlFrame,
    Frame,
    InterruptionFrame,
    SystemFrame,
    TTSStartedFrame,
    TTSTextFrame,
)
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor


class PlaybackState(Enum):
    PLAYING = "playing"
    PAUSED = "paused"  # a sound may be a barge-in: hold the audio, lose none of it
    DROPPING = "dropping"  # the barge-in was real: what was queued for the old reply is discarded


class PlaybackGate(BaseAudioFilter):
    """The output transport's audio filter; it can pause the bot mid-word and resume it losing nothing.

    Why a filter: Pipecat's output transport calls its filter on each chunk just before writing
    it, from the task that paces playback, so awaiting here stops the speaker within one chunk
    while the rest of the reply waits, in order, in the transport's queue. An InterruptionFrame
    alone could only throw that audio away. Every chunk that passes is handed to `on_played`
    (the echo canceller's reference signal).

    The gate's frame processor (`gate.processor`) sits just before the output transport:
    an InterruptionFrame switches the gate to DROPPING (so the chunk held during a pause and any
    chunk dequeued before the transport's queue reset is silenced), and the next reply's
    TTSStartedFrame switches it back to PLAYING. `gate.played_text` sits just after it.
    """

    def __init__(self, on_played: Callable[[bytes, int], None] | None = None):
        self.state = PlaybackState.PLAYING
        self.pauses = 0  # times a sound paused the agent, for tests
        self.sample_rate = 0
        self._on_played = on_played
        self.last_played_at = 0.0  # time.monotonic() of the latest chunk let through
        # The bot's latest words as they are played (about 10 s of speech): what its echo can say.
        self.recent_words: deque[str] = deque(maxlen=30)
        self._released = asyncio.Event()
        self._released.set()
        self.processor = PlaybackGateProcessor(self)
        self.played_text = PlayedTextGate(self)

    async def start(self, sample_rate: int):
        self.sample_rate = sample_rate

    async def stop(self):
        self.drop()  # never leave the transport's audio task waiting on us

    async def process_frame(self, frame: FilterControlFrame):
        pass

    async def filter(self, audio: bytes) -> bytes:
        await self._released.wait()
        if self.state is PlaybackState.DROPPING:
            return b""  # the transport skips empty chunks
        self.last_played_at = time.monotonic()
        if self._on_played is not None:
            self._on_played(audio, self.sample_rate)
        return audio

    @property
    def paused(self) -> bool:
        return self.state is PlaybackState.PAUSED

    def pause(self) -> None:
        if self.state is PlaybackState.PLAYING:
            self.pauses += 1
            self._set(PlaybackState.PAUSED)

    def resume(self) -> None:
        if self.state is PlaybackState.PAUSED:
            self._set(PlaybackState.PLAYING)

    def drop(self) -> None:
        """The reply was interrupted: silence whatever of it the transport still hands us."""
        self._set(PlaybackState.DROPPING)

    def play_next_reply(self) -> None:
        if self.state is PlaybackState.DROPPING:
            self._set(PlaybackState.PLAYING)

    def _set(self, state: PlaybackState) -> None:
        self.state = state
        if state is PlaybackState.PAUSED:
            self._released.clear()
        else:
            self._released.set()


class PlaybackGateProcessor(FrameProcessor):
    """Tells the gate where one reply ends (interruption) and the next begins (TTS started)."""

    def __init__(self, gate: PlaybackGate, **kwargs):
        super().__init__(**kwargs)
        self._gate = gate

    async def process_frame(self, frame: Frame, direction: FrameDirection):
        await super().process_frame(frame, direction)
        if direction is FrameDirection.DOWNSTREAM:
            if isinstance(frame, InterruptionFrame):
                self._gate.drop()
            elif isinstance(frame, TTSStartedFrame):
                self._gate.play_next_reply()
        await self.push_frame(frame, direction)


class PlayedTextGate(FrameProcessor):
    """Holds the reply's words on their way to the context while the gate is paused.

    The transport releases word frames by the clock, not by the audio, so without this a pause
    that ends in a barge-in would put the words of the paused stretch into the context although
    nobody heard them. Held frames go on, in order, once playback resumes; an interruption drops them.
    """

    def __init__(self, gate: PlaybackGate, **kwargs):
        super().__init__(**kwargs)
        self._gate = gate
        self._held: list[Frame] = []

    async def process_frame(self, frame: Frame, direction: FrameDirection):
        await super().process_frame(frame, direction)
        if direction is FrameDirection.DOWNSTREAM:
            if isinstance(frame, InterruptionFrame):
                self._held.clear()
            elif not isinstance(frame, SystemFrame):
                if self._gate.paused:
                    self._held.append(frame)
                    return
                held, self._held = self._held, []
                for earlier in held:
                    await self._pass(earlier)
        await self._pass(frame, direction)

    async def _pass(self, frame: Frame, direction: FrameDirection = FrameDirection.DOWNSTREAM):
        if isinstance(frame, TTSTextFrame):
            self._gate.recent_words.extend(re.findall(r"[a-z']+", frame.text.lower()))
        await self.push_frame(frame, direction)
