"""Broken and hostile input: the conversation logs a clear error, survives, and goes on answering."""

import asyncio

import numpy as np
import pytest
import soxr
from loguru import logger
from pipecat.frames.frames import InputAudioRawFrame, InputTransportMessageFrame, OutputTransportMessageUrgentFrame
from pipecat.observers.base_observer import BaseObserver, FramePushed

from frames.client_messages import MAX_SEND_TEXT_CHARS
from harness.local_session import LocalSession
from services.audio import AudioFormatError
from harness.speech import wer
from tests.test_conversation import user_messages, user_turn


@pytest.fixture
def log_lines():
    lines: list[str] = []
    sink = logger.add(lambda m: lines.append(m.record["message"]), level="WARNING")
    yield lines
    logger.remove(sink)


def frames_of(pcm: bytes, rate: int) -> list[InputAudioRawFrame]:
    step = rate // 50 * 2  # 20 ms
    return [InputAudioRawFrame(audio=pcm[i : i + step], sample_rate=rate, num_channels=1) for i in range(0, len(pcm), step)]


async def test_bad_frames_are_logged_and_the_conversation_goes_on(engines, settings, say, log_lines):
    async with LocalSession(engines, settings) as session:
        await session.silence(0.5)
        # Invalid: empty, odd byte counts, an impossible rate. Dropped with a clear error.
        await session.send(InputAudioRawFrame(audio=b"", sample_rate=16000, num_channels=1))
        for _ in range(50):
            await session.send(InputAudioRawFrame(audio=b"\x01" * 641, sample_rate=16000, num_channels=1))
        await session.send(InputAudioRawFrame(audio=b"\x00\x00" * 20, sample_rate=1000, num_channels=1))

        # A client at 48 kHz (a wrong rate for the pipeline) is resampled and still understood.
        question = "What is the capital of France?"
        pcm16k = np.frombuffer(await say(question), dtype=np.int16).astype(np.float32)
        pcm48k = soxr.resample(pcm16k, 16000, 48000).astype(np.int16).tobytes()
        await session.transport.input().speak(pcm48k, 48000)
        ended = session.now()
        while not session.played_audio(start=ended):
            assert session.now() - ended < 20, "no answer to the 48 kHz question"
            await asyncio.sleep(0.1)
        assert wer(question, user_messages(session)[0]) <= 0.25
        await asyncio.sleep(3)

        # A minute of silence (faster than real time) makes no turn and no reply.
        turns_before = len(user_messages(session))
        await session.transport.input().speak(b"\x00\x00" * 16000 * 60, 16000, realtime=False)
        await session.silence(1.0)
        assert len(user_messages(session)) == turns_before

        # Half a minute of non-stop speech: no crash.
        paragraph = (
            "I would like to tell you about my weekend. On Saturday I went to the market and bought "
            "apples, bread, cheese and some flowers for my mother. Then I walked along the river with "
            "my dog and we met a friend from school who told me about his new job in the city."
        )
        speech = await say(paragraph)
        while len(speech) < 2 * 16000 * 30:
            speech += speech
        await session.speak(speech[: 2 * 16000 * 30])
        await session.silence(6.0)

        # The conversation still works.
        await session.silence(1.0)
        question = "How many legs does a spider have?"
        _, reply = await user_turn(session, say, question)
        assert reply
        assert wer(question, user_messages(session)[-1]) <= 0.25

    guard = session.conversation.guard
    # Empty frames never reach the guard: Pipecat's input transport skips them.
    assert guard.dropped == {"misaligned": 50, "bad_rate": 1}
    assert guard.resampled_frames > 0
    assert any("not whole 16-bit samples" in line for line in log_lines)
    assert any("outside 8000..192000 Hz" in line for line in log_lines)
    assert any("resampling to 16000 Hz" in line for line in log_lines)
    # Rate-limited: fifty bad frames, one line.
    assert sum("not whole 16-bit samples" in line for line in log_lines) == 1


async def test_stt_engine_rejects_invalid_audio_with_a_clear_error(engines):
    with pytest.raises(AudioFormatError, match="even byte count"):
        await engines.stt.transcribe(b"\x00" * 101, 16000)
    with pytest.raises(AudioFormatError, match="outside"):
        await engines.stt.transcribe(b"\x00\x00" * 100, 100)
    empty = await engines.stt.transcribe(b"", 16000)
    assert empty.text == ""
    # A failed call leaves the shared engine working for everyone else.
    silence = await engines.stt.transcribe(b"\x00\x00" * 16000, 16000)
    assert silence.audio_seconds == pytest.approx(1.0)


class ErrorResponses(BaseObserver):
    """The RTVI error responses a conversation sent its client, by message id."""

    def __init__(self):
        super().__init__()
        self.by_id: dict[str, str] = {}

    async def on_push_frame(self, data: FramePushed):
        message = getattr(data.frame, "message", None)
        if isinstance(data.frame, OutputTransportMessageUrgentFrame) and isinstance(message, dict):
            if message.get("type") == "error-response":
                self.by_id[message["id"]] = message["data"]["error"]


async def test_a_client_cannot_flood_the_shared_llm_with_messages(engines, settings):
    """RTVI client messages (a WebRTC data channel) are refused unless they are what our clients send."""
    async with LocalSession(engines, settings) as session:
        errors = ErrorResponses()
        session.conversation.worker.add_observer(errors)
        llm = engines.llm.of(session.conversation)

        async def send(id: str, type: str, data: dict) -> None:
            message = {"label": "rtvi-ai", "type": type, "id": id, "data": data}
            await session.transport.input().broadcast_frame(InputTransportMessageFrame, message=message)

        await send("flood", "send-text", {"content": "Tell me everything. " * 5000})
        await send("audio", "raw-audio", {"base64Audio": "AAAA", "sampleRate": 8123, "numChannels": 1})
        await send("file", "send-file", {"content": {"type": "bytes", "bytes": "AAAA"}})
        for _ in range(200):
            if len(errors.by_id) == 3:
                break
            await asyncio.sleep(0.1)
        assert f"at most {MAX_SEND_TEXT_CHARS}" in errors.by_id["flood"], errors.by_id
        assert "not accepted" in errors.by_id["audio"] and "not accepted" in errors.by_id["file"], errors.by_id
        assert llm.prompts == []  # nothing reached the LLM

        # A line of typed text is what a client may send: it is answered.
        await send("line", "send-text", {"content": "What is the capital of France?"})
        for _ in range(600):
            if llm.replies and "." in llm.replies[-1]:
                break
            await asyncio.sleep(0.1)
        assert llm.prompts[-1][-1] == {"role": "user", "content": "What is the capital of France?"}
        assert "paris" in llm.replies[-1].lower(), llm.replies
        assert "line" not in errors.by_id
