"""`voice-agent serve` as a real subprocess: health, web client, CLI, a spoken turn over WebRTC."""

import asyncio
import logging
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from types import SimpleNamespace

import av
import httpx
import numpy as np
import pytest
import soxr
from aiortc import MediaStreamTrack, RTCPeerConnection, RTCSessionDescription
from aiortc.mediastreams import MediaStreamError

from agent.livekit_dev_server import free_port
from agent.app import create_app
from services.stt import WhisperEngine
from services.tts_piper import PiperEngine
from harness.speech import speak_16k

REPO = Path(__file__).resolve().parents[1]
STARTUP_TIMEOUT_S = 180
REPLY_TIMEOUT_S = 45  # from the end of the question; generous because the CPUs are shared
MIC_RATE = 16000
MIC_FRAME_SAMPLES = MIC_RATE // 50  # 20 ms
VOICED_RMS = 300  # int16 RMS above which a received 20 ms frame counts as speech

# Server output goes through logging so pytest shows it under "Captured log" of a failing test.
server_log = logging.getLogger("voice-agent-server")


@dataclass
class Server:
    url: str
    process: subprocess.Popen
    lines: list[str]

    def log_tail(self, lines: int = 80) -> str:
        return "\n".join(self.lines[-lines:])

    def assert_alive(self) -> None:
        # -9 here usually means the kernel's OOM killer: the server holds every model.
        code = self.process.poll()
        assert code is None, f"server exited with {code}:\n{self.log_tail()}"


def pump_output(process: subprocess.Popen, lines: list[str]) -> None:
    for line in process.stdout:
        lines.append(line.rstrip())
        server_log.info(line.rstrip())


def wait_until_healthy(server: Server) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        server.assert_alive()
        try:
            health = httpx.get(f"{server.url}/health", timeout=2)
        except httpx.TransportError:
            health = None  # not listening yet
        if health is not None and health.status_code == 200:
            return
        if health is not None and health.json()["status"] == "failed":
            pytest.fail(f"server could not load its models:\n{server.log_tail()}")
        time.sleep(0.5)
    pytest.fail(f"server not healthy after {STARTUP_TIMEOUT_S}s:\n{server.log_tail()}")


