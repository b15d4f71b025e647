"""Session-wide fixtures: each model is loaded once per test process and shared by every test."""

import pytest

from agent.config import Settings
from agent.engines import Engines, load_engines_warm
from harness.fixtures import live_agent, livekit_url  # noqa: F401 (fixtures)
from harness.observe import with_llm_log
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
