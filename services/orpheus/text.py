"""What Orpheus is asked to say: text normalized for speech, cut into chunks, budgeted, and laid out as prompt ids."""

import math
import re

from num2words import num2words

from services.orpheus.tokens import (
    END_OF_HUMAN,
    END_OF_TEXT,
    FRAMES_PER_SECOND,
    POSITIONS,
    START_OF_AI,
    START_OF_HUMAN,
    START_OF_SPEECH,
)

VOICES = ("tara", "leah", "jess", "leo", "dan", "mia", "zac", "zoe")  # English, most natural first
EMOTIVE_TAGS = ("laugh", "chuckle", "sigh", "cough", "sniffle", "groan", "yawn", "gasp")

_TAG = r"<(?:%s)>" % "|".join(EMOTIVE_TAGS)
_NUMBER = re.compile(r"(?P<currency>[$€£])?(?P<number>\d+(?:,\d{3})*(?:\.\d+)?)(?P<suffix>%|st|nd|rd|th)?")
_CURRENCIES = {"$": "USD", "€": "EUR", "£": "GBP"}


def _say_number(match: re.Match, lang: str) -> str:
    number = match["number"].replace(",", "")
    value = float(number) if "." in number else int(number)
    currency, suffix = match["currency"], match["suffix"]
    try:
        if currency:
            return num2words(value, lang=lang, to="currency", currency=_CURRENCIES[currency])
        if suffix in ("st", "nd", "rd", "th") and isinstance(value, int):
            return num2words(value, lang=lang, to="ordinal")
        words = num2words(value, lang=lang)
        return f"{words} percent" if suffix == "%" else words
    except (NotImplementedError, KeyError, OverflowError):
        return match[0]


def normalize_text(text: str, lang: str = "en") -> str:
    """Text as Orpheus reads it reliably.

    Numbers become words (digits are read erratically), markup goes, runs of punctuation
    collapse to one mark ("!!!" and "?!" make Orpheus loop), emotive tags like <laugh> stay,
    and the text ends with a full stop (unterminated text tends to be repeated).
    """
    text = re.sub(r"<(?!/?(?:%s)>)[^>]*>" % "|".join(EMOTIVE_TAGS), " ", text)  # other tags
    text = re.sub(r"[*_#`~|\[\]{}]+", " ", text)  # markdown
    text = _NUMBER.sub(lambda m: _say_number(m, lang), text)
    text = text.replace("…", "...")
    text = re.sub(r"[.!?]{2,}", lambda m: "?" if "?" in m[0] else "!" if "!" in m[0] else ".", text)
    text = re.sub(r"([,;:])[,;:]+", r"\1", text)
    text = re.sub(r"\s*-{2,}\s*|\s+[–—]\s+", ", ", text)
    text = " ".join(text.split())
    if text and not re.search(r"[.!?](\s*%s)*$" % _TAG, text):
        text += "."
    return text


def split_for_speech(text: str, max_chars: int = 280) -> list[str]:
    """Chunks of at most `max_chars`, cut at sentence ends (else at commas, else at spaces).

    One long prompt makes Orpheus drift and caps audio at max_new_tokens; each chunk is
    generated as its own request and they play back to back.
    """
    pieces: list[str] = []
    for sentence in re.split(r"(?<=[.!?])\s+", text.strip()):
        while len(sentence) > max_chars:
            cut = sentence.rfind(", ", 0, max_chars)
            cut = cut + 1 if cut > 0 else sentence.rfind(" ", 0, max_chars)
            cut = cut if cut > 0 else max_chars
            pieces.append(sentence[:cut].strip())
            sentence = sentence[cut:].strip()
        pieces.append(sentence)
    chunks: list[str] = []
    for piece in filter(None, pieces):
        if chunks and len(chunks[-1]) + 1 + len(piece) <= max_chars:
            chunks[-1] += " " + piece
        else:
            chunks.append(piece)
    return chunks


def max_new_tokens_for(text: str) -> int:
    """A token budget for speaking `text` slowly (1.5× a 2.5 words/s pace, +1.5 s per emotive tag).

    Orpheus sometimes keeps producing audio after the text is spoken; the budget bounds that.
    """
    tags = len(re.findall(_TAG, text))
    words = len(re.sub(_TAG, " ", text).split())
    seconds = 1.0 + 1.5 * words / 2.5 + 1.5 * tags
    return math.ceil(seconds * FRAMES_PER_SECOND) * POSITIONS


def prompt_ids(tokenizer, voice: str, text: str) -> list[int]:
    """`[start of human] "{voice}: {text}" [end of text, end of human, start of AI, start of speech]`.

    Token ids go to the model directly: the reference decodes them to a string and lets
    the server re-tokenize it, which can add a second begin-of-text token.
    """
    text_ids = tokenizer(f"{voice}: {text}")["input_ids"]
    return [START_OF_HUMAN, *text_ids, END_OF_TEXT, END_OF_HUMAN, START_OF_AI, START_OF_SPEECH]
