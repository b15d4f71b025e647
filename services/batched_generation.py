"""Token generation for many requests at once: one transformers continuous batch, streamed to any event loop."""

import asyncio
import math
import threading
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import torch
from transformers import GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig

# Tokens per KV-cache page (the default; the LLM on CPU uses smaller ones, see services/llm.py).
# transformers shares whole pages between requests whose prompts begin alike, so a conversation's
# next prompt reuses the history's cache instead of computing it again; the history's last, partial
# page is computed again. At 256 a 10-turn conversation's first word came 0.36 → 1.27 s after its
# question on 2 CPU cores; at 32 it stays ~0.3 s.
PAGE_SIZE = 32


@dataclass
class GenerationStats:
    """Lifetime request counts by outcome (`/metrics` shows each as `voice_agent_llm_requests`).

    Every started request ends exactly one way: finished, cancelled or failed.
    """

    started: int = 0
    finished: int = 0  # generated up to a stop token or its token budget
    cancelled: int = 0  # by its caller (a barge-in, a withdrawn speculation) or when its loop closed
    failed: int = 0  # the engine reported an error for it


class GenerationError(RuntimeError):
    """The engine failed this one request (others keep running)."""


@dataclass
class RequestOutputs:
    """Where one request's outputs go: a queue on the event loop of the conversation that asked.

    Outputs are handed over from the engine's threads and wait in the queue until the stream reads
    them. `ended` is set by `cancel()` or `finish()`, from any thread; the stream checks it after
    each output, so what was queued before the cancel is never read after it.
    """

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    ended: bool = False

    def put(self, item) -> bool:
        """Hand `item` to the stream; False if its loop has closed (nobody is reading)."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
            return True
        except RuntimeError:
            return False


class ContinuousBatchGenerator:
    """A causal LM whose requests, from every conversation, share one continuous batch.

    `stream()` yields the token ids each step adds. Leaving the loop early (or `cancel(id)`)
    cancels the request inside the batch, so its slot and KV cache are freed at once. The LLM
    engine decodes these ids to text; the Orpheus engine reads them as audio codes.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        generation_config: GenerationConfig,
        *,
        max_batch_requests: int,
        kv_cache_tokens: int,
        max_batch_tokens: int,
        logits_processors: Sequence = (),
        name: str = "generator",
        page_size: int = PAGE_SIZE,
    ):
        self.name = name
        self.stats = GenerationStats()
        self._active: dict[str, RequestOutputs] = {}
        self._lock = threading.Lock()
        self._manager = model.init_continuous_batching(
            generation_config=generation_config,
            continuous_batching_config=ContinuousBatchingConfig(
                max_requests_per_batch=max_batch_requests,
                # Left unset, the paged KV cache takes 60-90% of all free memory (on CPU: of
                # system RAM, ~14 GB here). Size it for what the sessions need instead.
                num_blocks=math.ceil(kv_cache_tokens / page_size),
                page_size=page_size,
                max_batch_tokens=max_batch_tokens,
                auto_switch_to_flash=False,
            ),
        )
        if logits_processors:
            insert_logits_processors(self._manager, logits_processors)
        self._manager.start()
        self._closed = False
        self._dispatch_loop = asyncio.new_event_loop()
        threading.Thread(
            target=self._dispatch_loop.run_forever, name=f"{name}-dispatch", daemon=True
        ).start()

    async def stream(
        self, prompt_ids: list[int], *, request_id: str | None = None, max_new_tokens: int | None = None
    ) -> AsyncIterator[list[int]]:
        """Generate after `prompt_ids`, yielding the new token ids of each step."""
        request_id = request_id or f"{self.name}-{uuid.uuid4().hex[:12]}"
        outputs = RequestOutputs(asyncio.get_running_loop())

        def on_output(output):
            # Runs on the engine's dispatch loop; hop to the loop of the conversation that asked.
            if not outputs.put(output):  # that conversation's loop is closed: nobody is listening
                self.cancel(request_id)

        # Register before adding: the first token may arrive before add_request returns.
        await self._register_handler(request_id, on_output)
        with self._lock:
            self._active[request_id] = outputs
            self.stats.started += 1
        self._manager.add_request(
            prompt_ids, request_id=request_id, max_new_tokens=max_new_tokens, streaming=True
        )
        finished = False
        seen = 0
        try:
            while True:
                output = await outputs.queue.get()
                if output is None or outputs.ended:  # cancel(request_id) or finish(request_id) from elsewhere
                    finished = True
                    return
                if not output.error:
                    tokens = output.generated_tokens  # cumulative
                    if len(tokens) > seen:
                        new, seen = list(tokens[seen:]), len(tokens)
                        yield new
                    if not output.is_finished():
                        continue
                # The end. Whichever takes the request out of `_active` counts it, once: here, or
                # cancel()/finish() from elsewhere while the last tokens were being yielded.
                finished = True
                with self._lock:
                    ends_here = self._active.pop(request_id, None) is not None
                    if ends_here and output.error:
                        self.stats.failed += 1
                    elif ends_here:
                        self.stats.finished += 1
                if ends_here and output.error:
                    raise GenerationError(f"request {request_id} failed: {output.error}")
                return
        finally:
            if not finished:
                self.cancel(request_id)
            with self._lock:
                self._active.pop(request_id, None)

    async def _register_handler(self, request_id: str, callback) -> None:
        """Register `callback` on the generator's own dispatch loop.

        transformers runs a whole step's callbacks on the event loop of whichever request
        registered last, and raises in its generation thread (stopping generation for everyone)
        if that loop has closed. Conversations come and go with their loops (LiveKit runs each
        room on its own thread), so handlers live on one loop that lasts as long as the engine.
        """

        async def register() -> None:
            self._manager.register_result_handler(request_id, callback)

        await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(register(), self._dispatch_loop))

    def finish(self, request_id: str) -> None:
        """End a request early because its caller has all it wants (counted as finished, not cancelled)."""
        self._manager.cancel_request(request_id)
        with self._lock:
            outputs = self._active.pop(request_id, None)
            if outputs is not None:
                outputs.ended = True
                self.stats.finished += 1

    def cancel(self, request_id: str) -> None:
        """Stop a request inside the batch and end its stream at once (idempotent)."""
        self._manager.cancel_request(request_id)
        with self._lock:
            outputs = self._active.pop(request_id, None)
            if outputs is not None:
                outputs.ended = True
                self.stats.cancelled += 1
        if outputs is not None:
            outputs.put(None)  # transformers sends nothing more for a cancelled request: wake the stream

    @property
    def in_flight(self) -> int:
        return len(self._active)

    @property
    def failure(self) -> str | None:
        """Why no request can be served any more (the generation thread stopped), or None."""
        return None if self._manager.is_running() or self._closed else "the generation thread stopped"

    def close(self) -> None:
        self._closed = True
        if self._manager.is_running():
            self._manager.stop(block=True, timeout=5)
        self._dispatch_loop.call_soon_threadsafe(self._dispatch_loop.stop)


def insert_logits_processors(manager, processors: Sequence) -> None:
    """Run `processors` first among a continuous-batching manager's logits processors.

    A reach into transformers' internals (checked against 5.23.0; tests/test_library_internals.py
    fails if it moves): continuous batching builds its processors only from the generation config
    and has no way to add one. A processor that works on each row's last token alone (all CB hands
    it) can run first.
    """
    chain = manager.logit_processor
    for position, processor in enumerate(processors):
        chain.logits_processor.insert(position, processor)
    chain.do_processing = True


def resolve_dtype(dtype: str, device: str) -> torch.dtype:
    """'auto' → bfloat16 on CUDA, float32 elsewhere; otherwise a torch dtype name.

    Not bf16 on CPU even where it has native bf16 (AVX512-BF16): measured, it was barely faster
    alone and, with two worker processes on 2 busy cores, an order of magnitude slower.
    """
    if dtype == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return getattr(torch, dtype)
