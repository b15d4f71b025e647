"""Real speech for tests: the user's words spoken by the bundled Piper voice, and word error rate."""

import re

import jiwer
import numpy as np
import soxr

from services.audio import INPUT_SAMPLE_RATE
from services.tts_piper import PiperEngine


async def speak_16k(tts: PiperEngine, text: str) -> bytes:
    """`text` spoken by Piper as mono PCM16 at 16 kHz, the rate a microphone transport delivers;
    the same audio for the same text in every run."""
    pcm = await tts.synthesize(text, repeatable=True)
    audio = np.frombuffer(pcm, dtype=np.int16).astype(np.float32)
    return soxr.resample(audio, tts.sample_rate, INPUT_SAMPLE_RATE).astype(np.int16).tobytes()


# tiny.en writes small numbers as digits ("8 legs") where the model wrote words, and the other way.
NUMBER_WORDS = dict(enumerate("zero one two three four five six seven eight nine ten".split()))


def normalize(text: str) -> str:
    text = text.lower().replace("-", " ")
    text = re.sub(r"[^a-z0-9' ]+", " ", text)
    return " ".join(NUMBER_WORDS.get(int(w), w) if w.isdigit() else w for w in text.split())


def wer(reference: str, hypothesis: str) -> float:
    reference, hypothesis = normalize(reference), normalize(hypothesis)
    if not reference:
        return 0.0 if not hypothesis else 1.0
    return jiwer.wer(reference, hypothesis)


def heard_as(reference: str, heard: str, *, words: float = 0.35) -> bool:
    """What tiny.en heard is `reference` spoken: within `words` word error rate, or within 0.25
    character error rate with the spaces taken out. tiny.en joins and splits words: Piper's "A
    spider has eight legs." over LiveKit came back "Aspirator has 8 legs.", 2 words of 5 wrong
    but 4 letters of 19."""
    said, got = normalize(reference).replace(" ", ""), normalize(heard).replace(" ", "")
    return wer(reference, heard) <= words or (bool(said) and jiwer.cer(said, got) <= 0.25)


def sounds_like(word: str, heard: str) -> bool:
    """A word of `heard` is `word` but for a letter or two: how a spoken answer is judged when the
    model's text says what the word was. tiny.en, the judge, hears a lone "Paris." from Piper as
    "Harris." in about 1 of 10 renderings (measured 2 of 20) and, after the question, as "Aris."."""
    return any(jiwer.cer(word, said) <= 0.4 for said in normalize(heard).split())
