"""Pipecat TTS service over a shared TTS engine (Piper or Orpheus), with word timing so interruptions cut the context exactly."""

import re
import time
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from typing import Protocol

from loguru import logger
from pipecat.frames.frames import EagerEndOfTurnCancelFrame, ErrorFrame, Frame, InterruptionFrame, TTSAudioRawFrame
from pipecat.processors.frame_processor import FrameDirection
from pipecat.services.settings import TTSSettings
from pipecat.services.tts_service import TTSService
from pipecat.utils.string import SENTENCE_ENDING_PUNCTUATION
from pipecat.utils.text.base_text_aggregator import Aggregation, TextType
from pipecat.utils.text.simple_text_aggregator import SimpleTextAggregator

from frames.held_reply import FirstChunkAhead, HeldReplyTextFrame
from frames.pipecat_internals import use_text_aggregator
from services.languages import ConversationLanguage



class SpeechEngine(Protocol):
    """What the service needs of an engine: PiperEngine and OrpheusEngine both fit."""

    sample_rate: int
    voice: str

    def stream(self, text: str, *, voice: str | None = None) -> AsyncIterator[bytes]: ...


def estimate_word_times(text: str, start: float, duration: float) -> list[tuple[str, float]]:
    """Spread the words of `text` over `duration` seconds in proportion to their length.

    Neither Piper nor Orpheus gives word timings. Without any, Pipecat adds a sentence to the context only
    after all of it played, so a cut-in mid-sentence loses words that were heard; with these
    estimates the context keeps the words that had started playing.
    """
    words = text.split()
    weights = [len(w) + 1 for w in words]  # +1: the pause between words
    total = sum(weights) or 1
    times, elapsed = [], 0
    for word, weight in zip(words, weights):
        times.append((word, start + duration * elapsed / total))
        elapsed += weight
    return times


# The first chunk of a reply may go to the voice before its sentence ends, after this many words:
# ~0.8 s of speech, time enough for the rest of the sentence to be generated and synthesized...
# The LLM engine sends each word once it is whole (services/spoken_reply.py); the chunk goes once
# the word after it is whole too and the sentence has not ended, so its rest is at least two
# words ("legs." alone sounds clipped). Three words, not four: a word less to generate and to
# synthesize before the first sound (/ws 0.97 -> 0.82 s p50, LiveKit 1.19 -> 1.01 s, on the
# int8-weight LLM, two runs back to back); right answers 7/7/6 of 10 against 7/7/7.
FIRST_CHUNK_WORDS = 3
# ...provided the reply's words arrive at least this fast (~4x speaking pace). Slower (a busy
# machine) and no words go ahead of their clause (see CLAUSE_END): a chunk spoken before the
# rest of its sentence was ready left a gap inside the sentence.
FIRST_CHUNK_WORDS_PER_SEC = 12.0
# While a reply's first sentence goes in pieces, the voice must not run out of words before the
# next piece comes: "Once upon a time," (1.1 s of speech) then "there was a brave knight named Sir
# Valor and a dragon named Erebo." generated at 10 words a second would leave 0.4 s of silence
# between them. So the aggregator keeps an estimate of when the voice will have said all it was
# handed, and when that is VOICE_RUNS_DRY_SECS away, the rest's whole words go on (at least
# CLAUSE_MIN_WORDS). Piper on a 2-core box takes 0.25-0.37 s a word, pauses included, and ~0.25 s
# to a chunk's first audio: the low end, so that a chunk goes early rather than late.
VOICE_SECS_PER_WORD = 0.25
VOICE_FIRST_AUDIO_SECS = 0.25
VOICE_RUNS_DRY_SECS = 0.35  # the next chunk's first audio, and a word's wait
# A reply's first sentence goes clause by clause, and so does the rest of one whose first words
# went ahead: a long sentence ("..., but it's actually ..., which is ...") is not waited for whole
# while its start plays out, nor, when the words come slowly (a busy machine), before anything is
# said. A pause there is one a speaker makes too; the first clause of "The tallest mountain in the
# world is Mount Everest, which is ..." no longer waits for the sentence's last seven words.
CLAUSE_END = (",", ";", ":")
CLAUSE_MIN_WORDS = 3  # a shorter clause ("Everest,") goes with the next one: a word alone sounds clipped


