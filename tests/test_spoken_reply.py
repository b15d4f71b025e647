"""What of a generated reply is spoken, and in which chunks the voice gets it (services/spoken_reply.py, frames/tts.py)."""

import pytest

from frames.tts import SpeakableChunkAggregator
from services.spoken_reply import SpokenReply


def speak_as_generated(reply: SpokenReply, text: str, step: int = 3) -> str:
    """Feed `text` a few characters at a time, as tokens arrive; return what was released."""
    released = 0
    for end in range(step, len(text) + step, step):
        released = max(released, reply.update(text[:end]))
        if reply.over:
            return text[:released]
    return text[: max(released, reply.finish(text))]


def test_the_first_sentence_streams_word_by_word_until_a_word_comes_again():
    reply = SpokenReply(max_sentences=2)
    # Each whole word goes at once: the last may still be growing ("Par" -> "Paris").
    assert reply.update("The capital of France is") == len("The capital of France ")
    assert reply.update("The capital of France is Paris. ") == len("The capital of France is Paris. ")
    # A loop starts with a word said before: from one on, the last three words wait for the next.
    reply = SpokenReply(max_sentences=2)
    assert reply.update("The cat saw the dog and") == len("The cat saw ")


def test_stops_after_the_sentence_cap():
    text = "The capital of France is Paris. It is known for the Eiffel Tower. It has many museums. And cafes."
    assert speak_as_generated(SpokenReply(max_sentences=2), text) == (
        "The capital of France is Paris. It is known for the Eiffel Tower. "
    )


def test_no_cap_speaks_everything():
    text = "Once upon a time a dragon lived in a cave. A knight came by. They became friends."
    assert speak_as_generated(SpokenReply(max_sentences=None), text) == text


def test_a_sentence_that_repeats_the_reply_ends_it():
    text = "Shakespeare wrote Romeo and Juliet. He wrote it in 1595. Shakespeare wrote Romeo and Juliet. It is a play."
    assert speak_as_generated(SpokenReply(max_sentences=None), text) == (
        "Shakespeare wrote Romeo and Juliet. He wrote it in 1595. "
    )


def test_a_reply_looping_inside_one_sentence_ends_where_the_loop_begins():
    # SmolLM2 asked about cats after a story: it never ended the sentence, for 400 tokens.
    text = "The story of a cat in a brave night is a classic tale of a cat in a brave night is a classic tale of"
    reply = SpokenReply(max_sentences=None)
    assert speak_as_generated(reply, text) == "The story of a cat in a brave night is a classic tale "
    assert reply.over  # the engine stops generating here
    # A later sentence that loops before it ends is not said, and ends the reply as soon as it loops.
    text = "Cats are small. They like to sleep and they like to sleep and they like to"
    reply = SpokenReply(max_sentences=None)
    assert speak_as_generated(reply, text) == "Cats are small. "
    assert reply.over


def test_numbers_and_list_markers_do_not_end_sentences():
    text = "It is 3.5 meters long. 1. The first point is short."
    reply = SpokenReply(max_sentences=2)
    assert speak_as_generated(reply, text) == text
    assert reply.sentences == 2


def test_a_last_sentence_without_a_full_stop_is_spoken():
    text = "Paris is the capital. It is in France"
    assert speak_as_generated(SpokenReply(max_sentences=3), text) == text


class TokenClock:
    """The time as the LLM's text arrives: `seconds_per_token` between tokens."""

    def __init__(self, seconds_per_token: float):
        self.now, self.step = 0.0, seconds_per_token

    def __call__(self) -> float:
        return self.now


async def chunks_of(tokens: list[str], seconds_per_token: float = 0.2, aggregator=None, held: int = 0) -> list[str]:
    """What the TTS is handed, chunk by chunk, as the LLM generates `tokens`."""
    return [text for _, text in await timed_chunks_of(tokens, seconds_per_token, aggregator, held)]


