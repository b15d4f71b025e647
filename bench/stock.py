"""The baseline: the same conversation built the way a Pipecat user would out of the box, over /ws, P2P or LiveKit.

Pipecat's own WhisperSTTService (the bundled tiny.en) and PiperTTSService (the bundled joe voice),
Silero VAD and the user-turn strategies at their defaults, sentence aggregation, and our LLM
service on the shared LLM engine (the LLM is not what is compared). Each conversation loads its
own Whisper and Piper, as a stock pipeline does.

Each transport is Pipecat's own, opened as its examples open it, so ours and stock are compared
over the same transport and the transport's cost is in both:
- `/ws`: FastAPIWebsocketTransport (with our /ws serializer, so the same caller speaks to both);
- `POST /api/offer`: SmallWebRTCTransport behind Pipecat's SmallWebRTCRequestHandler;
- `POST /api/session`: a fresh room and a user token for it; Pipecat's LiveKitTransport joins it
  (no livekit-agents worker). Served in the agent's process, it shares the two process-wide
  livekit-rtc fixes our LiveKit worker makes (agent/transports/livekit.py: audio received at
  16 kHz, media frames sent to their own stream only), so stock over LiveKit is faster here than
  it would be alone: the ratio to it errs in stock's favour.
"""

import asyncio
import secrets
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, WebSocket
from livekit import api
from pipecat.audio.vad.silero import SileroVADAnalyzer
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.runner import PipelineRunner
from pipecat.pipeline.task import PipelineParams, PipelineTask
from pipecat.processors.aggregators.llm_context import LLMContext
from pipecat.processors.aggregators.llm_response_universal import LLMContextAggregatorPair, LLMUserAggregatorParams
from pipecat.services.piper.tts import PiperTTSService
from pipecat.services.whisper.stt import WhisperSTTService
from pipecat.transports.base_transport import BaseTransport, TransportParams
from pipecat.transports.livekit.transport import LiveKitParams, LiveKitTransport
from pipecat.transports.smallwebrtc.connection import SmallWebRTCConnection
from pipecat.transports.smallwebrtc.request_handler import SmallWebRTCRequest, SmallWebRTCRequestHandler
from pipecat.transports.smallwebrtc.transport import SmallWebRTCTransport
from pipecat.transports.websocket.fastapi import FastAPIWebsocketParams, FastAPIWebsocketTransport

from agent.config import Settings
from agent.transports.livekit import agent_token
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
    """The stock conversation over `/ws`, `POST /api/offer` (P2P) and `POST /api/session` (LiveKit);
    `app.state.conversations`: the running ones, by the session key each caller learns."""
    running: set[asyncio.Task] = set()  # P2P and LiveKit conversations, run apart from any request
    webrtc = SmallWebRTCRequestHandler()

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        yield
        await webrtc.close()
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)

    app = FastAPI(lifespan=lifespan)
    app.state.conversations = {}

    async def converse(name: str, transport: BaseTransport) -> None:
        """Run one stock conversation on `transport` until its client leaves."""
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
        app.state.conversations[name] = StockConversation(task, turns)

        @transport.event_handler("on_client_disconnected")
        async def on_client_disconnected(_transport, _client):
            await task.cancel()

        try:
            await PipelineRunner(handle_sigint=False).run(task)
        finally:
            app.state.conversations.pop(name, None)

    def converse_in_background(name: str, transport: BaseTransport) -> None:
        task = asyncio.create_task(converse(name, transport))
        running.add(task)
        task.add_done_callback(running.discard)

    @app.websocket("/ws")
    async def websocket_session(websocket: WebSocket):
        await websocket.accept()
        params = FastAPIWebsocketParams(audio_in_enabled=True, audio_out_enabled=True, serializer=PCMJsonSerializer())
        await converse(f"stock-{secrets.token_hex(4)}", FastAPIWebsocketTransport(websocket, params))

    @app.post("/api/offer")
    async def offer(request: SmallWebRTCRequest):
        async def on_new_connection(connection: SmallWebRTCConnection) -> None:
            transport = SmallWebRTCTransport(
                webrtc_connection=connection, params=TransportParams(audio_in_enabled=True, audio_out_enabled=True)
            )
            converse_in_background(connection.pc_id, transport)

        return await webrtc.handle_web_request(request=request, webrtc_connection_callback=on_new_connection)

    @app.post("/api/session")
    async def session():
        room = f"stock-{secrets.token_hex(8)}"
        transport = LiveKitTransport(
            settings.livekit_url,
            agent_token(settings, room, "stock-agent"),
            room,
            params=LiveKitParams(audio_in_enabled=True, audio_out_enabled=True),
        )
        converse_in_background(room, transport)
        # Unlike our /api/session's token, this one dispatches no agent: stock's joins by itself.
        secret = settings.livekit_api_secret.get_secret_value()
        grants = api.VideoGrants(room_join=True, room=room)
        token = api.AccessToken(settings.livekit_api_key, secret).with_identity("caller").with_grants(grants).to_jwt()
        return {"url": settings.livekit_url, "token": token, "room": room}

    return app