@pytest.fixture(scope="module")
def server():
    # Module scope: the server holds its own copy of every model, so it goes as soon as
    # these tests are done rather than at the end of the whole session.
    port = free_port()
    # livekit-agents exports LIVEKIT_URL/API_KEY/API_SECRET into os.environ when a worker starts
    # (the LiveKit tests run one in this process); this server must be the peer-to-peer one.
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIVEKIT_")}
    process = subprocess.Popen(
        [sys.executable, "-m", "agent", "serve", "--port", str(port)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []
    threading.Thread(target=pump_output, args=(process, lines), daemon=True).start()
    server = Server(f"http://127.0.0.1:{port}", process, lines)
    try:
        wait_until_healthy(server)
        yield server
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


# The user's voice and the test's ears. Not the `engines` fixture: that would also load a second
# LLM in this process next to the server's, and the LLM's KV cache alone takes ~60% of RAM.
@pytest.fixture(scope="module")
def voice(settings):
    voice = PiperEngine(settings.tts_voice, workers=1, use_cuda=False)
    yield voice
    voice.close()


@pytest.fixture(scope="module")
def ears(settings):
    ears = WhisperEngine(
        settings.stt_model,
        device=settings.stt_device,
        compute_type=settings.stt_compute_type,
        workers=1,
        language=settings.stt_language,
        beam_size=settings.stt_beam_size,
        cpu_threads=settings.stt_cpu_threads,
    )
    yield ears
    ears.close()


def test_health_reports_models_and_sessions(server):
    response = httpx.get(f"{server.url}/health")
    assert response.status_code == 200
    health = response.json()
    assert health["status"] == "ok"
    assert set(health["models"]) == {"stt", "llm", "tts"}
    assert all(health["models"].values())
    assert health["sessions"] == 0


def test_browser_client_is_served(server):
    root = httpx.get(f"{server.url}/")
    assert root.is_redirect
    assert root.headers["location"] == "/client/"

    page = httpx.get(f"{server.url}/client/")
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    assert "<html" in page.text.lower()

    # The prebuilt client asks /start where to send its WebRTC offer.
    start = httpx.post(f"{server.url}/start", json={"transport": "webrtc"})
    assert start.json() == {"webrtcRequestParams": {"endpoint": "/api/offer"}}


async def test_offers_wait_while_models_load(settings):
    # In-process, with engines that are not warm yet: the state a starting server is in.
    app = create_app(settings, engines=SimpleNamespace(ready=False))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as http:  # a trusted host
        health = await http.get("/health")
        assert health.status_code == 503
        assert health.json() == {"status": "loading"}
        offer = await http.post("/api/offer", json={"sdp": "", "type": "offer"})
        assert offer.status_code == 503
        assert int(offer.headers["retry-after"]) > 0


@pytest.mark.parametrize("args", [["--help"], ["serve", "--help"], ["dev", "--help"], ["worker", "--help"]])
def test_cli_help(args):
    # The console script installed by `pip install -e .` into the test's virtualenv.
    script = Path(sys.executable).parent / "voice-agent"
    result = subprocess.run([str(script), *args], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: voice-agent")


class Microphone(MediaStreamTrack):
    """A real-time mono 16 kHz microphone: silence, except while `say()` plays PCM16."""

    kind = "audio"

    def __init__(self):
        super().__init__()
        self._pending = b""
        self._drained = asyncio.Event()
        self._samples_sent = 0
        self._started_at: float | None = None

    async def say(self, pcm: bytes) -> None:
        """Play `pcm` (PCM16 mono 16 kHz); returns once its last frame was sent."""
        self._drained.clear()
        self._pending = pcm
        await self._drained.wait()

    async def recv(self) -> av.AudioFrame:
        # Paced like a sound card, so the server hears speech at the speed it was spoken.
        if self._started_at is None:
            self._started_at = time.monotonic()
        delay = self._started_at + self._samples_sent / MIC_RATE - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)

        frame_bytes = MIC_FRAME_SAMPLES * 2
        chunk, self._pending = self._pending[:frame_bytes], self._pending[frame_bytes:]
        if not self._pending:
            self._drained.set()
        samples = np.frombuffer(chunk.ljust(frame_bytes, b"\0"), dtype=np.int16)

        frame = av.AudioFrame.from_ndarray(samples[None, :], format="s16", layout="mono")
        frame.sample_rate = MIC_RATE
        frame.pts = self._samples_sent
        frame.time_base = Fraction(1, MIC_RATE)
        self._samples_sent += MIC_FRAME_SAMPLES
        return frame


class Speaker:
    """Records the bot's track as mono int16 frames at the decoder's rate (48 kHz for Opus)."""

    def __init__(self, track: MediaStreamTrack):
        self.frames: list[np.ndarray] = []
        self.sample_rate = 0
        self.first_frame = asyncio.Event()
        self._task = asyncio.create_task(self._record(track))

    async def _record(self, track: MediaStreamTrack) -> None:
        try:
            while True:
                frame = await track.recv()
                channels = len(frame.layout.channels)
                # Decoded Opus is packed (interleaved) s16: one row of samples × channels.
                samples = frame.to_ndarray().reshape(-1, channels).mean(axis=1)
                self.frames.append(samples.astype(np.int16))
                self.sample_rate = frame.sample_rate
                self.first_frame.set()
        except MediaStreamError:
            pass  # the connection closed

    def voiced(self, start: int) -> list[int]:
        return [i for i in range(start, len(self.frames)) if rms(self.frames[i]) > VOICED_RMS]

    def seconds(self, start: int, end: int) -> float:
        return sum(len(f) for f in self.frames[start:end]) / self.sample_rate

    async def stop(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


def rms(samples: np.ndarray) -> float:
    return float(np.sqrt(np.mean(samples.astype(np.float32) ** 2)))


async def health(http: httpx.AsyncClient) -> dict:
    return (await http.get("/health")).json()


async def test_spoken_question_gets_a_spoken_answer_over_webrtc(server, voice, ears):
    question = await speak_16k(voice, "What is the capital of France?")
    microphone = Microphone()
    pc = RTCPeerConnection()
    pc.addTrack(microphone)
    # As the browser client does; without it the server's RTVI messages pile up unsent.
    pc.createDataChannel("rtvi")
    bot_track: asyncio.Future = asyncio.get_running_loop().create_future()
    pc.on("track", lambda track: bot_track.set_result(track))
    speaker = None
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
            # aiortc gathers every ICE candidate before setLocalDescription returns,
            # so the offer is complete and no trickle PATCH is needed.
            await pc.setLocalDescription(await pc.createOffer())
            offer = {"sdp": pc.localDescription.sdp, "type": pc.localDescription.type}
            response = await http.post("/api/offer", json=offer)
            assert response.status_code == 200, response.text
            answer = response.json()
            await pc.setRemoteDescription(RTCSessionDescription(answer["sdp"], answer["type"]))
            speaker = Speaker(await asyncio.wait_for(bot_track, timeout=10))

            # The server only attaches its output track once the pipeline runs, so the
            # first frame from it means the bot is listening.
            await asyncio.wait_for(speaker.first_frame.wait(), timeout=30)
            assert (await health(http))["sessions"] == 1

            await asyncio.sleep(0.5)
            await microphone.say(question)
            asked = len(speaker.frames)

            # Wait for a reply and then for 2 s of quiet after it.
            deadline = time.monotonic() + REPLY_TIMEOUT_S
            while time.monotonic() < deadline:
                await asyncio.sleep(0.25)
                server.assert_alive()
                voiced = speaker.voiced(asked)
                if len(voiced) >= 25 and speaker.seconds(voiced[-1] + 1, len(speaker.frames)) > 2:
                    break
            voiced = speaker.voiced(asked)
            assert len(voiced) >= 25, f"no reply within {REPLY_TIMEOUT_S}s\n{server.log_tail()}"
            assert (await health(http))["sessions"] == 1

            reply = np.concatenate(speaker.frames[voiced[0] : voiced[-1] + 1])
            reply_16k = soxr.resample(reply, speaker.sample_rate, 16000).astype(np.int16)
            transcript = await ears.transcribe(reply_16k.tobytes(), 16000)
            latency = speaker.seconds(asked, voiced[0])
            print(f"bot said {transcript.text!r}, {latency:.1f}s after the question")
            assert len(transcript.text.split()) >= 3, transcript.text

            await speaker.stop()
            await pc.close()
            # Closing the peer connection ends the server's conversation.
            deadline = time.monotonic() + 15
            while (await health(http))["sessions"] != 0 and time.monotonic() < deadline:
                await asyncio.sleep(0.25)
            assert (await health(http))["sessions"] == 0, server.log_tail()
    finally:
        if speaker is not None:
            await speaker.stop()
        await pc.close()
