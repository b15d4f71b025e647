"""Seven languages over /ws: each question's language is detected, and the agent answers in it, in that language's voice.

The multilingual profile (Whisper base, Qwen2.5-0.5B, Kokoro). The user speaks with Kokoro
voices other than the agent's; what the agent says is judged by Whisper base's language detection.
"""

import asyncio
import time

import pytest

from agent.app import create_app
from agent.livekit_dev_server import free_port
from agent.ws_client import OUTPUT_RATE, VoiceClient
from harness.serving import serving
from services.audio import INPUT_SAMPLE_RATE, float_to_pcm16, pcm16_to_float

# language: (the user's voice, what they ask). The agent's voices are TTS_VOICES' defaults
# (women); the user's are men. French has one Kokoro voice, so the Spanish man speaks it, with an
# accent: a longer question than the others, so that Whisper base hears it as French.
QUESTIONS = {
    "en": ("am_michael", None, "What is the capital of Spain?"),
    "es": ("em_alex", None, "¿Cuál es la capital de Francia?"),
    "fr": ("em_alex", "fr", "Bonjour, pouvez-vous me dire quelle est la capitale de l'Allemagne ?"),
    "it": ("im_nicola", None, "Qual è la capitale della Germania?"),
    "pt": ("pm_alex", None, "Qual é a capital de Portugal?"),
    "zh": ("zm_yunjian", None, "法国的首都是哪里？"),
    "ja": ("jm_kumo", None, "日本の首都はどこですか？"),
}
REPLY_SECS = 120  # a turn on a busy 2-core machine: Whisper base, the 0.5B LLM and Kokoro


@pytest.fixture(scope="module")
async def agent(multilingual_engines, multilingual_settings):
    """`voice-agent serve --profile multilingual`, sharing the suite's multilingual engines."""
    settings = multilingual_settings.model_copy(update={"port": free_port()})
    app = create_app(settings, multilingual_engines)
    async with serving(app, settings.port):
        yield f"ws://127.0.0.1:{settings.port}/ws", app


async def speak(engines, language: str) -> bytes:
    """The question in `language`, spoken by the user's voice, as 16 kHz PCM16."""
    voice, accent, text = QUESTIONS[language]
    pcm = await engines.tts.engine.synthesize(text, voice=voice, language=accent)
    return float_to_pcm16(pcm16_to_float(pcm, engines.tts.sample_rate, INPUT_SAMPLE_RATE))


async def idle(app) -> None:
    deadline = time.monotonic() + 30
    while app.state.sessions.active:
        assert time.monotonic() < deadline, "an earlier conversation never ended"
        await asyncio.sleep(0.1)


async def test_each_language_is_detected_and_answered_in_it(agent, multilingual_engines):
    url, app = agent
    engines = multilingual_engines
    results = {}
    for language in QUESTIONS:
        await idle(app)
        question = await speak(engines, language)
        async with VoiceClient(url) as client:  # a fresh conversation for each language
            await client.until_quiet()
            reply = await client.ask(question, timeout=REPLY_SECS)
        said = await engines.stt.transcribe(bytes(reply.audio), OUTPUT_RATE, language=None)
        results[language] = (reply.language, said.language, f"{reply.heard!r} → {said.text!r}")
    print("\n" + "\n".join(f"{code}: heard as {heard}, answered in {answered}: {text}" for code, (heard, answered, text) in results.items()))
    right = [code for code, (heard, answered, _) in results.items() if heard == answered == code]
    assert len(right) >= 6, results


async def test_a_conversation_that_switches_from_spanish_to_french_answers_in_french_with_the_french_voice(
    agent, multilingual_engines
):
    url, app = agent
    engines = multilingual_engines
    await idle(app)
    async with VoiceClient(url) as client:
        await client.until_quiet()
        spanish = await client.ask(await speak(engines, "es"), timeout=REPLY_SECS)
        spoken_before = len(engines.tts.spoken)
        french = await client.ask(await speak(engines, "fr"), timeout=REPLY_SECS)
    assert (spanish.language, french.language) == ("es", "fr"), (spanish.heard, french.heard)
    said = await engines.stt.transcribe(bytes(french.audio), OUTPUT_RATE, language=None)
    assert said.language == "fr", said.text
    voices = {voice for voice, _ in engines.tts.spoken[spoken_before:]}
    assert voices == {"ff_siwis"}, engines.tts.spoken[spoken_before:]


async def test_a_pinned_language_skips_detection(agent, multilingual_engines, multilingual_settings):
    engines = multilingual_engines
    _, app = agent
    await idle(app)
    pinned = multilingual_settings.model_copy(update={"stt_language": "fr", "port": free_port()})
    pinned_app = create_app(pinned, engines)
    async with serving(pinned_app, pinned.port):
        detections = engines.stt.detections
        async with VoiceClient(f"ws://127.0.0.1:{pinned.port}/ws") as client:
            await client.until_quiet()
            reply = await client.ask(await speak(engines, "fr"), timeout=REPLY_SECS)
    assert reply.heard and reply.language == "fr", reply.heard
    assert engines.stt.detections == detections, "a pinned conversation ran language detection"
    said = await engines.stt.transcribe(bytes(reply.audio), OUTPUT_RATE, language=None)
    assert said.language == "fr", said.text
