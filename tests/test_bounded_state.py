"""A long conversation, or a long turn, does not grow the processors' state: only the LLM context keeps every turn."""

import asyncio
from collections import deque

import numpy as np
from pipecat.frames.frames import LLMMessagesAppendFrame, TranscriptionFrame
from pipecat.observers.base_observer import BaseObserver, FramePushed
from pipecat.processors.aggregators.llm_context import LLMContext

import frames.stt
from harness.local_session import LocalSession
from harness.speech import wer
from tests.test_conversation import user_messages

TURNS = 30
QUESTIONS = ["What is the capital of France?", "Name a colour.", "Say hello.", "What is two plus two?"]
CONTAINERS = (list, dict, set, deque, bytes, bytearray)


def container_sizes(obj, path: str, depth: int, seen: set[int], sizes: dict[str, int]) -> None:
    """len() of every container reachable from `obj`'s attributes, by attribute path.

    Follows attributes that are objects of this project's or Pipecat's classes (the processors
    and their strategies, gates and buffers); stops at the LLM context, the shared engines,
    asyncio machinery and the transport's speaker (a list of what was played, by design).
    """
    if id(obj) in seen or depth < 0:
        return
    seen.add(id(obj))
    for name, value in getattr(obj, "__dict__", {}).items():
        here = f"{path}.{name}"
        if isinstance(value, LLMContext) or name in ("played", "_engine", "_clock", "_task_manager"):
            continue
        if isinstance(value, CONTAINERS):
            sizes[here] = len(value)
            items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, deque)) else ()
            for i, item in enumerate(list(items)[:50]):
                if _ours(item):
                    container_sizes(item, f"{here}[{i}]", depth - 1, seen, sizes)
        elif _ours(value):
            container_sizes(value, here, depth - 1, seen, sizes)


def _ours(value) -> bool:
    module = type(value).__module__
    return module.startswith(("frames.", "agent.", "pipecat.")) and not module.startswith("pipecat.utils.asyncio")


def state_of(conversation) -> dict[str, int]:
    sizes: dict[str, int] = {}
    seen: set[int] = set()
    for name in ("guard", "stt", "user_aggregator", "llm", "tts", "playback", "barge_in", "turns", "assistant_aggregator"):
        container_sizes(getattr(conversation, name), name, 3, seen, sizes)
    container_sizes(conversation.transport.input(), "transport_input", 2, seen, sizes)
    return sizes


async def text_turn(session: LocalSession, question: str) -> None:
    """The user's words arrive as text; wait until the reply has been generated and played."""
    asked = session.now()
    await session.conversation.worker.queue_frames(
        [LLMMessagesAppendFrame(messages=[{"role": "user", "content": question}], run_llm=True)]
    )
    deadline = asked + 60
    while session.now() < deadline:
        await asyncio.sleep(0.1)
        reply = [c for c in session.played if c.started_at >= asked]
        if reply and not session.conversation.llm.generating and session.now() - (reply[-1].started_at + reply[-1].seconds) > 0.5:
            return
    raise AssertionError(f"no reply to {question!r} within 60 s")


async def test_thirty_text_turns_leave_the_processors_state_the_same_size(engines, settings):
    short = settings.model_copy(update={"llm_max_new_tokens": 12})
    async with LocalSession(engines, short) as session:
        snapshots = {}
        for turn in range(1, TURNS + 1):
            await text_turn(session, QUESTIONS[turn % len(QUESTIONS)])
            if turn in (10, TURNS):
                snapshots[turn] = state_of(session.conversation)
        messages = len(session.conversation.context.get_messages())
    assert messages >= 2 * TURNS  # the context does keep every turn
    early, late = snapshots[10], snapshots[TURNS]
    grown = {path: (early.get(path, 0), size) for path, size in late.items() if size > early.get(path, 0) + 2}
    assert not grown, f"state that grew from turn 10 to turn {TURNS}: {grown}"
    assert len(late) > 20, sorted(late)  # the walk did reach the processors' state


def test_a_user_turn_longer_than_the_prompt_budget_keeps_its_latest_words(engines):
    llm = engines.llm
    monologue = " ".join(f"sentence {n} of a very long story." for n in range(600))  # ~5000 tokens
    system = {"role": "system", "content": "You are a helpful voice assistant."}
    messages = [system, {"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello!"}]
    messages.append({"role": "user", "content": monologue + " So what do you think?"})
    fitted = llm.fit(messages, 512)
    assert len(llm.encode_chat(fitted)) <= 512
    assert fitted[0] == system and [m["role"] for m in fitted] == ["system", "user"], fitted
    assert fitted[-1]["content"].endswith("sentence 599 of a very long story. So what do you think?")
    assert "sentence 0 " not in fitted[-1]["content"]


def voiced(pcm: bytes) -> bytes:
    """The speech without its leading and trailing quiet, so that clips join without a pause."""
    samples = np.frombuffer(pcm, dtype=np.int16)
    loud = np.flatnonzero(np.abs(samples) > 500)
    return samples[loud[0] : loud[-1] + 1].tobytes()


async def test_a_user_who_never_pauses_is_transcribed_in_bounded_stretches(engines, settings, say, monkeypatch):
    # The cap is 30 s in the product; 3 s here keeps the test short. Three clips, joined with no
    # pause the VAD could end a segment at: about 7 s of unbroken speech.
    monkeypatch.setattr(frames.stt, "MAX_SEGMENT_SECS", 3.0)
    clips = [
        "the quick brown fox jumps over the lazy dog",
        "she sells sea shells by the sea shore",
        "and that is the end of my story",
    ]
    speech = b"".join([voiced(await say(text)) for text in clips])
    async with LocalSession(engines, settings) as session:
        heard = TranscriptsHeard(session.conversation.stt)
        session.conversation.worker.add_observer(heard)
        await session.silence(0.5)
        await session.speak(speech)
        stopped_speaking = session.now()
        deadline = stopped_speaking + 30
        while not user_messages(session):
            assert session.now() < deadline, "the turn never ended"
            await session.silence(0.2)
    assert len(heard.at) >= 2, heard.texts
    assert heard.at[0] < stopped_speaking - 1.0, "the first stretch was transcribed only after the user stopped"
    # Cutting mid-word costs a word at a cut, not the turn: what the user said arrives, in order.
    said = " ".join(clips)
    assert wer(said, " ".join(heard.texts)) <= 0.4, heard.texts
    assert wer(said, user_messages(session)[0]) <= 0.4, user_messages(session)


class TranscriptsHeard(BaseObserver):
    """Every transcript the STT service pushed, and when (pipeline clock)."""

    def __init__(self, stt):
        super().__init__()
        self._stt = stt
        self.at: list[float] = []
        self.texts: list[str] = []

    async def on_push_frame(self, data: FramePushed):
        if data.source is self._stt and isinstance(data.frame, TranscriptionFrame):
            self.at.append(data.timestamp / 1e9)
            self.texts.append(data.frame.text)
