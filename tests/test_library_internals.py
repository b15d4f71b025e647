"""The private internals of Pipecat, livekit-rtc, transformers and snac the product reaches into: each still where it was.

Each test names the one function that holds the reach; when a library upgrade breaks one, fix
that function, not its callers.
"""

import asyncio
import inspect
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from pipecat.audio.turn.smart_turn.local_smart_turn_v3 import LocalSmartTurnAnalyzerV3
from pipecat.audio.vad.silero import SileroOnnxModel
from pipecat.frames.frames import LLMContextFrame, LLMFullResponseStartFrame, UserStoppedSpeakingFrame
from pipecat.processors.aggregators.llm_context import LLMContext
from pipecat.processors.frame_processor import FrameDirection
from pipecat.services.llm_service import LLMService
from pipecat.services.settings import LLMSettings
from pipecat.services.stt_service import SegmentedSTTService
from pipecat.services.tts_service import TTSService
from pipecat.turns.user_stop import TurnAnalyzerUserTurnStopStrategy
from snac.layers import DecoderBlock, NoiseBlock
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from frames import pipecat_internals
from frames.tts import SpeakableChunkAggregator
from frames.turn_taking.turn_models import SharedSileroVADAnalyzer, SharedSmartTurnAnalyzer
from frames.turn_taking.turn_stop import SpeculativeTurnStopStrategy
from harness.orpheus_models import build_random_snac
from services.batched_generation import insert_logits_processors
from services.quantized_linear import Int8Linear
from services.orpheus.snac import PositionalNoise, SnacDecoder


def test_segmented_stt_still_sizes_its_pre_roll_buffer_in_the_attribute_we_set():
    # pipecat_internals.set_stt_pre_roll
    source = inspect.getsource(SegmentedSTTService)
    assert "self._audio_buffer_size_1s = " in source and "len(self._audio_buffer) > self._audio_buffer_size_1s" in source


def test_segmented_stt_still_keeps_its_segment_and_speaking_state_where_we_read_them():
    # pipecat_internals.segment_in_progress and transcribe_segment_head
    source = inspect.getsource(SegmentedSTTService)
    assert "self._audio_buffer += frame.audio" in source and "self._user_speaking = False" in source
    stopped = inspect.getsource(SegmentedSTTService._handle_user_stopped_speaking)
    assert "self._audio_buffer.clear()" in stopped and "self._segment_queue.put(" in stopped


def test_a_silero_model_on_a_shared_session_scores_speech():
    # pipecat_internals.silero_model_on, through the analyzer that uses it
    vad = SharedSileroVADAnalyzer(sample_rate=16000)
    assert isinstance(vad._model, SileroOnnxModel)
    window = np.zeros(vad.num_frames_required(), dtype=np.int16).tobytes()
    confidence = vad.voice_confidence(window)
    assert 0.0 <= confidence < 0.5  # silence


def test_smart_turn_still_runs_its_model_from_the_attribute_we_set():
    # pipecat_internals.use_smart_turn_session
    source = inspect.getsource(LocalSmartTurnAnalyzerV3)
    assert "self._session.run(" in source
    assert SharedSmartTurnAnalyzer()._session is SharedSmartTurnAnalyzer()._session  # shared


def test_turn_stop_strategy_state_and_hooks_are_still_there():
    # pipecat_internals.turn_stop_state and OVERRIDDEN_TURN_STOP_HOOKS
    strategy = SpeculativeTurnStopStrategy(turn_analyzer=SharedSmartTurnAnalyzer())
    state = pipecat_internals.turn_stop_state(strategy)
    assert all(isinstance(value, bool) for value in state.values()), state
    for hook in pipecat_internals.OVERRIDDEN_TURN_STOP_HOOKS:
        assert inspect.iscoroutinefunction(getattr(TurnAnalyzerUserTurnStopStrategy, hook)), hook


def test_continuous_batching_still_takes_an_inserted_logits_processor():
    # services.batched_generation.insert_logits_processors
    model = LlamaForCausalLM(
        LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    ).eval()
    manager = model.init_continuous_batching(generation_config=GenerationConfig(max_new_tokens=2, eos_token_id=1))

    def first(input_ids, scores):
        return scores

    insert_logits_processors(manager, [first])
    assert manager.logit_processor.logits_processor[0] is first
    assert manager.logit_processor.do_processing


