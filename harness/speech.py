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


def normalize(text: str) -> str:
    text = text.lower().replace("-", " ")
    text = re.sub(r"[^a-z0-9' ]+", " ", text)
    return " ".join(text.split())


def wer(reference: str, hypothesis: str) -> float:
    reference, hypothesis = normalize(reference), normalize(hypothesis)
    if not reference:
        return 0.0 if not hypothesis else 1.0
    return jiwer.wer(reference, hypothesis)


def sounds_like(word: str, heard: str) -> bool:
    """A word of `heard` is `word` but for a letter or two: how a spoken answer is judged when the
    model's text says what the word was. tiny.en, the judge, hears a lone "Paris." from Piper as
    "Harris." in about 1 of 10 renderings (measured 2 of 20) and, after the question, as "Aris."."""
    return any(jiwer.cer(word, said) <= 0.4 for said in normalize(heard).split())