class SpeakableChunkAggregator(SimpleTextAggregator):
    """Pipecat's sentence aggregation, except that a sentence end followed by a space ends the
    sentence at once, and the first words of a reply may go ahead of their sentence.

    The LLM service releases a reply sentence by sentence (services/spoken_reply.py), each with
    the space after it; Pipecat's aggregator would hold a finished sentence until the next one's
    first letter arrived, i.e. until the LLM had generated all of the next sentence.

    The listener waits for the first words, so a reply's first FIRST_CHUNK_WORDS words are spoken
    as soon as they are here (the LLM engine sends each word once it is whole, see SpokenReply),
    when the text is generated fast enough that
    the rest of the sentence will be ready before they have been said (FIRST_CHUNK_WORDS_PER_SEC);
    the rest of that sentence then goes clause by clause. Otherwise the first sentence goes clause
    by clause from its start. Either way, a piece of that first sentence goes as far as its words
    are whole when the voice is about to run out of words (VOICE_RUNS_DRY_SECS); later sentences
    go whole.

    The pace is that of generation: the text of a held reply (frames/held_reply.py) is generated
    long before it arrives here, all at once, and `generated` says when.

    Extends SimpleTextAggregator through the hook its docstring offers subclasses
    (`_check_sentence_with_lookahead`) and its buffer `_text`.
    """

    def __init__(self, *, clock=time.monotonic, words_per_sec: float = FIRST_CHUNK_WORDS_PER_SEC, **kwargs):
        """`words_per_sec`: the pace the reply's words must come at for its first words to go
        ahead of their sentence; 0 lets them go as soon as they are whole."""
        super().__init__(**kwargs)
        self._clock = clock
        self._words_per_sec = words_per_sec
        self._reply_spoken = False  # a chunk of this reply went to the voice
        self._in_split_sentence = False  # the sentence being aggregated began with an early chunk
        self._first_text_at: float | None = None  # when this reply's first words were generated
        self._first_text_words = 0
        self._held_reply_id: str | None = None  # the held reply whose first words those were
        self._voice_done_at = 0.0  # when the voice will have said every chunk of this reply, roughly

    def generated(self, reply_id: str, text: str) -> None:
        """`text` of held reply `reply_id` was generated just now; it arrives once released, all at
        once, and its pace counts from here."""
        if self._text.strip() or self._reply_spoken:  # a released reply is here: its text came as made
            return
        if reply_id != self._held_reply_id:  # the reply held before it was withdrawn
            self._held_reply_id, self._first_text_at, self._first_text_words = reply_id, None, 0
        self._note_first_text(text)

    def _note_first_text(self, text: str) -> None:
        """The pace counts from the reply's first words: when they were generated, or arrived."""
        if self._first_text_at is None and text.strip():
            self._first_text_at, self._first_text_words = self._clock(), len(text.split())

    async def aggregate(self, text: str) -> AsyncIterator[Aggregation]:
        self._note_first_text(text)
        async for aggregation in super().aggregate(text):
            yield self._handed_on(aggregation)
        # Only at the end of what the LLM has sent: a sentence end further on in the same text
        # would show that the sentence is short, and must not be cut off from its start. So does
        # a sentence end with nothing after it yet: the LLM sends a reply's last sentence without
        # the space that ends it elsewhere, and a reply generated while its turn was held comes
        # in a burst, all of it but that space ("The capital of France | is Paris.").
        if not self._reply_spoken and not self._ends_a_sentence() and self._first_words_ready():
            self._in_split_sentence = True
            yield self._handed_on(self._cut(list(re.finditer(r"\S+", self._text))[FIRST_CHUNK_WORDS - 1].end()))
        elif self._voice_runs_dry():
            yield self._handed_on(self._cut(self._whole_words()[-1].end()))

    async def _check_sentence_with_lookahead(self, char: str, *, protected_end: int = 0) -> Aggregation | None:
        sentence = await super()._check_sentence_with_lookahead(char, protected_end=protected_end)
        if sentence is None and char.isspace() and self._ends_a_sentence():
            text, self._text = self._text.strip(), ""
            sentence = Aggregation(text=text, type=TextType.SENTENCE) if text else None
        if sentence is not None:
            self._in_split_sentence = False
        elif (
            char.isspace()
            and self._text.rstrip().endswith(CLAUSE_END)
            and len(self._text.split()) >= CLAUSE_MIN_WORDS
            and (self._in_split_sentence or not (self._reply_spoken or self._first_words_ready()))
        ):
            sentence = self._cut(len(self._text))
            self._in_split_sentence = True
        return sentence

    def _handed_on(self, chunk: Aggregation) -> Aggregation:
        """Note `chunk` going to the voice, whichever way it was cut."""
        now = self._clock()
        self._reply_spoken = True
        starts = max(self._voice_done_at, now + VOICE_FIRST_AUDIO_SECS)
        self._voice_done_at = starts + len(chunk.text.split()) * VOICE_SECS_PER_WORD
        return chunk

    def _cut(self, end: int) -> Aggregation:
        """The buffer up to `end`, as a chunk for the voice; the rest stays."""
        chunk, self._text = self._text[:end].strip(), self._text[end:].lstrip()
        return Aggregation(text=chunk, type=TextType.SENTENCE)

    def _ends_a_sentence(self) -> bool:
        return self._text.rstrip().endswith(tuple(SENTENCE_ENDING_PUNCTUATION))

    def _whole_words(self) -> list[re.Match]:
        """The buffer's words that a space has followed: the LLM will add nothing to them."""
        return list(re.finditer(r"\S+\s", self._text))

    def _first_words_ready(self) -> bool:
        words = len(self._whole_words())
        if words <= FIRST_CHUNK_WORDS or self._first_text_at is None:
            return False
        arrived = words - self._first_text_words  # the words that came after the first text
        elapsed = self._clock() - self._first_text_at
        return arrived > 0 and arrived >= elapsed * self._words_per_sec

    def _voice_runs_dry(self) -> bool:
        """The first sentence is in pieces, and the voice will soon have said every one of them."""
        return (
            self._in_split_sentence
            and not self._ends_a_sentence()
            and self._clock() >= self._voice_done_at - VOICE_RUNS_DRY_SECS
            and len(self._whole_words()) >= CLAUSE_MIN_WORDS
        )

    def _new_reply(self) -> None:
        self._reply_spoken, self._first_text_at, self._first_text_words = False, None, 0
        self._in_split_sentence, self._held_reply_id, self._voice_done_at = False, None, 0.0

    async def flush(self) -> Aggregation | None:
        self._new_reply()  # the LLM's reply is over
        return await super().flush()

    async def handle_interruption(self):
        self._new_reply()
        await super().handle_interruption()

    async def reset(self):
        self._new_reply()
        await super().reset()