def test_snac_decoder_blocks_still_hold_the_layers_we_replace():
    # services.orpheus.snac._prepare
    model = build_random_snac(seed=0)
    blocks = [b for b in model.decoder.model if isinstance(b, DecoderBlock)]
    assert blocks and all(isinstance(b.block[1], torch.nn.ConvTranspose1d) for b in blocks)
    assert all(sum(isinstance(layer, NoiseBlock) for layer in b.block) == 1 for b in blocks)
    decoder = SnacDecoder(model, device="cpu", max_batch=1, max_wait_ms=0)
    try:
        replaced = [m for m in decoder.model.modules() if isinstance(m, PositionalNoise)]
        assert len(replaced) == len(blocks)
        assert not any(isinstance(m, NoiseBlock) for m in decoder.model.modules())
    finally:
        decoder.close()


async def test_tts_text_aggregation_still_goes_through_the_aggregator_we_set():
    # pipecat_internals.use_text_aggregator and SpeakableChunkAggregator's subclass hook
    assert "self._text_aggregator.aggregate(" in inspect.getsource(TTSService)
    now = [0.0]
    aggregator = SpeakableChunkAggregator(clock=lambda: now[0])
    chunks = []
    for token in ["Well", ", the capital", " of France is Paris", ". ", "It is", " lovely, truly", ". Bye"]:
        chunks += [aggregation.text async for aggregation in aggregator.aggregate(token)]
        now[0] += 1.0  # slow text: whole sentences
    chunks.append((await aggregator.flush()).text)
    assert chunks == ["Well, the capital of France is Paris.", "It is lovely, truly.", "Bye"]


async def test_an_llm_services_speculation_gate_still_holds_a_speculative_reply_where_we_look():
    # pipecat_internals.holds_its_reply, used by frames.llm.TransformersLLMService
    settings = {name: None for name in ("system_instruction", "temperature", "top_p", "top_k", "seed")}
    settings |= {"frequency_penalty": None, "presence_penalty": None, "user_turn_completion_config": None}
    llm = LLMService(settings=LLMSettings(model="m", max_tokens=8, filter_incomplete_user_turns=False, **settings))
    assert not pipecat_internals.holds_its_reply(llm)
    await llm.process_frame(LLMContextFrame(context=LLMContext(), speculation=True), FrameDirection.DOWNSTREAM)
    await llm.push_frame(LLMFullResponseStartFrame())
    assert pipecat_internals.holds_its_reply(llm)  # a speculative reply, held
    await llm.push_frame(UserStoppedSpeakingFrame())
    assert not pipecat_internals.holds_its_reply(llm)  # the turn ended: released


def test_rtvi_still_dispatches_client_messages_through_the_hooks_we_override():
    # pipecat_internals.OVERRIDDEN_RTVI_HOOKS, used by frames.client_messages.ClientMessageGuard
    from pipecat.processors.frameworks.rtvi import RTVIProcessor

    for hook in pipecat_internals.OVERRIDDEN_RTVI_HOOKS:
        assert inspect.iscoroutinefunction(getattr(RTVIProcessor, hook)), hook
    assert "await self._handle_message(" in inspect.getsource(RTVIProcessor._message_task_handler)


async def test_a_transport_still_declares_and_fires_its_events_through_the_hooks_we_call():
    # pipecat_internals.TRANSPORT_EVENT_HOOKS, used by agent.transports.sip.SipTransport
    from pipecat.transports.base_transport import BaseTransport

    class Announcing(BaseTransport):
        def __init__(self):
            super().__init__()
            getattr(self, pipecat_internals.TRANSPORT_EVENT_HOOKS[0])("on_client_connected")

        def input(self):
            return None

        def output(self):
            return None

    transport = Announcing()
    heard = []

    @transport.event_handler("on_client_connected")
    async def on_client_connected(transport, client):
        heard.append(client)

    await getattr(transport, pipecat_internals.TRANSPORT_EVENT_HOOKS[1])("on_client_connected", "caller")
    for _ in range(100):  # Pipecat may run handlers as tasks
        if heard:
            break
        await asyncio.sleep(0.01)
    assert heard == ["caller"]


def test_torch_still_runs_8bit_rows_on_its_int8_cpu_kernel():
    # services.quantized_linear.Int8Linear: aten._weight_int8pack_mm, int8 weights with a bf16
    # scale per output row.
    torch.manual_seed(0)
    layer = torch.nn.Linear(128, 96, bias=True)
    packed = Int8Linear(layer)
    x = torch.randn(2, 3, 128)
    with torch.inference_mode():
        expected, got = layer(x), packed(x)
    assert got.shape == expected.shape
    assert (got - expected).abs().max() < 0.02 * expected.abs().max(), (got - expected).abs().max()


