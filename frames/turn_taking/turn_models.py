"""Silero VAD and smart-turn v3.2 for every conversation, with each ONNX model loaded once per process."""

import threading
from importlib.resources import files

import onnxruntime as ort
from pipecat.audio.turn.smart_turn.base_smart_turn import BaseSmartTurn
from pipecat.audio.turn.smart_turn.local_smart_turn_v3 import LocalSmartTurnAnalyzerV3
from pipecat.audio.vad.silero import SileroVADAnalyzer
from pipecat.audio.vad.vad_analyzer import VADAnalyzer, VADParams

from frames.pipecat_internals import silero_model_on, use_smart_turn_session

_sessions: dict[str, ort.InferenceSession] = {}
_lock = threading.Lock()


def _session(model: str) -> ort.InferenceSession:
    """One single-threaded ONNX session per model file; `run` is thread-safe, so all conversations share it.

    Pipecat's analyzers open their own session per conversation: ~22 MB and a 0.2-0.5 s
    blocking load each time a conversation starts.
    """
    with _lock:
        if model not in _sessions:
            options = ort.SessionOptions()
            options.inter_op_num_threads = 1
            options.intra_op_num_threads = 1
            options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
            options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
            _sessions[model] = ort.InferenceSession(model, sess_options=options, providers=["CPUExecutionProvider"])
        return _sessions[model]


class SharedSileroVADAnalyzer(SileroVADAnalyzer):
    """Pipecat's Silero VAD; the recurrent state stays per conversation, the model session is shared."""

    def __init__(self, *, sample_rate: int | None = None, params: VADParams | None = None):
        VADAnalyzer.__init__(self, sample_rate=sample_rate, params=params)  # not the parent: it loads a model
        self._model = silero_model_on(_session(str(files("pipecat.audio.vad.data") / "silero_vad.onnx")))
        self._windows_since_reset = 0
        self._low_confidence_windows = 0


class SharedSmartTurnAnalyzer(LocalSmartTurnAnalyzerV3):
    """Pipecat's local smart-turn v3.2 (bundled ONNX); the audio buffer is per conversation, the model shared."""

    def __init__(self, **kwargs):
        BaseSmartTurn.__init__(self, **kwargs)  # not the parent: it loads a model
        use_smart_turn_session(
            self, _session(str(files("pipecat.audio.turn.smart_turn.data") / "smart-turn-v3.2-cpu.onnx"))
        )
