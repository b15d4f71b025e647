"""A held reply's first words, voiced while its turn is held: the frame that carries them past the LLM's gate, and the audio made ahead."""

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass

from loguru import logger
from pipecat.frames.frames import SystemFrame
from pipecat.utils.text.base_text_aggregator import BaseTextAggregator


@dataclass
class HeldReplyTextFrame(SystemFrame):
    """Text of a reply that the LLM service's SpeculationGate is holding.

    A complete-sounding turn is answered speculatively while the agent waits to hear that the
    user has stopped (frames/turn_taking/turn_stop.py): the reply's frames wait in the LLM
    service until then. This frame is a copy of its text sent past the gate (system frames are
    not held), so the voice can synthesize the reply's first words meanwhile. It carries no
    reply of its own: the held LLMTextFrames do, once released, or nothing if withdrawn.
    """

    reply_id: str
    text: str
    reply_ended: bool = False  # the reply is whole: its last words are a chunk too


class FirstChunkAhead:
    """The first chunk of a held reply, synthesized while the reply is held.

    Fed the HeldReplyTextFrames of a reply, it cuts their text with an aggregator of its own
    (`new_aggregator()`), as the TTS service will cut the reply's text once released, and
    synthesizes the first chunk. When the TTS service is then asked to speak that text, or a
    longer one that begins with it, `take` hands it the audio made ahead (then the rest,
    synthesized) instead of synthesizing it again: the hold hid the voice's time to first audio.

    The aggregator should cut the first words as soon as they are whole, whatever the pace they
    were generated at (SpeakableChunkAggregator with words_per_sec=0): the TTS service's own first
    chunk then begins with this one, whether it is the same three words (a reply generated fast)
    or its first clause or sentence (generated slowly). Other text is never matched: it is
    synthesized as usual, and what was made ahead goes unused.
    """

    def __init__(
        self,
        new_aggregator: Callable[[], BaseTextAggregator],
        synthesize: Callable[[str], AsyncIterator[bytes]],
    ):
        self._new_aggregator = new_aggregator
        self._synthesize = synthesize
        self._reply_id: str | None = None
        self._aggregator: BaseTextAggregator | None = None
        self._text: str | None = None  # the chunk being synthesized ahead
        self._audio: asyncio.Queue[bytes | Exception | None] | None = None
        self._task: asyncio.Task | None = None
        self.voiced = 0  # chunks whose audio made ahead was spoken

    async def add(self, frame: HeldReplyTextFrame) -> None:
        if frame.reply_id != self._reply_id:
            self.discard()
            self._reply_id, self._aggregator = frame.reply_id, self._new_aggregator()
        if self._aggregator is None:  # this reply's first chunk is cut already
            return
        chunk = None
        async with aclosing(self._aggregator.aggregate(frame.text)) as aggregations:
            async for aggregation in aggregations:  # the first chunk is all that is wanted
                chunk = aggregation.text
                break
        if chunk is None and frame.reply_ended:
            flushed = await self._aggregator.flush()
            chunk = flushed.text if flushed else None
        if chunk and chunk.strip():
            self._aggregator = None
            self._start(chunk.strip())

    def _start(self, text: str) -> None:
        self._text, self._audio = text, asyncio.Queue()
        self._task = asyncio.create_task(self._make(text, self._audio))

    async def _make(self, text: str, audio: asyncio.Queue) -> None:
        try:
            async with aclosing(self._synthesize(text)) as chunks:
                async for chunk in chunks:
                    audio.put_nowait(chunk)
            audio.put_nowait(None)
        except Exception as e:  # handed to whoever speaks it: run_tts reports a failed synthesis
            audio.put_nowait(e)

    def take(self, text: str) -> AsyncIterator[bytes] | None:
        """Audio for `text`, as the engine's stream would give it, if it begins with the chunk made
        ahead: that audio, then the rest of `text` synthesized (the TTS service may cut its first
        chunk later than the chunk made ahead: at the sentence's end). None if it does not."""
        text = text.strip()
        if self._task is None or not (text == self._text or text.startswith(self._text + " ")):
            return None
        rest = text[len(self._text) :].strip()
        task, audio = self._task, self._audio
        self._task, self._audio, self._text = None, None, None
        self.voiced += 1
        logger.debug(f"speaking [{text}] with audio made while its turn was held")
        return self._replay(task, audio, rest)

    async def _replay(self, task: asyncio.Task, audio: asyncio.Queue, rest: str) -> AsyncIterator[bytes]:
        try:
            while (chunk := await audio.get()) is not None:
                if isinstance(chunk, Exception):
                    raise chunk
                yield chunk
        finally:
            task.cancel()  # left early (an interruption): the synthesis stops too
        if rest:
            async with aclosing(self._synthesize(rest)) as chunks:
                async for chunk in chunks:
                    yield chunk

    def discard(self) -> None:
        """Forget the reply: it was withdrawn, interrupted, or another one began."""
        if self._task is not None:
            self._task.cancel()
        self._reply_id, self._aggregator, self._text, self._audio, self._task = None, None, None, None, None
