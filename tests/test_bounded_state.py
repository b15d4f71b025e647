"""A long conversation does not grow the processors' state: only the LLM context keeps every turn."""

import asyncio
from collections import deque

from pipecat.frames.frames import LLMMessagesAppendFrame
from pipecat.processors.aggregators.llm_context import LLMContext

from harness.local_session import LocalSession

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
