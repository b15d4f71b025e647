"""A held reply's first chunk is synthesized while the reply is held, and spoken from that audio once released."""

import pytest

from frames.held_reply import FirstChunkAhead, HeldReplyTextFrame
from frames.tts import SpeakableChunkAggregator
from harness.speech import heard_as

# As the LLM service sends a reply (services/spoken_reply.py): each word once the next one begins,
# a reply's last sentence at its end.
DELTAS = ["The ", "capital ", "of ", "France ", "is ", "Paris."]


def ahead_of(engine) -> FirstChunkAhead:
    # Without the voice's sampling noise: the same audio in every run, so what Whisper makes of a
    # three-word chunk does not vary between runs (with it, "The capital of" once came out "the
    # cap that will look.").
    return FirstChunkAhead(
        lambda: SpeakableChunkAggregator(words_per_sec=0), lambda text: engine.stream(text, repeatable=True)
    )


async def hold(ahead: FirstChunkAhead, deltas: list[str], *, reply_id: str = "llm-0", ended: bool = False) -> None:
    for text in deltas:
        await ahead.add(HeldReplyTextFrame(reply_id=reply_id, text=text))
    if ended:
        await ahead.add(HeldReplyTextFrame(reply_id=reply_id, text="", reply_ended=True))


async def spoken(audio) -> bytes:
    return b"".join([chunk async for chunk in audio])


async def test_the_first_chunk_is_made_ahead_and_spoken_for_its_text_or_a_longer_one(engines):
    tts, stt = engines.tts, engines.stt
    for released_chunk in ("The capital of", "The capital of France is Paris."):
        ahead = ahead_of(tts)
        await hold(ahead, DELTAS)
        # Three words once a fourth is whole, however slowly they came: the TTS service speaks them
        # alone (a reply generated fast) or as the start of a longer chunk (slowly).
        assert ahead.take("The capital") is None and ahead.take("The capitals of France") is None
        audio = ahead.take(f" {released_chunk}")
        assert audio is not None and ahead.voiced == 1
        heard = await stt.transcribe(await spoken(audio), tts.sample_rate)
        assert heard_as(released_chunk, heard.text), (released_chunk, heard.text)
        assert ahead.take(released_chunk) is None  # spoken once


async def test_a_short_reply_is_made_ahead_once_it_ends(engines):
    ahead = ahead_of(engines.tts)
    await hold(ahead, ["Paris."])
    assert ahead.take("Paris.") is None  # the reply may go on: "Paris. It is..." or "Paris, ..."
    await hold(ahead, [], ended=True)
    assert await spoken(ahead.take("Paris."))


async def test_a_withdrawn_or_replaced_reply_is_not_spoken(engines):
    ahead = ahead_of(engines.tts)
    await hold(ahead, DELTAS)
    ahead.discard()  # withdrawn: the user went on
    assert ahead.take("The capital of France") is None

    await hold(ahead, DELTAS, reply_id="llm-1")
    await hold(ahead, ["Madrid ", "is ", "the ", "capital ", "of ", "Spain."], reply_id="llm-2")
    assert ahead.take("The capital of France") is None  # the reply it was made for was replaced
    assert await spoken(ahead.take("Madrid is the capital"))
    assert ahead.voiced == 1


async def test_a_failed_synthesis_reaches_whoever_speaks_the_chunk():
    # LocalTTSService.run_tts reports it as a failed sentence, and the conversation goes on.
    async def failing(text: str):
        raise RuntimeError("the voice failed")
        yield b""

    ahead = FirstChunkAhead(lambda: SpeakableChunkAggregator(words_per_sec=0), failing)
    await hold(ahead, DELTAS)
    with pytest.raises(RuntimeError, match="the voice failed"):
        await spoken(ahead.take("The capital of France"))
