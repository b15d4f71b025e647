"""Silero VAD and smart-turn v3.2 for every conversation, with each ONNX model loaded once per process."""

import threading
import time
from importlib.resources import files
from typing import Protocol

import onnxruntime as ort
from pipecat.audio.turn.smart_turn.base_smart_turn import BaseSmartTurn
from pipecat.audio.turn.smart_turn.local_smart_turn_v3 import LocalSmartTurnAnalyzerV3
from pipecat.audio.vad.silero import SileroVADAnalyzer
from pipecat.audio.vad.vad_analyzer import VADAnalyzer, VADParams, VADState

from frames.pipecat_internals import silero_model_on, use_smart_turn_session
from services import onnx_sessions
from services.audio import rms

SILERO_VAD_MODEL = str(files("pipecat.audio.vad.data") / "silero_vad.onnx")
SMART_TURN_MODEL = str(files("pipecat.audio.turn.smart_turn.data") / "smart-turn-v3.2-cpu.onnx")

_sessions: dict[str, ort.InferenceSession] = {}
_lock = threading.Lock()


def _session(model: str) -> ort.InferenceSession:
    """One single-threaded ONNX session per model file; `run` is thread-safe, so all conversations share it.

    Pipecat's analyzers open their own session per conversation: ~22 MB and a 0.2-0.5 s
    blocking load each time a conversation starts.
    """
    with _lock:
        if model not in _sessions:
            _sessions[model] = onnx_sessions.session(model, threads=1)
        return _sessions[model]


def load_sessions() -> None:
    """Open both models now, with the engines: opened by the first conversation, they held its
    event loop for 0.5-1.5 s, and the LiveKit rooms joining at that moment waited on the lock."""
    for model in (SILERO_VAD_MODEL, SMART_TURN_MODEL):
        _session(model)


# How long the user must have been quiet before a pause is announced (see PauseListener): two
# Silero windows. A pause between words is often shorter; each one announced costs an early
# transcription that the user's next word throws away.
PAUSE_SECS = 0.064


# Once the user is speaking, a window quieter than this (int16 RMS, about -53 dBFS) is quiet,
# whatever Silero says. Silero's recurrent state keeps its confidence at 0.95-1.0 for 30-190 ms
# after the voice has gone, and the VAD's 0.2 s stop counted from there: every turn's end was
# heard that late (Piper's 10 benchmark questions and 12 monologue clauses, then silence: median
# 0.10 s after the last loud 20 ms, 0.04 s with this). A closure inside a word dips below it too,
# but the next voiced window goes on speaking (no stop came inside those 22 clips that Silero
# alone did not make); at 100 the gap before "France?"'s final "s" was long enough to announce
# a pause, and its early transcription was thrown away. A line whose noise floor is above it
# leaves Silero to decide, as before. Speech's start is Silero's alone: three voiced windows in
# a row, which such dips would break.
QUIET_RMS = 70.0


class PauseListener(Protocol):
    """Told when the user pauses, before the VAD's stop: the pause may end the speech segment."""

    def user_paused(self) -> None: ...

    def user_resumed(self) -> None: ...


class SharedSileroVADAnalyzer(SileroVADAnalyzer):
    """Pipecat's Silero VAD; the recurrent state stays per conversation, the model session is shared.

    The VAD ends a segment after `stop_secs` of quiet (0.2 s). A `pause_listener` hears of the quiet
    PAUSE_SECS into it, and again if the user speaks before the stop, so that work on the segment
    (its transcription) can start during the quiet instead of after it. Once the user speaks,
    a near-silent window is quiet whatever Silero says (see QUIET_RMS).
    """

    def __init__(
        self,
        *,
        sample_rate: int | None = None,
        params: VADParams | None = None,
        pause_listener: PauseListener | None = None,
    ):
        VADAnalyzer.__init__(self, sample_rate=sample_rate, params=params)  # not the parent: it loads a model
        self._model = silero_model_on(_session(SILERO_VAD_MODEL))
        self._windows_since_reset = 0
        self._low_confidence_windows = 0
        self._pause_listener = pause_listener
        self._user_speaking = False  # as of the last audio analyzed: the end is being listened for
        self._quiet_secs = 0.0  # audio heard since speech dipped (the STOPPING state)
        self._paused = False
        # Audio analyzed since the VAD last heard a voice (STARTING or SPEAKING): how long the user
        # has been quiet, counted in what was heard rather than in wall-clock time, which runs
        # ahead of the audio on a busy machine. A voice that the VAD has not yet called speech
        # (STARTING) counts as the user going on.
        self.quiet_audio_secs = 0.0
        self.audio_at = 0.0  # time.monotonic() when audio last came in

    def voice_confidence(self, buffer) -> float:
        confidence = super().voice_confidence(buffer)  # always: Silero's state follows all the audio
        if self._user_speaking and rms(buffer) < QUIET_RMS:
            return 0.0
        return confidence

    async def analyze_audio(self, buffer: bytes) -> VADState:
        self.audio_at = time.monotonic()
        state = await super().analyze_audio(buffer)
        self._user_speaking = state in (VADState.SPEAKING, VADState.STOPPING)  # see QUIET_RMS
        seconds = len(buffer) / 2 / self.sample_rate
        voiced = state in (VADState.STARTING, VADState.SPEAKING)
        self.quiet_audio_secs = 0.0 if voiced else self.quiet_audio_secs + seconds
        if self._pause_listener is not None:
            self._follow_pause(state, seconds)
        return state

    def _follow_pause(self, state: VADState, seconds: float) -> None:
        if state == VADState.STOPPING:
            self._quiet_secs += seconds
            if not self._paused and self._quiet_secs >= PAUSE_SECS:
                self._paused = True
                self._pause_listener.user_paused()
            return
        if state == VADState.SPEAKING and self._paused:
            self._pause_listener.user_resumed()
        self._quiet_secs, self._paused = 0.0, False


class SharedSmartTurnAnalyzer(LocalSmartTurnAnalyzerV3):
    """Pipecat's local smart-turn v3.2 (bundled ONNX); the audio buffer is per conversation, the model shared."""

    def __init__(self, **kwargs):
        BaseSmartTurn.__init__(self, **kwargs)  # not the parent: it loads a model
        use_smart_turn_session(self, _session(SMART_TURN_MODEL))
