"""How much of a reply being generated is worth saying: it ends after N sentences and before it repeats itself."""

import re

# A sentence ends at . ! or ? (with any closing quote or bracket) and the space after it, so
# "3.5" and a reply still being generated ("Paris.") are not cut early. The space goes with the
# sentence: it tells the voice downstream that the sentence is over. Chinese and Japanese end a
# sentence at 。！？ with no space after.
SENTENCE_END = re.compile(r"[.!?]+[\"'”’)\]]*\s|[。！？]+[」』”’）)]*")
REPEAT_WORDS = 4  # a run of this many words said twice is a reply looping on itself


WORD = re.compile(r"[\w']+")


def words(text: str) -> list[str]:
    return WORD.findall(text.lower())


def _runs(sequence: list[str]) -> list[tuple[str, ...]]:
    return [tuple(sequence[i : i + REPEAT_WORDS]) for i in range(len(sequence) - REPEAT_WORDS + 1)]


class SpokenReply:
    """Follows one reply as it is generated and says how much of it may be spoken.

    The first sentence streams as it comes (the listener is waiting), word by word while no word
    has been said twice in it; after that, all but its last few words, which may start a loop.
    Each later sentence is released once complete. A reply is over once it repeats a run of words
    it has said: a later sentence is dropped whole, and the first ends where its loop begins. The
    sentence being generated is checked too, so a reply that loops without ever ending a sentence
    ("a cat in a brave night is a classic tale of a cat in a brave night is a ...") stops at once
    instead of running to its token budget. After `max_sentences` sentences it is over too. Small
    models loop and ramble; a voice agent's answer to a simple question is a sentence or two.
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
            if self._loops(sentence):
                return self._end_at_loop(sentence)
            self._said += words(sentence)
            self.sentences += 1
            self._boundary = match.end()
            if self.max_sentences and self.sentences >= self.max_sentences:
                self.over = True
                return self._boundary
        pending = text[self._boundary :]
        if self._loops(pending):
            return self._end_at_loop(pending)
        if self.sentences == 0:
            spans = list(WORD.finditer(pending))
            said = [m.group().lower() for m in spans[:-1]]  # the last word may still be growing
            if len(set(said)) == len(said):
                # A loop's second run begins at a word said before: with none, all are settled.
                return self._boundary + (spans[-1].start() if spans else 0)
            settled = [m.start() for m in spans[-(REPEAT_WORDS - 1) :]]
            return self._boundary + (settled[0] if len(settled) == REPEAT_WORDS - 1 else 0)
        return self._boundary

    def finish(self, text: str) -> int:
        """The whole reply is in: how much of it is spoken (a last unterminated sentence too)."""
        released = self.update(text)
        if self.over or not text[self._boundary :].strip():
            return released
        self._said += words(text[self._boundary :])  # the last sentence, said without its full stop
        self.sentences += 1
        return len(text)

    def _loops(self, sentence: str) -> bool:
        runs = _runs(self._said + words(sentence))
        return len(set(runs)) < len(runs)

    def _end_at_loop(self, sentence: str) -> int:
        """The reply is over: a later sentence goes unsaid, the first is said up to its loop."""
        self.over = True
        if self.sentences:
            return self._boundary
        spans = list(WORD.finditer(sentence))
        said = [m.group().lower() for m in spans]
        seen: set[tuple[str, ...]] = set()
        for i, run in enumerate(_runs(said)):
            if run in seen:
                return self._boundary + spans[i].start()
            seen.add(run)
        return self._boundary
