"""Session-wide fixtures: each model is loaded once per test process and shared by every test."""

import asyncio
from dataclasses import replace

import pytest

from agent.config import Settings
from agent.engines import Engines, load_engines_warm, load_llm, load_stt, load_tts
from harness.fixtures import live_agent, livekit_url  # noqa: F401 (fixtures)
from harness.observe import SpeechLog, with_llm_log
from services.bundled import QWEN_05B
from harness.speech import speak_16k

# The LiveKit fixtures are imported here, not in each test module: a session fixture imported
# into several modules is a separate fixture in each, which started one livekit-server and one
# agent worker per module.


@pytest.fixture(scope="session")
def settings() -> Settings:
    # The default cache dir keeps the GGUF → HF conversion across runs. Replies are capped
    # shorter than the default: waiting for 96 tokens of speech per turn only slows the suite.
    # No greeting: these tests time the user's first words from the start; tests/scenarios/
    # turns it on where the greeting is what is tested.
    return Settings(_env_file=None, llm_max_new_tokens=48, greeting="")


@pytest.fixture(scope="session")
async def engines(settings) -> Engines:
    """The engines every test shares; the LLM records each conversation's requests
    (`engines.llm.of(conversation).prompts`, `.replies`)."""
    engines = await load_engines_warm(settings)
    yield with_llm_log(engines)
    engines.close()


@pytest.fixture(scope="session")
def say(engines):
    """`await say("text")` → PCM16 at 16 kHz, cached per text."""
    cache: dict[str, bytes] = {}

    async def _say(text: str) -> bytes:
        if text not in cache:
            cache[text] = await speak_16k(engines.tts, text)
        return cache[text]

    return _say


@pytest.fixture(scope="session")
async def tool_llm(settings):
    """The small tool-calling, multilingual LLM (LLM_MODEL=qwen2.5-coder-0.5b), loaded once for
    the tool and the language tests."""
    llm = await asyncio.to_thread(load_llm, settings.model_copy(update={"llm_model": QWEN_05B, "llm_max_new_tokens": 64}))
    await llm.warmup()
    yield llm
    llm.close()


@pytest.fixture(scope="session")
def multilingual_settings() -> Settings:
    return Settings(_env_file=None, profile="multilingual", llm_max_new_tokens=48, greeting="")


@pytest.fixture(scope="session")
async def multilingual_engines(multilingual_settings, tool_llm) -> Engines:
    """The multilingual profile's engines (Whisper base, Qwen, Kokoro); the LLM records each
    conversation's requests and the voice every reply is spoken in (`engines.tts.spoken`)."""
    stt, tts = await asyncio.gather(
        asyncio.to_thread(load_stt, multilingual_settings), asyncio.to_thread(load_tts, multilingual_settings)
    )
    engines = Engines(stt=stt, llm=tool_llm, tts=tts)
    await engines.warmup()
    yield replace(with_llm_log(engines), tts=SpeechLog(tts))
    stt.close()
    tts.close()
