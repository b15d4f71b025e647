"""Assembles one conversation: a transport plus the shared engines → a Pipecat pipeline worker."""

from dataclasses import dataclass
from typing import TYPE_CHECKING

from loguru import logger
from pipecat.audio.vad.vad_analyzer import VADParams
from pipecat.observers.base_observer import BaseObserver
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineParams, PipelineWorker
from pipecat.processors.aggregators.llm_context import LLMContext
from pipecat.processors.aggregators.llm_response_universal import (
    LLMAssistantAggregator,
    LLMContextAggregatorPair,
    LLMUserAggregator,
    LLMUserAggregatorParams,
)
from pipecat.transports.base_transport import BaseTransport
from pipecat.turns.user_stop import TurnAnalyzerUserTurnStopStrategy
from pipecat.turns.user_turn_strategies import UserTurnStrategies
from pipecat.workers.runner import WorkerRunner

from agent.config import Settings
from agent.engines import Engines
from agent.turn_metrics import TurnMetricsObserver

if TYPE_CHECKING:
    from agent.metrics import AgentMetrics
from frames.audio_guard import InputAudioGuard
from frames.llm import TransformersLLMService
from frames.stt import WhisperSTTService
from frames.tts import LocalTTSService
from frames.turn_models import SharedSileroVADAnalyzer, SharedSmartTurnAnalyzer

AUDIO_IN_SAMPLE_RATE = 16000  # what Silero, smart-turn and Whisper all want
AUDIO_OUT_SAMPLE_RATE = 24000  # Orpheus' native rate; transports resample for their codec


@dataclass
class Conversation:
    """One user's session: per-session processors around the process-wide engines."""

    worker: PipelineWorker
    context: LLMContext
    guard: InputAudioGuard
    stt: WhisperSTTService
    user_aggregator: LLMUserAggregator
    llm: TransformersLLMService
    tts: LocalTTSService
    assistant_aggregator: LLMAssistantAggregator
    turns: TurnMetricsObserver


def build_conversation(
    transport: BaseTransport,
    engines: Engines,
    settings: Settings,
    *,
    metrics: "AgentMetrics | None" = None,
    observers: list[BaseObserver] | None = None,
) -> Conversation:
    context = LLMContext()
    user_aggregator, assistant_aggregator = LLMContextAggregatorPair(
        context,
        user_params=LLMUserAggregatorParams(
            vad_analyzer=SharedSileroVADAnalyzer(
                params=VADParams(
                    start_secs=settings.vad_start_secs,
                    stop_secs=settings.vad_stop_secs,
                    min_volume=settings.vad_min_volume,
                )
            ),
            # Pipecat's default strategies: start on VAD or transcript, stop when smart-turn
            # v3.2 (local ONNX) judges the turn complete; its model shared by all conversations.
            user_turn_strategies=UserTurnStrategies(
                stop=[TurnAnalyzerUserTurnStopStrategy(turn_analyzer=SharedSmartTurnAnalyzer())]
            ),
        ),
    )
    guard = InputAudioGuard(on_drop=(lambda kind: metrics.count_error("audio_input")) if metrics else None)
    stt = WhisperSTTService(engines.stt)
    llm = TransformersLLMService(
        engines.llm, system_prompt=settings.system_prompt, max_tokens=settings.llm_max_new_tokens
    )
    tts = LocalTTSService(
        engines.tts,
        on_sentence=(lambda audio, wall: metrics.tts_realtime_factor.observe(wall / audio)) if metrics else None,
    )
    pipeline = Pipeline(
        [
            transport.input(),
            guard,
            stt,
            user_aggregator,
            llm,
            tts,
            transport.output(),
            assistant_aggregator,
        ]
    )
    turns = TurnMetricsObserver(metrics)
    if metrics is not None:
        metrics.sessions_started.inc()
    worker = PipelineWorker(
        pipeline,
        params=PipelineParams(
            audio_in_sample_rate=AUDIO_IN_SAMPLE_RATE,
            audio_out_sample_rate=AUDIO_OUT_SAMPLE_RATE,
            enable_metrics=True,
            enable_usage_metrics=True,
        ),
        observers=[turns, *(observers or [])],
    )
    return Conversation(
        worker=worker,
        context=context,
        guard=guard,
        stt=stt,
        user_aggregator=user_aggregator,
        llm=llm,
        tts=tts,
        assistant_aggregator=assistant_aggregator,
        turns=turns,
    )


async def run_conversation(conversation: Conversation, name: str) -> None:
    """Run one conversation until its transport ends it (or it is cancelled).

    Its failure is logged here and never reaches another conversation in the process.
    """
    runner = WorkerRunner(handle_sigint=False)  # the server owns the process' signals
    logger.info(f"conversation {name} started")
    try:
        await runner.add_workers(conversation.worker)
        await runner.run()
    except Exception:
        logger.exception(f"conversation {name} failed")
    finally:
        logger.info(f"conversation {name} ended")
