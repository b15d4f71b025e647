"""The LLM's continuous batch in a child process: what it streams, cancelling, a dying child, its environment."""

import asyncio
import os
import time
from functools import partial

import pytest

from agent.config import environment_without_secrets
from harness.orpheus_models import save_tiny_orpheus
from services.batched_generation import GenerationError
from services.generation_process import GeneratorProcess
from services.llm import load_batch_generator

PROMPTS = [[0, 5, 17, 300], [0, 9, 9, 1200, 44, 7], [0, 128270, 3]]


@pytest.fixture(scope="module")
def tiny_lm(tmp_path_factory) -> str:
    """A tiny random Llama saved as a hub repo holds one (the child loads it from disk)."""
    lm_dir, _ = save_tiny_orpheus(tmp_path_factory.mktemp("tiny-lm"))
    return str(lm_dir)


def build(source: str, max_new_tokens: int = 12):
    """Greedy, so the child and this process must generate the same ids."""
    return partial(load_batch_generator, source, device="cpu", dtype="float32", cpu_threads=1,
                   max_new_tokens=max_new_tokens, temperature=0.0, max_batch=4, kv_cache_tokens=4096)  # fmt: skip


async def generate(generator, prompt: list[int]) -> list[int]:
    return [token for step in [s async for s in generator.stream(prompt)] for token in step]


@pytest.fixture(scope="module")
def child(tiny_lm):
    generator = GeneratorProcess(build(tiny_lm, max_new_tokens=400), name="test")
    yield generator
    generator.close()


async def test_the_child_streams_what_the_same_batch_streams_in_this_process(tiny_lm, child):
    here = build(tiny_lm, max_new_tokens=400)()
    try:
        for prompt in PROMPTS:
            expected = await generate(here, prompt)
            assert len(expected) > 0
            assert await generate(child, prompt) == expected
        # At once, as conversations ask: each stream gets its own request's ids.
        together = await asyncio.gather(*(generate(child, p) for p in PROMPTS))
        assert together == [await generate(here, p) for p in PROMPTS]
    finally:
        here.close()
    assert child.in_flight == 0 and child.stats.failed == 0


@pytest.fixture(scope="module")
def here(tiny_lm):
    generator = build(tiny_lm, max_new_tokens=400)()
    yield generator
    generator.close()


@pytest.mark.parametrize("where", ["child", "here"])
async def test_cancelling_a_request_ends_its_stream_at_once_and_not_the_others(where, request):
    generator = request.getfixturevalue(where)
    before = generator.stats.cancelled
    long = generator.stream(PROMPTS[0], request_id="long")
    first = await anext(long)
    assert first
    # A busy loop: the engine's next steps wait to be queued for the stream, and are queued now,
    # before the cancel. A barge-in on a loaded machine is this. (Briefly: 400 tokens of the tiny
    # model take well under a second, and a request that finished cannot be cancelled.)
    time.sleep(0.1)
    await asyncio.sleep(0)
    other = asyncio.create_task(generate(generator, PROMPTS[1]))
    generator.cancel("long")
    assert generator.stats.cancelled == before + 1, "the request must still have been generating"
    assert [step async for step in long] == []  # ended at once: nothing queued before the cancel is read
    assert len(await other) > 0  # the batch goes on for the rest
    assert generator.in_flight == 0


@pytest.mark.parametrize("where", ["child", "here"])
async def test_a_request_cancelled_as_it_finishes_is_counted_once(where, request):
    # A barge-in just as the engine finished the reply, before its stream read the end: the
    # caller cancelled it, and it counts as that, once (not as nothing: the stats then drift).
    generator = request.getfixturevalue(where)
    finished, cancelled = generator.stats.finished, generator.stats.cancelled
    short = generator.stream(PROMPTS[0], request_id="short", max_new_tokens=3)
    assert await anext(short)
    time.sleep(0.5)  # the engine finishes the request; its end waits to be read
    await asyncio.sleep(0)
    generator.cancel("short")
    await short.aclose()
    assert (generator.stats.finished, generator.stats.cancelled) == (finished, cancelled + 1)
    assert generator.in_flight == 0


async def test_a_child_that_dies_fails_its_requests_and_says_why(tiny_lm):
    dying = GeneratorProcess(build(tiny_lm, max_new_tokens=400), name="dying")
    stream = dying.stream(PROMPTS[0])
    assert await anext(stream)
    dying._process.kill()
    with pytest.raises(GenerationError, match="exited"):
        async for _ in stream:
            pass
    with pytest.raises(GenerationError, match="exited"):
        await generate(dying, PROMPTS[1])
    assert dying.in_flight == 0 and dying.stats.failed == 1
    assert "exited" in dying.failure
    dying.close()  # nothing left to stop; returns


def test_a_child_that_cannot_build_says_why(tmp_path):
    with pytest.raises(RuntimeError, match="failed to start"):
        GeneratorProcess(build(str(tmp_path / "no-such-model")), name="broken")


def test_the_child_gets_no_secret_from_the_environment(tiny_lm, monkeypatch):
    monkeypatch.setenv("LIVEKIT_API_SECRET", "do-not-leak")
    monkeypatch.setenv("API_KEY", "do-not-leak")
    generator = GeneratorProcess(build(tiny_lm), name="clean", env=environment_without_secrets(),
                                 secrets={"HF_TOKEN": "hf_for_the_load_only"})  # fmt: skip
    try:
        environ = open(f"/proc/{generator._process.pid}/environ", "rb").read()
    finally:
        generator.close()
    assert b"do-not-leak" not in environ and b"hf_for_the_load_only" not in environ
    assert os.environ["API_KEY"] == "do-not-leak"  # ours is untouched