async def timed_chunks_of(tokens: list[str], seconds_per_token: float = 0.2, aggregator=None, held: int = 0) -> list[tuple[float, str]]:
    """When and what the TTS is handed, chunk by chunk, as the LLM generates `tokens`: the LLM
    engine releases the text through SpokenReply, and the TTS service aggregates what it released.

    The first `held` tokens are generated while the reply's turn is held: the TTS service is
    told of each piece as it is made (HeldReplyTextFrame), and gets them all at once when the
    hold ends, as the next token is generated."""
    clock = TokenClock(seconds_per_token)
    aggregator = aggregator or SpeakableChunkAggregator(clock=clock)
    reply, text, released, chunks, pieces = SpokenReply(max_sentences=None), "", 0, [], []

    async def hand_on(upto: int, holding: bool = False):
        nonlocal released
        if upto > released:
            pieces.append(text[released:upto])
            released = upto
            if holding:
                aggregator.generated("llm-0", pieces[-1])
        if not holding:
            chunks.extend([(clock.now, a.text) for piece in pieces async for a in aggregator.aggregate(piece)])
            pieces.clear()

    for index, token in enumerate(tokens):
        text += token
        await hand_on(reply.update(text), holding=index < held)
        clock.now += clock.step
    await hand_on(reply.finish(text))
    last = await aggregator.flush()
    return chunks + ([(clock.now, last.text)] if last and last.text else [])


TWO_SENTENCES = ["The", " tallest", " mountain", " is", " Everest", ",", " which", " is", " in", " Nepal", ". ", "It", " is", " tall", "."]


async def test_text_arriving_slowly_reaches_the_voice_clause_by_clause_then_in_whole_sentences():
    # 5 words a second: the rest of a sentence might not be ready by the time its first words
    # were said, so none go ahead; its first clause does, where a speaker pauses anyway.
    assert await chunks_of(TWO_SENTENCES, seconds_per_token=0.2) == [
        "The tallest mountain is Everest,",
        "which is in Nepal.",
        "It is tall.",
    ]


async def test_text_arriving_fast_starts_the_voice_on_the_first_words():
    # 20 words a second: the first three words go as soon as the LLM engine has released a fourth
    # (the fifth has begun); its rest goes clause by clause ("is Everest," is too short a clause
    # to go alone), later sentences whole.
    assert await chunks_of(TWO_SENTENCES, seconds_per_token=0.05) == [
        "The tallest mountain",
        "is Everest, which is in Nepal.",  # its comma came before the cut
        "It is tall.",
    ]


async def test_the_rest_of_a_long_first_sentence_goes_clause_by_clause():
    tokens = ["Well", " I", " think", " that", " the", " answer", ",", " if", " you", " ask", " me", ",", " is", " no", "."]
    assert await chunks_of(tokens, seconds_per_token=0.01) == [
        "Well I think",
        "that the answer,",  # three words: a clause of its own
        "if you ask me,",
        "is no.",
    ]


async def test_a_first_sentence_of_four_words_goes_whole_however_fast():
    tokens = ["A", " spider", " has", " legs", ". ", "It", " is", " small", "."]
    assert await chunks_of(tokens, seconds_per_token=0.01) == ["A spider has legs.", "It is small."]
    # One word more, and its first three words go ahead of the last two.
    tokens = ["A", " spider", " has", " eight", " legs", ". ", "It", " is", " small", "."]
    assert await chunks_of(tokens, seconds_per_token=0.01) == ["A spider has", "eight legs.", "It is small."]


async def test_a_long_first_clause_released_in_a_burst_still_starts_with_three_words():
    # A reply generated while its turn was held comes in the pieces the LLM made, all at once.
    aggregator = SpeakableChunkAggregator(clock=TokenClock(0.0))
    pieces = [f"{word} " for word in "The tallest mountain in the world is Mount Everest, which is".split()]
    said = [a.text for piece in pieces async for a in aggregator.aggregate(piece)]
    assert said[0] == "The tallest mountain"


STORY = "Once upon a time, there was a brave knight named Sir Valor and a dragon named Erebo. He was bold."
STORY_TOKENS = [f" {word}" if index else word for index, word in enumerate(STORY.split())]


async def test_a_held_reply_generated_slowly_says_no_words_ahead_when_released_in_a_burst():
    # 10 words a second, the first six generated while the turn was held: they arrive at once,
    # but were made at 10 a second, and the rest of the sentence will come at that pace too.
    # (Judged by the pace they arrived at, "Once upon a" went ahead, and the rest of the sentence
    # came 1.3 s later: a gap in the story.)
    # (What comes after is cut so that the voice does not run dry: see below.)
    chunks = await chunks_of(STORY_TOKENS, seconds_per_token=0.1, held=6)
    assert chunks[0] == "Once upon a time,"
    assert " ".join(chunks) == STORY


