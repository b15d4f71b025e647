"""Orpheus TTS: text → prompt ids → audio token ids → SNAC frames → 24 kHz speech, for every conversation at once."""

import math
import re
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

import torch
from loguru import logger
from num2words import num2words
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LogitsProcessor

from services.audio import float_to_pcm16
from services.batched_generation import ContinuousBatchGenerator, resolve_dtype
from services.snac_decoder import SAMPLE_RATE, SAMPLES_PER_FRAME, Frame, SnacDecoder, SnacWindowPlanner

# Token ids of the Orpheus vocabulary (Llama-3 + 28,683 added tokens; <custom_token_N> = 128256 + N).
START_OF_SPEECH = 128257
END_OF_SPEECH = 128258  # the stop token (the reference engine's 49158 is a bug)
START_OF_HUMAN = 128259
END_OF_HUMAN = 128260
START_OF_AI = 128261
END_OF_TEXT = 128009
PAD = 128263
AUDIO_BASE = 128266  # audio token = AUDIO_BASE + 4096·position + code
CODES = 4096
POSITIONS = 7  # tokens per frame: SNAC L0 ← p0, L1 ← p1 p4, L2 ← p2 p3 p5 p6

FRAMES_PER_SECOND = SAMPLE_RATE / SAMPLES_PER_FRAME  # 11.72
TOKENS_PER_SECOND = POSITIONS * FRAMES_PER_SECOND  # 82.03: a stream below this rate stutters

VOICES = ("tara", "leah", "jess", "leo", "dan", "mia", "zac", "zoe")  # English, most natural first
EMOTIVE_TAGS = ("laugh", "chuckle", "sigh", "cough", "sniffle", "groan", "yawn", "gasp")


# --- Text ------------------------------------------------------------------------------------

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


# --- Tokens ----------------------------------------------------------------------------------


class OrpheusTokenParser:
    """Turns generated token ids into complete SNAC frames, checking every code's position.

    Each audio id is `AUDIO_BASE + 4096·position + code` and must sit at the position the
    running count expects. Code 0 is a code like any other. A token at the wrong position
    means the model lost the frame grid: the partial frame is dropped and the parser waits
    for the next position-0 token (a misplaced position-0 token starts that frame at once).
    Guessing a slot for it would feed codes to the wrong SNAC level for the rest of the
    utterance; dropping costs at most one frame (85 ms). Ids outside the audio range (text
    tokens, control tokens) are rejected and counted; END_OF_SPEECH ends the utterance.
    """

    def __init__(self) -> None:
        self._frame: list[int] = []
        self._resyncing = False
        self.finished = False
        self.misplaced = 0  # tokens found at the wrong position
        self.skipped = 0  # valid-range tokens dropped: partial frames and tokens while resyncing
        self.rejected = 0  # ids outside the audio range

    def feed(self, ids: list[int]) -> list[Frame]:
        """Consume the ids of one generation step (any number); return the frames they complete."""
        frames: list[Frame] = []
        for token in ids:
            if self.finished:
                break
            if token == END_OF_SPEECH:
                self.finished = True
                self.skipped += len(self._frame)
                self._frame = []
                break
            offset = token - AUDIO_BASE
            if not 0 <= offset < POSITIONS * CODES:
                self.rejected += 1
                continue
            position, code = divmod(offset, CODES)
            if self._resyncing and position != 0:
                self.skipped += 1
                continue
            self._resyncing = False
            if position != len(self._frame):
                self.misplaced += 1
                self.skipped += len(self._frame)
                self._frame = []
                if position != 0:
                    self.skipped += 1
                    self._resyncing = True
                    continue
            self._frame.append(code)
            if len(self._frame) == POSITIONS:
                frames.append(tuple(self._frame))
                self._frame = []
        return frames


def audio_token(position: int, code: int) -> int:
    return AUDIO_BASE + CODES * position + code


