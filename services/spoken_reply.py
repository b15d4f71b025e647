"""How much of a reply being generated is worth saying: it ends after N sentences and before it repeats itself."""

import re

# A sentence ends at . ! or ? (with any closing quote or bracket) and the space after it, so
# "3.5" and a reply still being generated ("Paris.") are not cut early. The space goes with the
# sentence: it tells the voice downstream that the sentence is over.
SENTENCE_END = re.compile(r"[.!?]+[\"'”’)\]]*\s")
REPEAT_WORDS = 4  # a run of this many words said twice is a reply looping on itself


def words(text: str) -> list[str]:
    return re.sub(r"[^\w\s']", " ", text.lower()).split()


def _runs(sequence: list[str]) -> list[tuple[str, ...]]:
    return [tuple(sequence[i : i + REPEAT_WORDS]) for i in range(len(sequence) - REPEAT_WORDS + 1)]


class SpokenReply:
    """Follows one reply as it is generated and says how much of it may be spoken.

    The first sentence streams as it comes (nothing can repeat yet, and the listener is waiting).
    Each later sentence is released once complete, unless it repeats a run of words already
    said: then the reply is over, without it. After `max_sentences` sentences it is over too.
    Small models loop ("Once upon a time... Once upon a time...") and ramble; a voice agent's
    answer to a simple question is a sentence or two.
    """

    def __init__(self, max_sentences: int | None):
        self.max_sentences = max_sentences or None
        self.sentences = 0  # complete sentences released
        self.over = False
        self._boundary = 0  # end of the last released sentence, in characters
        self._said: list[str] = []  # the words released so far

    def update(self, text: str) -> int:
        """`text` is the reply so far; returns how many of its characters may be spoken."""
        for match in SENTENCE_END.finditer(text, self._boundary):
            sentence = text[self._boundary : match.end()]
            if not re.search(r"[^\W\d_]", sentence):
                continue  # "1." numbering a list: part of the sentence that follows
            if not self._accept(sentence):
                return self._boundary
            self._boundary = match.end()
            if self.max_sentences and self.sentences >= self.max_sentences:
                self.over = True
                return self._boundary
        return len(text) if self.sentences == 0 else self._boundary

    def finish(self, text: str) -> int:
        """The whole reply is in: how much of it is spoken (a last unterminated sentence too)."""
        released = self.update(text)
        if self.over or not text[released:].strip() or self.sentences == 0:
            return released if self.over else len(text)
        return len(text) if self._accept(text[released:]) else released

    def _accept(self, sentence: str) -> bool:
        new = words(sentence)
        runs = _runs(self._said + new)
        if self.sentences and len(set(runs)) < len(runs):
            self.over = True
            return False
        self._said += new
        self.sentences += 1
        return True