async def test_a_held_reply_generated_fast_says_its_first_words_when_released():
    chunks = await chunks_of(STORY_TOKENS, seconds_per_token=0.04, held=6)
    assert chunks[0] == "Once upon a"
    assert " ".join(chunks) == STORY


async def test_the_pace_of_a_withdrawn_held_reply_does_not_count_for_the_next():
    # A reply held, then withdrawn (the user went on); the next one, held too, was generated fast.
    clock = TokenClock(0.0)
    aggregator = SpeakableChunkAggregator(clock=clock)
    aggregator.generated("llm-0", "Once ")
    clock.now = 5.0
    for piece in ("Once ", "upon ", "a ", "time, ", "there "):
        aggregator.generated("llm-1", piece)
        clock.now += 0.04
    said = [a.text for piece in ("Once ", "upon ", "a ", "time, ", "there ") async for a in aggregator.aggregate(piece)]
    assert said == ["Once upon a"]


async def test_the_long_rest_of_a_sentence_goes_as_far_as_it_has_come_before_the_voice_runs_dry():
    # 12.5 words a second: the first words go ahead; the rest of the sentence has no clause of
    # three words, and would take a second to come whole, longer than the first words take to
    # say. What has come goes on before they are said; the rest is in time after that.
    chunks = await chunks_of(STORY_TOKENS, seconds_per_token=0.08)
    assert chunks[0] == "Once upon a"
    assert not chunks[1].endswith(".") and len(chunks[1].split()) >= 3, chunks
    assert chunks[-2].endswith("Erebo.") and chunks[-1] == "He was bold.", chunks
    assert " ".join(chunks) == STORY


def silences_in_first_sentence(chunks: list[tuple[float, str]]) -> list[float]:
    """The silences between the voice's chunks of a reply's first sentence, as a voice speaking
    0.28 s a word, with its first audio 0.25 s after a chunk is handed to it (Piper on a 2-core
    box: 0.25-0.37 s a word, pauses included), would leave."""
    silences, said_until = [], None
    for handed_at, text in chunks:
        starts = handed_at + 0.25
        if said_until is not None:
            silences.append(max(0.0, starts - said_until))
            starts = max(starts, said_until)
        said_until = starts + 0.28 * len(text.split())
        if text.endswith("."):
            return silences
    return silences


@pytest.mark.parametrize("words_per_sec", [5, 8, 10, 12.5, 16, 20, 25])
@pytest.mark.parametrize("held", [0, 6])
async def test_the_voice_never_runs_dry_inside_the_first_sentence(words_per_sec, held):
    # However fast the words come, and whether or not the reply was held, each piece of the first
    # sentence reaches the voice before it has said the pieces before it.
    chunks = await timed_chunks_of(STORY_TOKENS, seconds_per_token=1 / words_per_sec, held=held)
    assert " ".join(text for _, text in chunks) == STORY
    assert max(silences_in_first_sentence(chunks), default=0.0) < 0.05, chunks


async def test_a_short_reply_released_in_a_burst_goes_whole():
    # A reply generated while its turn was held: released at once, in the pieces the LLM made,
    # the last sentence without a space after it (the reply ended there).
    aggregator = SpeakableChunkAggregator(clock=TokenClock(0.0))
    said = [a.text for piece in ("The capital ", "of France is Paris.") async for a in aggregator.aggregate(piece)]
    last = await aggregator.flush()
    assert said + [last.text] == ["The capital of France is Paris."]


async def test_each_reply_starts_its_voice_early_again():
    clock = TokenClock(0.05)
    aggregator = SpeakableChunkAggregator(clock=clock)
    first = await chunks_of(TWO_SENTENCES, aggregator=aggregator)
    second = await chunks_of(TWO_SENTENCES, aggregator=aggregator)  # flush() ended the first reply
    assert first == second and first[0] == "The tallest mountain"


async def test_a_later_sentence_with_commas_stays_whole():
    tokens = ["Yes", ". ", "Well", ",", " it", " is", " tall", ",", " very", " tall", "."]
    assert await chunks_of(tokens, seconds_per_token=0.05) == ["Yes.", "Well, it is tall, very tall."]


async def test_a_short_sentence_goes_whole_and_a_finished_sentence_goes_at_once():
    aggregator = SpeakableChunkAggregator()
    said = [a.text async for a in aggregator.aggregate("A spider has eight legs. ")]
    assert said == ["A spider has eight legs."]  # without waiting for the next sentence's first letter