class LocalTTSService(TTSService):
    """Speaks each sentence from the LLM with the process-wide TTS engine.

    On an interruption Pipecat cancels the task running `run_tts`; closing the engine's
    stream then cancels its request inside the shared batch (Orpheus: generation and queued
    SNAC windows), so a cut-off reply stops costing compute at once.

    A reply held while the agent makes sure the user has stopped has its first chunk
    synthesized meanwhile (HeldReplyTextFrame, FirstChunkAhead): once released, it plays at once.
    """

    def __init__(
        self,
        engine: SpeechEngine,
        *,
        on_sentence=None,
        language: ConversationLanguage | None = None,
        voices: dict[str, str] | None = None,
        **kwargs,
    ):
        super().__init__(
            push_text_frames=False,  # text follows the audio word by word (word timestamps)
            push_start_frame=True,
            push_stop_frames=True,
            settings=TTSSettings(model=None, voice=engine.voice, language=None),
            **kwargs,
        )
        self._chunker = SpeakableChunkAggregator()
        use_text_aggregator(self, self._chunker)
        self._engine = engine
        self._on_sentence = on_sentence  # on_sentence(audio_seconds, wall_seconds), e.g. for metrics
        # A multilingual agent speaks each reply in the voice of the conversation's language.
        self._language = language
        self._voices = voices or {}
        # Seconds of audio already produced in each audio context: word timestamps count
        # from the start of the context (one reply), not from the start of each sentence.
        self._context_seconds: dict[str, float] = {}
        self.ahead = FirstChunkAhead(lambda: SpeakableChunkAggregator(words_per_sec=0), self._speak)

    def _speak(self, text: str) -> AsyncIterator[bytes]:
        # A multilingual agent speaks each reply in the voice of the conversation's language.
        voice = self._voices.get(self._language.current) if self._language else None
        return self._engine.stream(text, voice=voice)

    async def process_frame(self, frame: Frame, direction: FrameDirection):
        if isinstance(frame, HeldReplyTextFrame):
            self._chunker.generated(frame.reply_id, frame.text)
            await self.ahead.add(frame)  # consumed: nothing past the voice needs it
            return
        if isinstance(frame, (InterruptionFrame, EagerEndOfTurnCancelFrame)):
            self.ahead.discard()
        await super().process_frame(frame, direction)

    async def cleanup(self):
        self.ahead.discard()
        await super().cleanup()

    def can_generate_metrics(self) -> bool:
        return True

    async def run_tts(self, text: str, context_id: str) -> AsyncGenerator[Frame, None]:
        await self.start_tts_usage_metrics(text)
        start = self._context_seconds.get(context_id, 0.0)
        seconds = 0.0
        began = time.perf_counter()
        try:
            # aclosing: when Pipecat stops this generator, the engine's stream closes at once
            # (cancelling its batched request) instead of whenever it is garbage collected.
            async with aclosing(self.ahead.take(text) or self._speak(text)) as audio, aclosing(
                self._stream_audio_frames_from_iterator(
                    audio, in_sample_rate=self._engine.sample_rate, context_id=context_id
                )
            ) as frames:
                async for frame in frames:
                    if isinstance(frame, TTSAudioRawFrame):
                        seconds += len(frame.audio) / 2 / frame.sample_rate
                    yield frame
        except Exception as e:  # one failed sentence must not end the conversation
            logger.exception(f"{self}: synthesis failed for [{text}]")
            yield ErrorFrame(error=f"TTS failed: {e}")
            return
        self._context_seconds[context_id] = start + seconds
        if self._on_sentence is not None and seconds > 0:
            self._on_sentence(seconds, time.perf_counter() - began)
        await self.add_word_timestamps(estimate_word_times(text, start, seconds), context_id)

    async def on_audio_context_completed(self, context_id: str):
        self._context_seconds.pop(context_id, None)

    async def on_audio_context_interrupted(self, context_id: str):
        self._context_seconds.pop(context_id, None)
