"""The agent over a plain WebSocket (`/ws`) and `voice-agent client`: real speech in, real speech out."""

import asyncio
import json
import sys
import time
import wave

import pytest
from pydantic import SecretStr
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from agent.livekit_dev_server import free_port
from agent.app import create_app
from agent.transports.websocket import MAX_AUDIO_MESSAGE_BYTES as MAX_MESSAGE_BYTES
from agent.ws_client import OUTPUT_RATE, VoiceClient
from harness.serving import serving
from harness.speech import normalize, wer
from tests.test_concurrency import QUESTIONS

API_KEY = "ws-test-key"


@pytest.fixture(scope="module")
async def ws_app(engines, settings):
    """The agent as `voice-agent serve` runs it (peer-to-peer mode, API key set), sharing the test's engines."""
    agent_settings = settings.model_copy(update={"api_key": SecretStr(API_KEY), "port": free_port()})
    app = create_app(agent_settings, engines)
    async with serving(app, agent_settings.port):
        yield f"ws://127.0.0.1:{agent_settings.port}/ws", app


@pytest.fixture
async def ws_url(ws_app):
    """The agent's /ws, once the conversations of earlier tests have all ended (freeing their slots)."""
    url, app = ws_app
    deadline = time.monotonic() + 30
    while app.state.sessions.active:
        assert time.monotonic() < deadline, "conversations of an earlier test never ended"
        await asyncio.sleep(0.1)
    return url


def client(url: str) -> VoiceClient:
    return VoiceClient(url, api_key=API_KEY)


async def test_the_client_holds_a_two_turn_conversation_from_files(ws_url, engines, say, tmp_path):
    questions = ["What is the capital of France?", "And what is the capital of Italy?"]
    inputs = []
    for n, question in enumerate(questions):
        path = tmp_path / f"question-{n}.wav"
        with wave.open(str(path), "wb") as wav:
            wav.setnchannels(1)
            wav.setsampwidth(2)
            wav.setframerate(16000)
            wav.writeframes(await say(question))
        inputs += ["--input", str(path)]
    output = tmp_path / "replies.wav"
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "agent", "client", ws_url, *inputs, "--output", str(output), "--api-key", API_KEY,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    stdout, stderr = await asyncio.wait_for(process.communicate(), 180)
    assert process.returncode == 0, stderr.decode()[-2000:]
    lines = stdout.decode().splitlines()
    heard = [line.removeprefix("you:").strip() for line in lines if line.startswith("you:")]
    said = [line.removeprefix("agent:").strip() for line in lines if line.startswith("agent:")]
    assert len(heard) == len(said) == 2, lines
    for question, transcript in zip(questions, heard):
        assert wer(question, transcript) <= 0.35, (question, transcript)
    assert "paris" in normalize(said[0]), said
    # The second reply answers the second question as it was heard (tiny.en on a busy machine
    # has heard "Italy" as "Dibbly": "The capital of Dibbly is London." is then an answer to it).
    country = normalize(heard[1]).split()[-1]
    assert "rome" in normalize(said[1]) or country in normalize(said[1]), (heard, said)
    # The replies' audio, as the client saved it, says what the agent's words say.
    with wave.open(str(output)) as wav:
        assert wav.getframerate() == OUTPUT_RATE
        audio = wav.readframes(wav.getnframes())
    spoken = (await engines.stt.transcribe(audio, OUTPUT_RATE)).text
    assert wer(" ".join(said), spoken) <= 0.4, (said, spoken)


async def test_barge_in_over_the_websocket(ws_url, say):
    async with client(ws_url) as c:
        await c.until_quiet()
        asked = len(c.events)
        await c.stream(await say("Tell me a long story about a dragon and a brave knight."))
        await c.wait_for("bot-started-speaking", after=asked, timeout=30)
        await c.silence(1.5)  # let it talk
        # ...and cut in while its voice is heard: on a loaded machine the story may pause between
        # sentences (the first sentence must not: see test_spoken_reply.py).
        deadline = time.monotonic() + 20
        while time.monotonic() - c.last_audio_at >= 0.1 and time.monotonic() < deadline:
            await c.silence(0.02)
        assert time.monotonic() - c.last_audio_at < 0.2, "the agent should be talking"
        cut_in = len(c.events)
        cut_in_at = time.monotonic()
        stop = await say("Stop. What is the capital of Germany?")
        await c.stream(stop)
        # The story's audio stops at once: the agent pauses within one chunk of the user's voice
        # (and the turn that follows interrupts it). Its answer cannot start before the user ends.
        await c.wait_for("interrupted", after=cut_in, timeout=10)
        story_ended_at = max(t for t in c.audio_times if t < cut_in_at + len(stop) / 2 / 16000)
        assert story_ended_at - cut_in_at < 1.0, f"story audio went on {story_ended_at - cut_in_at:.2f}s"
        answered = len(c.events)
        await c.wait_for("bot-stopped-speaking", after=answered, timeout=60)
        words = " ".join(e["data"]["text"] for e in c.events[answered:] if e.get("type") == "bot-tts-text")
    assert "berlin" in normalize(words), words


