"""One conversation: a transport plus the shared engines assembled into a Pipecat pipeline, and how it runs."""

import asyncio
import functools
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field

from loguru import logger
from pipecat.adapters.llm.schemas.function_schema import FunctionSchema
from pipecat.adapters.llm.schemas.tools_schema import ToolsSchema
from pipecat.audio.vad.vad_analyzer import VADParams
from pipecat.frames.frames import BotSpeakingFrame, InputAudioRawFrame, TTSSpeakFrame
from pipecat.observers.base_observer import BaseObserver
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineParams, PipelineWorker
from pipecat.processors.aggregators.dtmf_aggregator import DTMFAggregator
from pipecat.processors.aggregators.llm_context import LLMContext
from pipecat.processors.aggregators.llm_response_universal import (
    LLMAssistantAggregator,
    LLMContextAggregatorPair,
    LLMUserAggregator,
    LLMUserAggregatorParams,
)
from pipecat.transports.base_transport import BaseTransport
from pipecat.turns.user_turn_strategies import UserTurnStrategies
from pipecat.workers.runner import WorkerRunner

from agent.call_tools import add_call_tools
from agent.config import Settings
from agent.engines import Engines
from agent.turn_metrics import ConversationMetrics, TurnMetricsObserver
from frames.audio_guard import InputAudioGuard
from frames.client_messages import ClientMessageGuard
from frames.turn_taking.barge_in import BargeInPolicy, BargeInTurnStartStrategy
from frames.turn_taking.echo import EchoCancellingFilter
from frames.llm import TransformersLLMService
from frames.turn_taking.playback import PlaybackGate
from frames.stt import WhisperSTTService
from frames.tts import LocalTTSService
from frames.turn_taking.turn_models import SharedSileroVADAnalyzer, SharedSmartTurnAnalyzer
from frames.turn_taking.turn_stop import SpeculativeTurnStopStrategy
from services.audio import INPUT_SAMPLE_RATE, OUTPUT_SAMPLE_RATE
from services.echo import EchoCanceller
from services.languages import ConversationLanguage

REPLY_QUIET_SECS = 2.5  # longer than the gap between two sentences of a reply on a busy CPU

# Builds the conversation's transport from the audio settings every transport shares (filters,
# chunking): `lambda audio: LiveKitTransport(..., params=LiveKitParams(**audio))`.
TransportFactory = Callable[[dict], BaseTransport]


@dataclass
class Conversation:
    """One user's session: per-session processors around the process-wide engines."""

    worker: PipelineWorker
    transport: BaseTransport
    context: LLMContext
    playback: PlaybackGate
    barge_in: BargeInTurnStartStrategy
    guard: InputAudioGuard
    stt: WhisperSTTService
    user_aggregator: LLMUserAggregator
    llm: TransformersLLMService
    tts: LocalTTSService
    assistant_aggregator: LLMAssistantAggregator
    turns: TurnMetricsObserver
    greeting: str = ""
    tool_filler: str = ""  # said when a tool takes longer than tool_filler_secs ("One moment, please.")
    tool_filler_secs: float = 1.5
    # Coroutines that run alongside the pipeline and are cancelled when it ends (see `background`).
    chores: list[Coroutine] = field(default_factory=list)
    background_tasks: set[asyncio.Task] = field(default_factory=set)  # started by tools (end_call)

    def background(self, chore: Coroutine) -> None:
        """Run `chore` while the conversation runs (e.g. ending it when the worker drains)."""
        self.chores.append(chore)

    def replying(self, quiet_secs: float = REPLY_QUIET_SECS) -> bool:
        """Whether the agent is giving a reply: generating it, or it played or generated something
        within `quiet_secs` (which spans the gaps while the next sentence is synthesized)."""
        now = time.monotonic()
        recent = max(self.llm.last_output_at, self.playback.last_played_at)
        return self.llm.generating or now - recent < quiet_secs

    def add_tool(self, schema: FunctionSchema, handler=None, **options) -> None:
        """Give the LLM a function to call, the Pipecat way: `schema` joins the context's tools and
        `handler(params: FunctionCallParams)` (default: the one the schema carries, as MCP tools'
        do) is registered with the LLM service (`options` as for `LLMService.register_function`:
        cancel_on_interruption, timeout_secs)."""
        self.llm.register_function(schema.name, self._with_filler(handler or schema.handler), **options)
        tools = self.context.tools
        standard = list(tools.standard_tools) if isinstance(tools, ToolsSchema) else []
        self.context.set_tools(ToolsSchema(standard_tools=[*standard, schema]))

    def _with_filler(self, handler):
        """`handler`, saying `tool_filler` if it runs longer than `tool_filler_secs`: the user
        hears that something is happening. A barge-in cancels the handler, and the filler with it."""
        if not self.tool_filler:
            return handler

        @functools.wraps(handler)
        async def with_filler(params):
            async def filler():
                await asyncio.sleep(self.tool_filler_secs)
                await params.llm.push_frame(TTSSpeakFrame(self.tool_filler))

            saying = asyncio.create_task(filler())
            try:
                await handler(params)
            finally:
                saying.cancel()

        return with_filler

    async def end_after_speech_since(self, since: float, timeout: float, reason: str) -> None:
        """End the conversation once speech queued at `since` (time.monotonic()) has been played."""
        deadline = time.monotonic() + timeout
        while self.playback.last_played_at <= since and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        await self.end_after_reply(max(0.0, deadline - time.monotonic()), reason)

    async def end_after_reply(self, timeout: float, reason: str) -> None:
        """End the conversation once the reply being given is spoken (at once if none is), or at `timeout`."""
        deadline = time.monotonic() + timeout
        while self.replying() and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        await self.worker.cancel(reason=reason)

    def follow_client(self, name: str) -> None:
        """For one-client transports (WebRTC, WebSocket): greet the client when it connects, end
        the conversation when it leaves."""

        @self.transport.event_handler("on_client_connected")
        async def on_client_connected(transport, client):
            await self.greet()

        @self.transport.event_handler("on_client_disconnected")
        async def on_client_disconnected(transport, client):
            logger.info(f"client {name} disconnected")
            await self.worker.cancel()

    async def greet(self) -> None:
        """Say the greeting (when the user joins); it goes into the context like any reply."""
        if self.greeting:
            await self.worker.queue_frames([TTSSpeakFrame(self.greeting)])


