"""Per-turn latency of one conversation (STT, LLM first token, TTS first audio, voice-to-voice), handed to metrics sinks."""

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from pipecat.frames.frames import (
    BotStartedSpeakingFrame,
    BotStoppedSpeakingFrame,
    ErrorFrame,
    MetricsFrame,
    UserStartedSpeakingFrame,
    UserStoppedSpeakingFrame,
    LLMTextFrame,
    TranscriptionFrame,
    TTSAudioRawFrame,
    VADUserStoppedSpeakingFrame,
)
from pipecat.clocks.base_clock import BaseClock
from pipecat.metrics.metrics import TTFBMetricsData
from pipecat.observers.base_observer import BaseObserver, FramePushed
from pipecat.services.llm_service import LLMService
from pipecat.services.stt_service import STTService
from pipecat.services.tts_service import TTSService


@dataclass
class TurnLatency:
    """Seconds, on the pipeline clock. `None` where a stage did not run in this turn."""

    user_speech_ended: float
    turn_ended: float | None = None  # end of speech → turn judged complete (smart-turn + transcript)
    stt: float | None = None  # end of speech (VAD stop) → final transcript
    llm_first_token: float | None = None  # request → first token
    tts_first_audio: float | None = None  # first sentence in → first audio out
    voice_to_voice: float | None = None  # end of user speech → first bot audio played
    # When each step of the turn happened, in time.monotonic() seconds (one clock for the whole
    # machine, so a client in another process can put its own events on the same timeline):
    # speech_end (the VAD's estimate), vad_stop, transcript (the last one), turn_end (turn judged
    # complete), llm_text (first text out of the LLM), tts_audio (first audio out of the TTS),
    # bot_started (first audio written by the output transport). See TIMELINE.
    at: dict[str, float] = field(default_factory=dict)


# The steps of a turn in order: (event that ends the step, what the step is).
TIMELINE = (
    ("speech_end", "input: the user's last word reaches the agent's VAD"),
    ("vad_stop", "VAD: silence long enough to call the speech over"),
    ("transcript", "STT: the last segment transcribed"),
    ("turn_end", "turn decision: smart-turn judges the turn complete"),
    ("llm_text", "LLM: first text of the reply"),
    ("tts_text", "first chunk: text gathered until the TTS can speak it"),
    ("tts_audio", "TTS: first audio of that chunk"),
    ("bot_started", "output: the transport writes the first audio"),
)


class ConversationMetrics(Protocol):
    """Where a conversation reports what it measures: the process' Prometheus metrics
    (`agent.server.metrics.AgentMetrics`), or a benchmark's or test's log of turns."""

    def observe_turn(self, turn: TurnLatency) -> None: ...

    def count_underrun(self) -> None: ...

    def count_error(self, kind: str) -> None: ...

    def observe_tts_sentence(self, audio_seconds: float, wall_seconds: float) -> None: ...

    def count_session_started(self) -> None: ...


