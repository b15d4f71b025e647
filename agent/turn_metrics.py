"""Per-turn latency of one conversation: STT, LLM first token, TTS first audio and voice-to-voice."""

from dataclasses import dataclass
from typing import TYPE_CHECKING

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

if TYPE_CHECKING:
    from agent.metrics import AgentMetrics


@dataclass
class TurnLatency:
    """Seconds, on the pipeline clock. `None` where a stage did not run in this turn."""

    user_speech_ended: float
    turn_ended: float | None = None  # end of speech → turn judged complete (smart-turn + transcript)
    stt: float | None = None  # end of speech (VAD stop) → final transcript
    llm_first_token: float | None = None  # request → first token
    tts_first_audio: float | None = None  # first sentence in → first audio out
    voice_to_voice: float | None = None  # end of user speech → first bot audio played


class TurnMetricsObserver(BaseObserver):
    """Collects a TurnLatency for every user turn the bot answered, and feeds the process' metrics.

    An underrun is agent audio that stopped and started again with no user turn in between:
    the output ran dry mid-reply (TTS slower than playback), which the listener hears as a gap.
    """

    def __init__(self, metrics: "AgentMetrics | None" = None):
        super().__init__()
        self.turns: list[TurnLatency] = []
        self.user_turn_started_at: list[float] = []  # pipeline clock, seconds
        self.bot_started_at: list[float] = []
        self.underruns = 0
        self.errors: list[str] = []  # kinds, in order
        self._metrics = metrics
        self._pending: TurnLatency | None = None
        self._bot_paused = False  # the bot stopped speaking and no user turn started since

    async def on_push_frame(self, data: FramePushed):
        frame, now = data.frame, data.timestamp / 1e9
        if not data.first_push:
            return
        if isinstance(frame, VADUserStoppedSpeakingFrame):
            # Silero reports the stop after `stop_secs` of silence: the speech ended earlier.
            self._pending = TurnLatency(user_speech_ended=now - frame.stop_secs)
        elif isinstance(frame, UserStartedSpeakingFrame):
            self.user_turn_started_at.append(now)
            self._bot_paused = False
        elif isinstance(frame, UserStoppedSpeakingFrame) and self._pending is not None:
            self._pending.turn_ended = now - self._pending.user_speech_ended
        elif isinstance(frame, BotStoppedSpeakingFrame):
            self._bot_paused = True
        elif isinstance(frame, BotStartedSpeakingFrame):
            self.bot_started_at.append(now)
            if self._pending is not None:
                self._pending.voice_to_voice = now - self._pending.user_speech_ended
                self.turns.append(self._pending)
                if self._metrics is not None:
                    self._metrics.observe_turn(self._pending)
                self._pending = None
            elif self._bot_paused:
                self.underruns += 1
                if self._metrics is not None:
                    self._metrics.audio_underruns.inc()
            self._bot_paused = False
        elif isinstance(frame, ErrorFrame):
            kind = _stage_of(data.source)
            self.errors.append(kind)
            if self._metrics is not None:
                self._metrics.count_error(kind)
        elif isinstance(frame, MetricsFrame):
            turn = self._pending or (self.turns[-1] if self.turns else None)
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
