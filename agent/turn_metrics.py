"""Per-turn latency of one conversation (STT, LLM first token, TTS first audio, voice-to-voice), handed to metrics sinks."""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from pipecat.frames.frames import (
    BotStartedSpeakingFrame,
    BotStoppedSpeakingFrame,
    ErrorFrame,
    MetricsFrame,
    UserStartedSpeakingFrame,
    UserStoppedSpeakingFrame,
    VADUserStoppedSpeakingFrame,
)
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

    def __init__(self, sinks: Sequence[ConversationMetrics] = ()):
        super().__init__()
        self.last: TurnLatency | None = None  # the latest answered turn
        self._sinks = list(sinks)
        self._pending: TurnLatency | None = None
        self._bot_paused = False  # the bot stopped speaking and no user turn started since

    def add_sink(self, sink: ConversationMetrics) -> None:
        """Report to `sink` too from now on (e.g. a benchmark watching a server's conversation)."""
        self._sinks.append(sink)

    async def on_push_frame(self, data: FramePushed):
        frame, now = data.frame, data.timestamp / 1e9
        if not data.first_push:
            return
        if isinstance(frame, VADUserStoppedSpeakingFrame):
            # Silero reports the stop after `stop_secs` of silence: the speech ended earlier.
            self._pending = TurnLatency(user_speech_ended=now - frame.stop_secs)
        elif isinstance(frame, UserStartedSpeakingFrame):
            self._bot_paused = False
        elif isinstance(frame, UserStoppedSpeakingFrame) and self._pending is not None:
            self._pending.turn_ended = now - self._pending.user_speech_ended
        elif isinstance(frame, BotStoppedSpeakingFrame):
            self._bot_paused = True
        elif isinstance(frame, BotStartedSpeakingFrame):
            if self._pending is not None:
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
                elif isinstance(data.source, TTSService) and turn.tts_first_audio is None:
                    turn.tts_first_audio = metric.value


def _stage_of(source) -> str:
    for cls, kind in ((STTService, "stt"), (LLMService, "llm"), (TTSService, "tts")):
        if isinstance(source, cls):
            return kind
    return type(source).__name__