def test_pipecats_websocket_transport_still_reads_every_message_with_receive():
    # agent.transports.websocket.ReplayedWebSocket hands back the messages read before admission
    # through `receive()`: a transport reading another way would skip them.
    from pipecat.transports.websocket import fastapi as pipecat_fastapi

    source = inspect.getsource(pipecat_fastapi)
    assert "await self._websocket.receive()" in source
    assert not any(f"_websocket.{way}" in source for way in ("iter_bytes", "iter_text", "receive_bytes", "receive_text", "receive_json"))


# A fresh interpreter: the test process may have built livekit-rtc's FFI client already.
RTC_RUNTIME_RACE = """
import os, threading
from livekit.rtc._ffi_client import FfiClient
from agent.transports.livekit import start_rtc_runtime

built = []
build = FfiClient.__init__
def counted(self):
    built.append(threading.current_thread().name)
    build(self)
FfiClient.__init__ = counted

start_rtc_runtime()
barrier, seen = threading.Barrier(8), []
def job_thread():
    barrier.wait()  # all eight ask for the client at the same moment, as jobs joining rooms do
    seen.append(id(FfiClient.instance))
threads = [threading.Thread(target=job_thread) for _ in range(8)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
print(len(built), len(set(seen)), flush=True)
os._exit(0)
"""


