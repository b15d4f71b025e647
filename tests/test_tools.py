"""Function calling from the local LLM, the Pipecat way: spoken requests, real handlers, spoken results.

The model is the small tool-capable one from PyPI (LLM_MODEL=qwen2.5-coder-0.5b, the `tools`
extra); speech to and from the agent is real (Piper, and tiny.en as the judge).
"""

import asyncio
import re
import sys
import time
from pathlib import Path
from dataclasses import replace

import pytest
from pipecat.adapters.llm.schemas.function_schema import FunctionSchema

from agent.app import create_app
from agent.engines import warn_if_tools_unsupported
from agent.livekit_dev_server import free_port
from harness.caller import Microphone, WebSocketTransport
from harness.local_session import LocalSession
from harness.observe import LLMLog
from harness.serving import serving
from harness.speech import normalize, sounds_like, wer
from services.bundled import QWEN_05B
from tests.test_conversation import BOT_RATE, wait_for_reply

BOOK_TABLE = FunctionSchema(
    name="book_table",
    description="Book a table at the restaurant.",
    properties={
        "name": {"type": "string", "description": "the name the booking is under"},
        "party_size": {"type": "integer", "description": "how many people"},
        "time": {"type": "string", "description": "the time, e.g. 19:00"},
        "date": {"type": "string", "description": "the day"},
    },
    required=["name", "party_size", "time"],
)
CONFIRMATION = "blue harbor"  # words, so that the spoken code survives speech recognition


def heard_the_code(heard: str) -> bool:
    """Both words of the code, in order, at most one word apart: the model may write the code as
    "blue-harbor", and Whisper then hears the voice read it "blue to harbor"."""
    first, second = CONFIRMATION.split()
    return re.search(rf"\b{first}(?: \w+)? {second}\b", normalize(heard)) is not None
TOOL_SECS = 120  # a call, its handler and the spoken reply on a busy 2-core machine


@pytest.fixture(scope="module")
def tool_engines(engines, settings, tool_llm):
    """The suite's STT and voice with the tool-capable LLM, and settings that name it."""
    tool_settings = settings.model_copy(update={"llm_model": QWEN_05B, "llm_max_new_tokens": 64})
    return replace(engines, llm=LLMLog(tool_llm)), tool_settings


async def until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.1)


async def ask(session: LocalSession, engines, say, text: str) -> str:
    """Say `text` and wait until the agent has answered and gone quiet: what it said, transcribed."""
    llm = session.conversation.llm
    asked = llm.requests
    await session.speak(await say(text))
    ended = session.now()
    prompts = engines.llm.of(session.conversation).prompts
    await until(lambda: llm.requests > asked and not session.conversation.replying(), TOOL_SECS, f"no answer to {text!r}: {prompts}")
    await until(lambda: session.played_audio(start=ended), TOOL_SECS, f"the agent never spoke after {text!r}: {prompts}")
    await wait_for_reply(session, after=ended, quiet=1.0, timeout=TOOL_SECS)
    spoken = session.played_audio(start=ended)
    return (await engines.stt.transcribe(spoken, BOT_RATE)).text


def assert_answered(engines, session: LocalSession, heard: str, word: str) -> None:
    """The model's last reply has `word` and the agent was heard saying it. The word is checked in
    the text and matched by sound in the audio: a lone answer word is where tiny.en slips."""
    written = engines.llm.of(session.conversation).replies[-1]
    assert word in normalize(written).split() and sounds_like(word, heard), (written, heard)


async def test_a_spoken_booking_calls_the_handler_once_and_the_agent_speaks_its_confirmation(tool_engines, say):
    engines, settings = tool_engines
    booked = []

    async def book_table(params):
        booked.append(dict(params.arguments))
        await params.result_callback({"booked": True, "confirmation_code": CONFIRMATION})

    async with LocalSession(engines, settings) as session:
        session.conversation.add_tool(BOOK_TABLE, book_table)
        heard = await ask(session, engines, say, "Please book a table for two people tomorrow at seven in the evening, the name is Garcia.")

    assert len(booked) == 1, booked
    assert booked[0]["party_size"] == 2 and "garcia" in str(booked[0]["name"]).lower(), booked
    assert heard_the_code(heard), heard
    assert "name" not in normalize(heard).split()[:2], "the call itself was spoken"