class OrpheusCodeMask(LogitsProcessor):
    """Allows only the codes of the next frame position, and END_OF_SPEECH only after a whole frame.

    The next position follows from the last token alone (after START_OF_SPEECH: 0; after an
    audio token at p: p+1 mod 7), so this needs no per-request state and works inside
    transformers' continuous batching, which hands processors only each row's last token.
    With it a sampled stream cannot lose the frame grid.
    """

    supports_continuous_batching = True

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        last = input_ids if input_ids.dim() == 1 else input_ids[:, -1]
        offset = last - AUDIO_BASE
        is_audio = (offset >= 0) & (offset < POSITIONS * CODES)
        position = torch.where(is_audio, offset // CODES + 1, 0) % POSITIONS
        low = (AUDIO_BASE + CODES * position)[:, None]
        vocab = torch.arange(scores.shape[-1], device=scores.device)[None, :]
        allowed = (vocab >= low) & (vocab < low + CODES)
        allowed[:, END_OF_SPEECH] = is_audio & (position == 0)
        return scores.masked_fill(~allowed, float("-inf"))


# --- Engine ----------------------------------------------------------------------------------


@dataclass
class OrpheusStats:
    """Lifetime counts over all streams; read by tests and metrics."""

    utterances: int = 0
    frames: int = 0
    misplaced_tokens: int = 0
    skipped_tokens: int = 0
    rejected_tokens: int = 0

    def add(self, parser: OrpheusTokenParser) -> None:
        self.misplaced_tokens += parser.misplaced
        self.skipped_tokens += parser.skipped
        self.rejected_tokens += parser.rejected


class OrpheusEngine:
    """Orpheus speech for every conversation: one LM in a continuous batch, one batched SNAC.

    `stream(text)` yields mono PCM16 at 24 kHz as frames are decoded. The first audio (frame 0,
    85 ms) is out after 21 generated tokens; see SnacWindowPlanner for the windows. Closing the
    stream (e.g. Pipecat cancelling the TTS task on barge-in) cancels the generation request
    inside the batch and drops the stream's queued SNAC windows.
    """

    loads = 0  # models loaded in this process: sessions must share, never add to this
    sample_rate = SAMPLE_RATE

    def __init__(
        self,
        model,
        tokenizer,
        snac: SnacDecoder,
        *,
        voice: str = "tara",
        temperature: float = 0.6,
        top_p: float = 0.8,
        max_streams: int = 16,
        kv_cache_tokens: int = 32768,
        max_batch_tokens: int = 2048,
        max_chunk_chars: int = 280,
        context_frames: int = 2,
        max_hop_frames: int = 4,
        lang: str = "en",
    ):
        OrpheusEngine.loads += 1
        if voice not in VOICES:
            logger.warning(f"Orpheus voice {voice!r} is not one of {VOICES}; fine-tuned checkpoints may know it")
        self.voice = voice
        self.model = model
        self.tokenizer = tokenizer
        self.snac = snac
        self.max_chunk_chars = max_chunk_chars
        self.context_frames = context_frames
        self.max_hop_frames = max_hop_frames
        self.lang = lang
        self.stats = OrpheusStats()
        self._generating: dict[str, str] = {}  # stream id → id of its chunk in the generator
        self._cancelled: set[str] = set()
        # transformers' continuous batching has no repetition penalty (the reference uses 1.1-1.3);
        # the code mask and the length-derived token budget are what keep generation on track.
        self.generator = ContinuousBatchGenerator(
            model,
            GenerationConfig(
                do_sample=True,
                temperature=temperature,
                top_p=top_p,
                # Each request passes its own budget; this covers the longest chunk (~5 chars/word).
                max_new_tokens=max_new_tokens_for("word " * (max_chunk_chars // 5)),
                eos_token_id=END_OF_SPEECH,
                pad_token_id=PAD,
            ),
            max_batch_requests=max_streams,
            kv_cache_tokens=kv_cache_tokens,
            max_batch_tokens=max_batch_tokens,
            logits_processors=[OrpheusCodeMask()],
            name="orpheus",
        )

    @classmethod
    def load(
        cls,
        model_source: str,
        snac_source: str,
        *,
        device: str = "cpu",
        snac_device: str | None = None,
        dtype: str = "auto",
        compile: bool = False,
        snac_max_batch: int = 16,
        snac_max_wait_ms: float = 2.0,
        **engine_kwargs,
    ) -> "OrpheusEngine":
        """Load the LM and SNAC from hub ids or local directories (the same call for both kinds)."""
        started = time.perf_counter()
        tokenizer = AutoTokenizer.from_pretrained(model_source)
        model = AutoModelForCausalLM.from_pretrained(model_source, dtype=resolve_dtype(dtype, device))
        model = model.to(device).eval()
        logger.info(f"Orpheus LM {model_source} loaded on {device} in {time.perf_counter() - started:.1f}s")
        snac = SnacDecoder.load(
            snac_source,
            device=snac_device or device,
            compile=compile,
            max_batch=snac_max_batch,
            max_wait_ms=snac_max_wait_ms,
        )
        return cls(model, tokenizer, snac, **engine_kwargs)

    async def stream(
        self, text: str, *, voice: str | None = None, request_id: str | None = None
    ) -> AsyncIterator[bytes]:
        """Speak `text` (normalized, chunked at sentences) as PCM16 chunks at 24 kHz."""
        request_id = request_id or f"orpheus-{uuid.uuid4().hex[:12]}"
        try:
            chunks = split_for_speech(normalize_text(text, self.lang), self.max_chunk_chars)
            for index, chunk in enumerate(chunks):
                if request_id in self._cancelled:
                    return
                self._generating[request_id] = f"{request_id}-{index}"
                audio = self._stream_chunk(chunk, voice or self.voice, request_id)
                async with aclosing(audio):
                    async for pcm in audio:
                        yield pcm
        finally:
            self._generating.pop(request_id, None)
            self._cancelled.discard(request_id)

    async def _stream_chunk(self, text: str, voice: str, request_id: str) -> AsyncIterator[bytes]:
        parser = OrpheusTokenParser()
        planner = SnacWindowPlanner(context=self.context_frames, max_hop=self.max_hop_frames)
        tokens = self.generator.stream(
            prompt_ids(self.tokenizer, voice, text),
            request_id=self._generating[request_id],
            max_new_tokens=max_new_tokens_for(text),
        )
        try:
            async with aclosing(tokens):  # leaving early cancels the request in the batch
                async for ids in tokens:
                    for frame in parser.feed(ids):
                        planner.push(frame)
                    while (window := planner.next_window()) is not None:
                        yield float_to_pcm16(await self.snac.decode(window))
            while request_id not in self._cancelled and (window := planner.next_window(final=True)):
                yield float_to_pcm16(await self.snac.decode(window))
        finally:
            self.stats.utterances += 1
            self.stats.frames += planner.emitted
            self.stats.add(parser)

    def cancel(self, request_id: str) -> None:
        """Stop the stream `request_id`: its generation leaves the batch, no further audio comes."""
        generating = self._generating.get(request_id)
        if generating is not None:
            self._cancelled.add(request_id)
            self.generator.cancel(generating)

    async def synthesize(self, text: str, *, voice: str | None = None) -> bytes:
        """All of `text` as one PCM16 buffer."""
        return b"".join([chunk async for chunk in self.stream(text, voice=voice)])

    @property
    def active_requests(self) -> int:
        return self.generator.active_requests

    def close(self) -> None:
        self.generator.close()
        self.snac.close()