class TurnMetricsObserver(BaseObserver):
    """Measures every user turn the bot answered and hands it to the conversation's metrics sinks.

    It keeps only the turn being measured and the last one (`last`): a conversation's history of
    turns belongs to whoever collects it (Prometheus histograms, a benchmark's log).
    An underrun is agent audio that stopped and started again with no user turn in between:
    the output ran dry mid-reply (TTS slower than playback), which the listener hears as a gap.
    """

    def __init__(self, sinks: Sequence[ConversationMetrics] = (), *, clock_of: Callable[[], BaseClock] | None = None):
        super().__init__()
        self.last: TurnLatency | None = None  # the latest answered turn
        self._sinks = list(sinks)
        self._clock_of = clock_of  # the pipeline's clock, to put frame times on time.monotonic()
        self._clock_offset: float | None = None
        self._pending: TurnLatency | None = None
        self._bot_paused = False  # the bot stopped speaking and no user turn started since

    def add_sink(self, sink: ConversationMetrics) -> None:
        """Report to `sink` too from now on (e.g. a benchmark watching a server's conversation)."""
        self._sinks.append(sink)

    def _monotonic(self, pipeline_seconds: float) -> float:
        """A frame's pipeline-clock time as time.monotonic() seconds."""
        if self._clock_offset is None:
            clock = self._clock_of() if self._clock_of is not None else None
            elapsed = clock.get_time() if clock is not None else 0
            # SystemClock: get_time() = monotonic_ns() - start, so the offset is the start.
            self._clock_offset = time.monotonic() - elapsed / 1e9 if elapsed else 0.0
        return pipeline_seconds + self._clock_offset

    def _mark(self, event: str, now: float, *, first: bool = True) -> None:
        if self._pending is not None and not (first and event in self._pending.at):
            self._pending.at[event] = self._monotonic(now)

    async def on_push_frame(self, data: FramePushed):
        frame, now = data.frame, data.timestamp / 1e9
        if not data.first_push:
            return
        if isinstance(frame, VADUserStoppedSpeakingFrame):
            # Silero reports the stop after `stop_secs` of silence: the speech ended earlier.
            self._pending = TurnLatency(user_speech_ended=now - frame.stop_secs)
            self._mark("speech_end", now - frame.stop_secs)
            self._mark("vad_stop", now)
        elif isinstance(frame, TranscriptionFrame) and isinstance(data.source, STTService):
            self._mark("transcript", now, first=False)
        elif isinstance(frame, LLMTextFrame) and isinstance(data.source, LLMService):
            if self._pending is not None and "turn_end" in self._pending.at:
                self._mark("llm_text", now)
        elif isinstance(frame, TTSAudioRawFrame) and isinstance(data.source, TTSService):
            if self._pending is not None and "llm_text" in self._pending.at and "tts_audio" not in self._pending.at:
                self._mark("tts_audio", now)
                if self._pending.tts_first_audio is not None:  # its TTFB report came first
                    self._pending.at["tts_text"] = self._pending.at["tts_audio"] - self._pending.tts_first_audio
        elif isinstance(frame, UserStartedSpeakingFrame):
            self._bot_paused = False
        elif isinstance(frame, UserStoppedSpeakingFrame) and self._pending is not None:
            self._pending.turn_ended = now - self._pending.user_speech_ended
            self._mark("turn_end", now)
        elif isinstance(frame, BotStoppedSpeakingFrame):
            self._bot_paused = True
        elif isinstance(frame, BotStartedSpeakingFrame):
            if self._pending is not None:
                self._mark("bot_started", now)
                self._pending.voice_to_voice = now - self._pending.user_speech_ended
                self.last, self._pending = self._pending, None
                for sink in self._sinks:
                    sink.observe_turn(self.last)
            elif self._bot_paused:
                for sink in self._sinks:
                    sink.count_underrun()
            self._bot_paused = False
        elif isinstance(frame, ErrorFrame):
            kind = _stage_of(data.source)
            for sink in self._sinks:
                sink.count_error(kind)
        elif isinstance(frame, MetricsFrame):
            # TTFB reports can trail the first audio: they belong to the turn just answered.
            turn = self._pending or self.last
            if turn is None:
                return
            for metric in frame.data:
                if not isinstance(metric, TTFBMetricsData) or not metric.value:
                    continue
                if isinstance(data.source, STTService) and turn.stt is None:
                    turn.stt = metric.value
                elif isinstance(data.source, LLMService) and turn.llm_first_token is None:
                    turn.llm_first_token = metric.value
                elif isinstance(data.source, TTSService) and turn.tts_first_audio is None and "llm_text" in turn.at:
                    turn.tts_first_audio = metric.value  # the first chunk went in this long before its audio
                    if "tts_audio" in turn.at:
                        turn.at["tts_text"] = turn.at["tts_audio"] - metric.value


def _stage_of(source) -> str:
    for cls, kind in ((STTService, "stt"), (LLMService, "llm"), (TTSService, "tts")):
        if isinstance(source, cls):
            return kind
    return type(source).__name__