async def test_a_tool_that_fails_is_told_to_the_user_and_the_next_question_is_answered(tool_engines, say):
    engines, settings = tool_engines

    async def book_table(params):
        raise RuntimeError("the booking system is down")

    async with LocalSession(engines, settings) as session:
        session.conversation.add_tool(BOOK_TABLE, book_table)
        heard = await ask(session, engines, say, "Please book a table for two people tomorrow at seven in the evening, the name is Garcia.")
        assert heard.strip(), "the agent said nothing after the failed call"
        tool_results = [m for m in session.conversation.context.get_messages() if m["role"] == "tool"]
        assert tool_results and "book_table" in str(tool_results[-1]["content"]), tool_results
        answer = await ask(session, engines, say, "What is the capital of France?")
        assert_answered(engines, session, answer, "paris")


async def test_a_barge_in_while_a_slow_tool_runs_cancels_it_and_the_new_question_is_answered(tool_engines, say):
    engines, settings = tool_engines
    started, cancelled = asyncio.Event(), asyncio.Event()

    async def book_table(params):
        started.set()
        try:
            # A slow booking system: 8 s, time for the filler to be said before the barge-in.
            await asyncio.sleep(8.0)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        await params.result_callback({"booked": True, "confirmation_code": CONFIRMATION})

    async with LocalSession(engines, settings) as session:
        session.conversation.add_tool(BOOK_TABLE, book_table)
        await session.speak(await say("Please book a table for two people tomorrow at seven in the evening, the name is Garcia."))
        await asyncio.wait_for(started.wait(), TOOL_SECS)
        # The tool is slow: the agent says so while it runs.
        since = session.now()
        await until(lambda: session.played_audio(start=since), 30, "no filler while the slow tool ran")
        await wait_for_reply(session, after=since, quiet=0.5)
        filler = (await engines.stt.transcribe(session.played_audio(start=since), BOT_RATE)).text
        assert "moment" in normalize(filler), filler
        answer = await ask(session, engines, say, "Sorry, forget that. What is the capital of France?")
        assert cancelled.is_set(), "the slow tool went on after the barge-in"
        assert_answered(engines, session, answer, "paris")


async def test_goodbye_with_end_call_enabled_closes_the_websocket_from_the_server(tool_engines, say):
    engines, settings = tool_engines
    agent_settings = settings.model_copy(update={"port": free_port(), "tools_end_call": True})
    app = create_app(agent_settings, engines)
    async with serving(app, agent_settings.port):
        client = WebSocketTransport(f"http://127.0.0.1:{agent_settings.port}", None)
        mic = Microphone()
        await client.connect(mic)
        try:
            mic.say(await say("Thank you, that's all, goodbye."))
            await until(lambda: client.failure is not None, TOOL_SECS, "the agent never ended the session")
        finally:
            await client.close()
    assert "closed the WebSocket" in client.failure, client.failure
    goodbye = (await engines.stt.transcribe(b"".join(h.audio for h in client.heard), client.rate)).text
    # Judged on the whole phrase: tiny.en heard a lone "Goodbye!" as "We bye."
    assert wer(agent_settings.goodbye, goodbye) <= 0.4, f"the agent hung up without its goodbye: heard {goodbye!r}"


MCP_SERVER = Path(__file__).resolve().parents[1] / "harness" / "mcp_opening_hours.py"


async def test_a_tool_from_an_mcp_server_is_listed_and_called(tool_engines, say, tmp_path):
    engines, settings = tool_engines
    calls = tmp_path / "calls.txt"
    with_mcp = settings.model_copy(update={"mcp_servers": f"{sys.executable} {MCP_SERVER} {calls}"})
    async with LocalSession(engines, with_mcp) as session:
        context = session.conversation.context
        await until(
            lambda: any(t.name == "opening_hours" for t in getattr(context.tools, "standard_tools", [])),
            60,
            "the MCP server's tool was never listed",
        )
        heard = await ask(session, engines, say, "What are your opening hours on Monday?")
    assert calls.is_file() and "monday" in calls.read_text().lower(), "the MCP tool was never called"
    assert any(w in normalize(heard).split() for w in ("nine", "9", "five", "5")), heard


async def test_with_a_model_that_cannot_call_tools_there_is_a_warning_and_conversations_work(engines, settings, say):
    with_tools = settings.model_copy(update={"tools_end_call": True})
    assert warn_if_tools_unsupported(with_tools, engines.llm)  # the bundled SmolLM2: its template has no tools
    async with LocalSession(engines, with_tools) as session:
        heard = await ask(session, engines, say, "What is the capital of France?")
        assert_answered(engines, session, heard, "paris")
