"""Every place the adapters reach into Pipecat's private internals, each in one small function.

Checked against pipecat-ai 1.14.0. `tests/test_library_internals.py` fails loudly when an
upgrade moves any of them; fix the function here, nowhere else.
"""

import onnxruntime as ort
from pipecat.audio.turn.smart_turn.local_smart_turn_v3 import LocalSmartTurnAnalyzerV3
from pipecat.audio.vad.silero import SileroOnnxModel
from pipecat.services.llm_service import LLMService
from pipecat.services.stt_service import SegmentedSTTService
from pipecat.services.tts_service import TTSService
from pipecat.turns.speculation_gate import SpeculationState
from pipecat.turns.user_stop import TurnAnalyzerUserTurnStopStrategy
from pipecat.utils.text.base_text_aggregator import BaseTextAggregator

# Protected hooks of TurnAnalyzerUserTurnStopStrategy that SpeculativeTurnStopStrategy overrides:
# Pipecat has no public hook before a turn is declared stopped, nor one at turn boundaries.
# Nor one that hands a stop strategy smart-turn's probability.
OVERRIDDEN_TURN_STOP_HOOKS = ("_maybe_trigger_user_turn_stopped", "_reset", "_handle_prediction_result")

# The protected hooks of RTVIProcessor that ClientMessageGuard overrides or calls: Pipecat dispatches
# every client message in the first and has no option to refuse a type or bound a text.
OVERRIDDEN_RTVI_HOOKS = ("_handle_message", "_send_error_response")

# The protected hooks of BaseObject a transport of ours announces its client with (the SIP call's
# `on_client_connected`/`on_client_disconnected`), as Pipecat's own transports do: there is no
# public way for a transport to declare and fire an event.
TRANSPORT_EVENT_HOOKS = ("_register_event_handler", "_call_event_handler")


def set_stt_pre_roll(stt: SegmentedSTTService, seconds: float) -> None:
    """How much audio a segmented STT keeps from before the VAD's start event.

    Pipecat sizes it in `setup()` (1 s, named for that) and has no option for it; the VAD runs
    downstream of the STT, so on a loaded machine its start event arrives late and 1 s clipped
    the user's first words.
    """
    stt._audio_buffer_size_1s = int(stt.sample_rate * 2 * seconds)


def segment_in_progress(stt: SegmentedSTTService) -> bytearray | None:
    """The PCM a segmented STT has buffered for the speech segment in progress, if one is (no public accessor)."""
    return stt._audio_buffer if stt._user_speaking else None


async def transcribe_segment_head(stt: SegmentedSTTService, frame, length: int) -> None:
    """Transcribe the first `length` bytes of the segment in progress as a segment of their own;
    the rest stays buffered and the segment goes on.

    Pipecat transcribes a segment only at the VAD's stop, and has no option to cap its length.
    """
    tail = bytes(stt._audio_buffer[length:])
    del stt._audio_buffer[length:]
    await stt._handle_user_stopped_speaking(frame)  # queues the buffer and clears it
    stt._audio_buffer += tail
    stt._user_speaking = True


def silero_model_on(session: ort.InferenceSession) -> SileroOnnxModel:
    """Pipecat's Silero wrapper (its recurrent state) around an already open ONNX session.

    Its constructor opens a session of its own (~22 MB, 0.2-0.5 s) for every conversation.
    """
    model = SileroOnnxModel.__new__(SileroOnnxModel)
    model.session = session
    model.sample_rates = [8000, 16000]
    model.reset_states()
    return model


def use_smart_turn_session(analyzer: LocalSmartTurnAnalyzerV3, session: ort.InferenceSession) -> None:
    """Make a smart-turn analyzer (built without its model) run on a shared ONNX session."""
    analyzer._log_data = False
    analyzer._session = session


def use_text_aggregator(tts: TTSService, aggregator: BaseTextAggregator) -> None:
    """Have a TTS service group the LLM's text with `aggregator` instead of its sentence aggregator.

    The constructor takes only an aggregation mode (sentence or token), not an aggregator.
    """
    tts._text_aggregator = aggregator


def turn_stop_state(strategy: TurnAnalyzerUserTurnStopStrategy) -> dict[str, bool]:
    """What Pipecat's smart-turn stop strategy knows of the turn so far (no public accessor)."""
    return {
        "vad_stopped": strategy._vad_stopped,  # VAD reported a stop this turn
        "user_speaking": strategy._vad_user_speaking,
        "turn_complete": strategy._turn_complete,  # smart-turn judged the turn finished
        "transcript_finalized": strategy._transcript_finalized,
    }


def holds_its_reply(llm: LLMService) -> bool:
    """Whether an LLM service's SpeculationGate is holding the reply it is generating.

    The gate is the service's private attribute; `SpeculationGate.state` itself is public.
    """
    return llm._speculation_gate.state == SpeculationState.HOLDING
