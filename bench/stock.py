"""The baseline: the same conversation built the way a Pipecat user would out of the box, served over /ws.

Pipecat's own WhisperSTTService (the bundled tiny.en) and PiperTTSService (the bundled joe voice),
Silero VAD and the user-turn strategies at their defaults, sentence aggregation, and our LLM
service on the shared LLM engine (the LLM is not what is compared). Each conversation loads its
own Whisper and Piper, as a stock pipeline does.
"""

import secrets
from pathlib import Path

from fastapi import FastAPI, WebSocket
from pipecat.audio.vad.silero import SileroVADAnalyzer
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.runner import PipelineRunner
from pipecat.pipeline.task import PipelineParams, PipelineTask
from pipecat.processors.aggregators.llm_context import LLMContext
from pipecat.processors.aggregators.llm_response_universal import LLMContextAggregatorPair, LLMUserAggregatorParams
from pipecat.services.piper.tts import PiperTTSService
from pipecat.services.whisper.stt import WhisperSTTService
from pipecat.transports.websocket.fastapi import FastAPIWebsocketParams, FastAPIWebsocketTransport

from agent.config import Settings
from agent.transports.websocket import PCMJsonSerializer
from agent.turn_metrics import TurnMetricsObserver
from frames.llm import TransformersLLMService
from services.audio import INPUT_SAMPLE_RATE, OUTPUT_SAMPLE_RATE


class StockConversation:
    """What the bench needs of a conversation to log its turns (see harness.observe.TurnLog.attach)."""

    def __init__(self, worker: PipelineTask, turns: TurnMetricsObserver):
        self.worker = worker
        self.turns = turns


def create_stock_app(settings: Settings, engines) -> FastAPI:
    app = FastAPI()
    app.state.conversations = {}

    @app.websocket("/ws")
    async def stock_session(websocket: WebSocket):
        await websocket.accept()
        transport = FastAPIWebsocketTransport(
            websocket,
            FastAPIWebsocketParams(audio_in_enabled=True, audio_out_enabled=True, serializer=PCMJsonSerializer()),
        )
        stt = WhisperSTTService(
            settings=WhisperSTTService.Settings(model=settings.stt_model), device="cpu", compute_type="int8"
        )
        voice = settings.tts_voice  # the bundled .onnx; Piper looks for VOICE.onnx in download_dir
        tts = PiperTTSService(
            settings=PiperTTSService.Settings(voice=Path(voice).stem),
            download_dir=Path(voice).parent,
        )
        llm = TransformersLLMService(engines.llm, system_prompt=settings.system_prompt, max_tokens=settings.llm_max_new_tokens)
        context = LLMContext()
        user, assistant = LLMContextAggregatorPair(
            context, user_params=LLMUserAggregatorParams(vad_analyzer=SileroVADAnalyzer())
        )
        pipeline = Pipeline([transport.input(), stt, user, llm, tts, transport.output(), assistant])
        turns = TurnMetricsObserver(clock_of=lambda: transport.output().get_clock())
        task = PipelineTask(
            pipeline,
            params=PipelineParams(
                audio_in_sample_rate=INPUT_SAMPLE_RATE, audio_out_sample_rate=OUTPUT_SAMPLE_RATE, enable_metrics=True
            ),
            observers=[turns],
        )
        name = f"stock-{secrets.token_hex(4)}"
        app.state.conversations[name] = StockConversation(task, turns)

        @transport.event_handler("on_client_disconnected")
        async def on_client_disconnected(transport, client):
            await task.cancel()

        try:
            await PipelineRunner(handle_sigint=False).run(task)
        finally:
            app.state.conversations.pop(name, None)

    return app
