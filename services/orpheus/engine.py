"""Orpheus TTS: text → prompt ids → audio token ids → SNAC frames → 24 kHz speech, for every conversation at once."""

import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

from loguru import logger
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from services.audio import float_to_pcm16
from services.batched_generation import ContinuousBatchGenerator, resolve_dtype
from services.orpheus.snac import SAMPLE_RATE, SnacDecoder, SnacWindowPlanner
from services.orpheus.text import VOICES, max_new_tokens_for, normalize_text, prompt_ids, split_for_speech
from services.orpheus.tokens import END_OF_SPEECH, PAD, OrpheusCodeMask, OrpheusTokenParser

# Tuning of the engine itself (what operators set is in the agent's Settings).
MAX_BATCH_TOKENS = 2048  # prompt + generated tokens one batched step may process
MAX_CHUNK_CHARS = 280  # text generated as one request (longer prompts make Orpheus drift)
CONTEXT_FRAMES = 2  # SNAC frames decoded on each side of an emitted one (see SnacWindowPlanner)
MAX_HOP_FRAMES = 4  # frames emitted per steady-state window


@dataclass
class OrpheusStats:
    """Lifetime counts over all streams: utterances spoken, frames emitted, and the sums of each
    stream's parser counts (tokens at the wrong position, dropped, or outside the audio range)."""

    utterances: int = 0
    frames: int = 0
    misplaced_tokens: int = 0
    skipped_tokens: int = 0
    rejected_tokens: int = 0

    def add(self, parser: OrpheusTokenParser) -> None:
        """Add one finished stream's parser counts."""
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
        voice: str,
        temperature: float,
        top_p: float,
        max_streams: int,
        kv_cache_tokens: int,
        max_batch_tokens: int = MAX_BATCH_TOKENS,
        max_chunk_chars: int = MAX_CHUNK_CHARS,
        context_frames: int = CONTEXT_FRAMES,
        max_hop_frames: int = MAX_HOP_FRAMES,
        lang: str = "en",
    ):
        OrpheusEngine.loads += 1
        if voice not in VOICES:
            logger.warning(f"Orpheus voice {voice!r} is not one of {VOICES}; fine-tuned checkpoints may know it")
        self.voice = voice
        self.name = voice
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
        device: str,
        dtype: str,
        compile: bool,
        snac_max_batch: int,
        snac_max_wait_ms: float,
        snac_device: str | None = None,
        **engine_kwargs,
    ) -> "OrpheusEngine":
        """Load the LM and SNAC from hub ids or local directories (the same call for both kinds)."""
        model, tokenizer = load_lm(model_source, device=device, dtype=dtype)
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
    def in_flight(self) -> int:
        return self.generator.in_flight

    async def warmup(self) -> None:
        await self.synthesize("Warming up.")

    def close(self) -> None:
        self.generator.close()
        self.snac.close()


def load_lm(source: str, *, device: str, dtype: str):
    """An Orpheus LM and its tokenizer from a hub id or a local directory, ready on `device`."""
    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(source)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=resolve_dtype(dtype, device))
    model = model.to(device).eval()
    logger.info(f"Orpheus LM {source} loaded on {device} in {time.perf_counter() - started:.1f}s")
    return model, tokenizer