def conversation_language(settings: Settings) -> ConversationLanguage | None:
    """The language state of a multilingual conversation (TTS_VOICES names more than one
    language, or STT_LANGUAGE is empty: detect); None for a one-language agent."""
    voices = settings.voice_by_language
    if len(voices) < 2 and settings.stt_language is not None:
        return None
    supported = tuple(voices) or (settings.stt_language or "en",)
    pinned = settings.stt_language is not None
    return ConversationLanguage(current=settings.stt_language or supported[0], supported=supported, pinned=pinned)


def build_conversation(
    make_transport: TransportFactory,
    engines: Engines,
    settings: Settings,
    *,
    metrics: Sequence[ConversationMetrics] = (),
    observers: Sequence[BaseObserver] = (),
    ends_without_audio: bool = True,
) -> Conversation:
    """The pipeline of one conversation; `metrics` receive its turns, errors and TTS timings.

    With `ends_without_audio`, a client that sends no audio (and hears none) for
    NO_AUDIO_TIMEOUT_SECS loses its conversation and its slot: a silent socket or a peer that
    never connected. LiveKit rooms pass False: the room tells when the user leaves, and a muted
    microphone there sends nothing at all.
    """
    # The echo canceller hears what the speaker plays (the output filter hands it every chunk)
    # and removes it from the microphone (the input filter) before VAD and STT see it.
    canceller = EchoCanceller(INPUT_SAMPLE_RATE) if settings.echo_cancellation else None
    playback = PlaybackGate(on_played=canceller.playback if canceller else None)
    audio = {
        "audio_in_enabled": True,
        "audio_out_enabled": True,
        # A pause or an interruption takes effect at a chunk boundary: 20 ms chunks (Pipecat's
        # default is 40) halve how long the agent can go on talking over the user.
        "audio_out_10ms_chunks": 2,
        "audio_out_filter": playback,
        "audio_in_filter": EchoCancellingFilter(canceller) if canceller else None,
    }
    transport = make_transport(audio)
    barge_in = BargeInTurnStartStrategy(
        playback,
        BargeInPolicy(
            min_words=settings.barge_in_min_words,
            min_speech_secs=settings.barge_in_min_speech_secs,
            false_interruption_secs=settings.false_interruption_secs,
        ),
        canceller,
    )
    language = conversation_language(settings)
    stt = WhisperSTTService(engines.stt, short_encode=settings.stt_short_encode, language=language)
    context = LLMContext()
    vad = SharedSileroVADAnalyzer(
        params=VADParams(
            start_secs=settings.vad_start_secs,
            stop_secs=settings.vad_stop_secs,
            min_volume=settings.vad_min_volume,
        ),
        pause_listener=stt,  # transcribes a segment in the quiet before its stop
    )
    user_aggregator, assistant_aggregator = LLMContextAggregatorPair(
        context,
        user_params=LLMUserAggregatorParams(
            vad_analyzer=vad,
            # Start: see BargeInTurnStartStrategy. Stop: when smart-turn v3.2 (local ONNX)
            # judges the turn complete and every speech segment is transcribed; its model shared
            # by all conversations. With `turn_speculation`, a turn it judges incomplete is
            # answered speculatively while it waits.
            user_turn_strategies=UserTurnStrategies(
                start=[barge_in],
                stop=[
                    SpeculativeTurnStopStrategy(
                        turn_analyzer=SharedSmartTurnAnalyzer(), speculate=settings.turn_speculation, vad=vad
                    )
                ]
            ),
        ),
    )
    def on_audio_dropped(kind: str) -> None:
        for sink in metrics:
            sink.count_error("audio_input")

    def on_sentence(audio_seconds: float, wall_seconds: float) -> None:
        for sink in metrics:
            sink.observe_tts_sentence(audio_seconds, wall_seconds)

    llm = TransformersLLMService(
        engines.llm,
        system_prompt=settings.system_prompt,
        max_tokens=settings.llm_max_new_tokens,
        max_sentences=settings.reply_max_sentences,
        context_tokens=settings.llm_context_tokens,
        language=language,
    )
    guard = InputAudioGuard(on_drop=on_audio_dropped)
    tts = LocalTTSService(engines.tts, on_sentence=on_sentence, language=language, voices=settings.voice_by_language)
    pipeline = Pipeline(
        [
            transport.input(),
            # Keypad digits (LiveKit SIP calls) become a user message: "DTMF: 42#".
            DTMFAggregator(),
            guard,
            stt,
            user_aggregator,
            llm,
            tts,
            playback.processor,
            transport.output(),
            playback.played_text,
            assistant_aggregator,
        ]
    )
    turns = TurnMetricsObserver(metrics, clock_of=lambda: transport.output().get_clock())
    for sink in metrics:
        sink.count_session_started()
    worker = PipelineWorker(
        pipeline,
        params=PipelineParams(
            audio_in_sample_rate=INPUT_SAMPLE_RATE,
            audio_out_sample_rate=OUTPUT_SAMPLE_RATE,
            enable_metrics=True,
            enable_usage_metrics=True,
        ),
        observers=[turns, *(observers or [])],
        rtvi_processor=ClientMessageGuard(),
        idle_timeout_frames=(InputAudioRawFrame, BotSpeakingFrame),
        idle_timeout_secs=settings.no_audio_timeout_secs if ends_without_audio else None,
        cancel_on_idle_timeout=True,
    )
    conversation = Conversation(
        worker=worker,
        transport=transport,
        context=context,
        playback=playback,
        barge_in=barge_in,
        guard=guard,
        stt=stt,
        user_aggregator=user_aggregator,
        llm=llm,
        tts=tts,
        assistant_aggregator=assistant_aggregator,
        turns=turns,
        greeting=settings.greeting,
        tool_filler=settings.tool_filler,
        tool_filler_secs=settings.tool_filler_secs,
    )
    add_call_tools(conversation, settings)
    if settings.mcp_servers:
        from agent.mcp_tools import add_mcp_tools, mcp_clients  # the `tools` extra (mcp)

        conversation.background(add_mcp_tools(conversation, mcp_clients(settings)))
    return conversation


async def run_conversation(conversation: Conversation, name: str) -> bool:
    """Run one conversation until its transport ends it (or it is cancelled); False if it failed.

    Its failure is logged here and never reaches another conversation in the process.
    """
    runner = WorkerRunner(handle_sigint=False)  # the server owns the process' signals
    logger.info(f"conversation {name} started")
    chores = [asyncio.create_task(chore) for chore in conversation.chores]
    try:
        await runner.add_workers(conversation.worker)
        await runner.run()
    except Exception:
        logger.exception(f"conversation {name} failed")
        return False
    finally:
        for chore in chores:
            chore.cancel()
        logger.info(f"conversation {name} ended")
    return True