def test_the_rtc_runtime_started_up_front_is_the_one_every_job_thread_gets():
    # agent.transports.livekit.start_rtc_runtime. Without it, eight threads asking at once built
    # three or four FFI clients on livekit 1.1.21, and the rooms on the orphans never connected.
    run = subprocess.run(
        [sys.executable, "-c", RTC_RUNTIME_RACE],
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    built, distinct = run.stdout.split()
    assert (built, distinct) == ("1", "1"), f"{built} FFI clients built, job threads saw {distinct}"


LIVEKIT_PRELOAD_COST = """
import psutil
from agent.transports.livekit import skip_livekit_local_models
skip_livekit_local_models()
process = psutil.Process()
before = process.memory_info().rss
from livekit.agents.ipc import _preload  # what a job thread runs first
print((process.memory_info().rss - before) // 2**20, flush=True)
"""


def test_livekit_agents_loads_no_local_models_into_the_agent():
    # agent.transports.livekit.skip_livekit_local_models. On livekit-agents 1.8.9 the preload
    # grew the process by 6 MB with it, 253 MB without.
    run = subprocess.run(
        [sys.executable, "-c", LIVEKIT_PRELOAD_COST],
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert int(run.stdout) < 100, f"livekit-agents' preload took {run.stdout.strip()} MB"


def test_livekit_agents_warning_about_a_job_without_its_own_room_connection_is_dropped(caplog):
    # agent.transports.livekit.quiet_the_unconnected_job_warning matches livekit-agents' text.
    import logging

    from livekit.agents.ipc import job_proc_lazy_main

    from agent.transports.livekit import UNCONNECTED_JOB_WARNING, quiet_the_unconnected_job_warning

    assert UNCONNECTED_JOB_WARNING in inspect.getsource(job_proc_lazy_main), "livekit-agents reworded it"
    quiet_the_unconnected_job_warning()
    quiet_the_unconnected_job_warning()  # once is enough, however often the worker starts
    log = logging.getLogger("livekit.agents")
    with caplog.at_level(logging.WARNING, logger="livekit.agents"):
        log.warning(UNCONNECTED_JOB_WARNING + " This might mean that job_ctx.connect() was never invoked.")
        log.warning("some other warning")
    assert [r.getMessage() for r in caplog.records if r.name == "livekit.agents"] == ["some other warning"]
    assert [type(f).__name__ for f in log.filters].count("_DropUnconnectedJobWarning") == 1


async def test_livekit_media_frames_are_sent_to_their_stream_only():
    # agent.transports.livekit.send_media_frames_to_their_stream_only. Without it, on livekit
    # 1.1.21, each of three streams was sent the other two's frames as well as its own, and a
    # subscription without a filter (a request waiting for its reply) was sent all of them.
    from livekit import rtc
    from livekit.rtc._ffi_client import FfiClient

    from agent.transports.livekit import send_media_frames_to_their_stream_only

    send_media_frames_to_their_stream_only()
    waiting_for_a_reply = FfiClient.instance.queue.subscribe()
    sources = [rtc.AudioSource(48000, 1) for _ in range(3)]
    streams = [rtc.AudioStream(rtc.LocalAudioTrack.create_audio_track(f"mic-{n}", s)) for n, s in enumerate(sources)]
    others, kept = [0] * 3, [0] * 3  # frame events of other streams each was sent; its own it read
    for n, stream in enumerate(streams):
        put = stream._ffi_queue.put_nowait

        def counted(event, n=n, put=put, own=stream._ffi_handle.handle):
            others[n] += event.audio_stream_event.stream_handle != own
            put(event)

        stream._ffi_queue.put_nowait = counted

    async def listen(n):
        async for _ in streams[n]:
            kept[n] += 1

    listeners = [asyncio.create_task(listen(n)) for n in range(3)]
    try:
        # A local track's stream hears its source's silence, 100 frames a second.
        for _ in range(200):
            await asyncio.sleep(0.05)
            if min(kept) >= 20:
                break
    finally:
        for listener in listeners:
            listener.cancel()
        await asyncio.gather(*listeners, return_exceptions=True)
        for stream in streams:
            await stream.aclose()
        FfiClient.instance.queue.unsubscribe(waiting_for_a_reply)
    frames_to_the_waiter = 0
    while not waiting_for_a_reply.empty():
        frames_to_the_waiter += waiting_for_a_reply.get_nowait().WhichOneof("message") == "audio_stream_event"
    assert frames_to_the_waiter == 0, f"a request waiting for its reply was sent {frames_to_the_waiter} audio frames"
    assert min(kept) >= 20, f"the local tracks' streams heard {kept} frames"
    assert others == [0, 0, 0], f"streams were sent {others} frame events of other streams (read {kept} of their own)"


async def test_pipecats_livekit_transport_receives_room_audio_at_the_rate_we_ask():
    # agent.transports.livekit.receive_room_audio_at. Without it, on pipecat-ai 1.14.0, the
    # stream Pipecat opens for a subscribed track hands over 48 kHz audio in 10 ms frames.
    from livekit import rtc
    from pipecat.transports.livekit.transport import LiveKitCallbacks, LiveKitParams, LiveKitTransportClient
    from pipecat.utils.asyncio.task_manager import TaskManager

    from agent.transports.livekit import receive_room_audio_at

    receive_room_audio_at(16000, 20)

    async def nothing(*_):
        pass

    callbacks = LiveKitCallbacks(**{name: nothing for name in LiveKitCallbacks.model_fields})
    client = LiveKitTransportClient("ws://unused", "token", "room", LiveKitParams(), callbacks, "test")
    client._task_manager = TaskManager(loop=asyncio.get_running_loop())  # setup()'s; never connected
    source = rtc.AudioSource(48000, 1)
    track = rtc.LocalAudioTrack.create_audio_track("mic", source)  # a remote one needs a room
    await client._async_on_track_subscribed(track, None, SimpleNamespace(identity="caller"))
    try:
        frames = [(await asyncio.wait_for(client._audio_queue.get(), 10))[0].frame for _ in range(3)]
    finally:
        await client._close_audio_stream("caller")
    assert {(f.sample_rate, f.samples_per_channel) for f in frames} == {(16000, 320)}


async def test_aiortc_still_keeps_its_audio_jitter_buffer_where_we_replace_it():
    # agent.transports.webrtc_audio.release_audio_packets_at_once
    from aiortc import RTCPeerConnection
    from aiortc.rtp import RtpPacket

    from agent.transports.webrtc_audio import release_audio_packets_at_once

    caller, agent = RTCPeerConnection(), RTCPeerConnection()
    try:
        caller.addTransceiver("audio", direction="sendonly")
        await caller.setLocalDescription(await caller.createOffer())
        await agent.setRemoteDescription(caller.localDescription)
        [receiver] = agent.getReceivers()
        default = receiver._RTCRtpReceiver__jitter_buffer
        assert (default.capacity, default._prefetch) == (16, 4), "aiortc changed its audio jitter buffer"
        release_audio_packets_at_once(receiver)
        buffer = receiver._RTCRtpReceiver__jitter_buffer
        assert buffer is not default and buffer.capacity == default.capacity
        # Each 20 ms packet is a frame; a frame is released as soon as the next one arrives.
        packets = [RtpPacket(sequence_number=n, timestamp=960 * n) for n in range(3)]
        for n, packet in enumerate(packets):
            packet._data = bytes([n])  # the receiver's depacketized payload
        assert buffer.add(packets[0])[1] is None
        assert buffer.add(packets[1])[1].data == bytes([0])
        assert buffer.add(packets[2])[1].data == bytes([1])
    finally:
        await caller.close()
        await agent.close()