async def test_bad_messages_get_errors_and_the_connection_stays_usable(ws_url, say):
    bad = [
        "garbage",  # not JSON
        "[1, 2, 3]",  # JSON, not an object
        json.dumps({"type": "dance"}),  # unknown type
        json.dumps({"type": "start", "sample_rate": 8000}),  # a rate the server does not take
        b"\x01" * 70000,  # oversize audio
        b"\x01\x02\x03",  # odd byte count: not PCM16
        "[" * 2000 + "]" * 2000,  # under the size cap, nested past the JSON parser's stack
    ]

    async def misbehave_then_talk() -> str:
        async with client(ws_url) as c:
            for message in bad:
                await c.send(message)
            await c.until_quiet()
            errors = [e for e in c.events if e.get("type") == "error"]
            assert len(errors) == len(bad), errors
            reply = await c.ask(await say("What is the capital of France?"))
            return reply.text

    async def behave() -> str:
        async with client(ws_url) as c:
            await c.until_quiet()
            reply = await c.ask(await say("How many legs does a spider have?"))
            assert not [e for e in c.events if e.get("type") == "error"]
            return reply.text

    misbehaved, behaved = await asyncio.gather(misbehave_then_talk(), behave())
    assert "paris" in normalize(misbehaved), misbehaved
    assert behaved, "the other connection got no reply"


async def test_a_missing_api_key_is_refused_with_a_reason(ws_url):
    async with connect(ws_url) as ws:
        message = json.loads(await ws.recv())
        assert message == {"type": "error", "message": "missing or wrong API key"}
        with pytest.raises(ConnectionClosed) as closed:
            await ws.recv()
    assert closed.value.rcvd.code == 1008


async def test_eight_clients_at_once_are_all_answered(ws_url, say):
    async def one(question: str):
        async with client(ws_url) as c:
            await c.until_quiet()
            return await c.ask(await say(question), timeout=120)

    replies = await asyncio.gather(*(one(q) for q in QUESTIONS))
    for question, reply in zip(QUESTIONS, replies):
        assert wer(question, reply.heard) <= 0.5, (question, reply.heard)
        assert reply.text and len(reply.audio) / 2 / OUTPUT_RATE > 0.5, (question, reply.text)


def rss_mb() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:")) / 1024


def socket_buffer_secs() -> float:
    """Seconds of 16 kHz PCM16 that a loopback TCP connection's send and receive buffers can hold at most."""
    most = 0
    for name in ("tcp_rmem", "tcp_wmem"):
        try:
            most += int(open(f"/proc/sys/net/ipv4/{name}").read().split()[2])
        except (OSError, IndexError, ValueError):
            most += 6 * 1024 * 1024  # Linux's default maximum
    return most / (2 * 16000)


async def test_an_audio_flood_is_read_in_real_time_and_others_are_answered(ws_url, say, engines):
    """A client sending speech as fast as the network allows, for 20 s: the server reads it no
    faster than it is spoken, another user is answered meanwhile, and the memory it took is given back."""

    async def one_turn(question: str) -> str:
        async with client(ws_url) as c:
            await c.until_quiet()
            return (await c.ask(await say(question), timeout=120)).text

    # Two conversations at once first, so that RSS is measured with every engine thread warm.
    await asyncio.gather(one_turn("What is the capital of France?"), one_turn("What do bees make?"))
    speech = await say("Let me tell you about my day, it was long and full of meetings.")
    # The flood is one long segment, transcribed at every pause in it at its length so far (up to
    # 30 s, see frames/stt.py): CTranslate2 keeps the buffers of each new length it encodes
    # (~200 MB over 5-25 s, once per process). Other tests' long turns warm them in a whole run;
    # here the engine encodes such lengths once first, so only what the flood keeps is measured.
    long_speech = speech * (30 * 16000 * 2 // len(speech) + 1)
    for seconds in (5, 10, 15, 20, 25, 30):
        await engines.stt.transcribe(long_speech[: seconds * 16000 * 2], 16000, short=True)
    await engines.stt.transcribe(long_speech[: 30 * 16000 * 2], 16000, short=False)
    before = rss_mb()
    message = (speech * (MAX_MESSAGE_BYTES // len(speech) + 1))[:MAX_MESSAGE_BYTES]
    sent_secs = 0.0

    async def flood():
        nonlocal sent_secs
        ws = await connect(ws_url, additional_headers={"Authorization": f"Bearer {API_KEY}"}, close_timeout=1)
        began = time.monotonic()
        try:
            while time.monotonic() - began < 20:
                await ws.send(message)
                sent_secs += len(message) / 2 / 16000
        except (ConnectionClosed, ConnectionResetError):
            pass  # the server may drop it: its keepalive pongs wait behind the audio it has not read
        finally:
            await ws.close()

    flooding = asyncio.create_task(flood())
    async with client(ws_url) as c:
        await c.until_quiet()
        reply = await c.ask(await say("How many legs does a spider have?"), timeout=120)
        assert not c.closed
    await flooding
    # What the attacker got onto the wire in 20 s: 20 s of speech, 3 s of burst, the server's queue
    # of 32 messages, and what the kernel's loopback socket buffers hold (they autotune up to
    # tcp_rmem + tcp_wmem's maxima: 36 MB, ~1150 s of audio, on the CI box). Unpaced it was ~7000 s.
    assert sent_secs < 20 + 3 + 32 * 2 + socket_buffer_secs(), sent_secs
    assert wer("How many legs does a spider have?", reply.heard) <= 0.5 and reply.text, (reply.heard, reply.text)
    deadline = time.monotonic() + 60
    while rss_mb() - before > 50 and time.monotonic() < deadline:
        await asyncio.sleep(1)
    assert rss_mb() - before <= 50, f"RSS grew {rss_mb() - before:.0f} MB with the flood"
