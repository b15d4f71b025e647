"""The language a conversation is held in: which languages the agent speaks, and when a turn switches it."""

import re
from dataclasses import dataclass

# Whisper's codes for the languages the agent can answer in, with their names for the LLM.
LANGUAGE_NAMES = {
    "en": "English",
    "es": "Spanish",
    "fr": "French",
    "it": "Italian",
    "pt": "Portuguese",
    "zh": "Chinese",
    "ja": "Japanese",
    "hi": "Hindi",
    "de": "German",  # Orpheus has a German checkpoint (ORPHEUS_MODELS); Kokoro has no German voice
    "ko": "Korean",
}

# Han, kana and Devanagari are written without spaces between words (Devanagari has them, but
# Whisper writes Hindi in Urdu script as often): count characters, about two to a word.
_UNSPACED = re.compile(r"[\u3040-\u30ff\u3400-\u9fff\uf900-\ufaff]")
_WORD = re.compile(r"[^\W\d_]+")


def word_count(text: str) -> float:
    """Words in `text`, counting two Han or kana characters as one word."""
    unspaced = len(_UNSPACED.findall(text))
    spaced = len(_WORD.findall(_UNSPACED.sub(" ", text)))
    return spaced + unspaced / 2


@dataclass
class ConversationLanguage:
    """The conversation's current language, moved by what the user says.

    Whisper's language detection is sure of a sentence and unsure of one word: "Sí." or "OK" can
    come out as any of several languages. So a turn switches the conversation only when it has
    `min_words` words and its detected language has probability `min_probability`; shorter or
    less certain turns keep the current language. `pinned`: the language never changes and the
    speech is never put through detection.
    """

    current: str
    supported: tuple[str, ...]
    pinned: bool = False
    min_words: float = 3
    min_probability: float = 0.7

    def decide(self, probabilities: list[tuple[str, float]], text: str) -> str:
        """The language of a turn, given Whisper's language probabilities (most likely first)
        and its transcript; the conversation switches to it."""
        if self.pinned:
            return self.current
        candidates = [(code, p) for code, p in probabilities if code in self.supported]
        if candidates:
            best, probability = max(candidates, key=lambda c: c[1])
            if best != self.current and probability >= self.min_probability and word_count(text) >= self.min_words:
                self.current = best
        return self.current
