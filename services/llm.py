"""LLM engine: one transformers model with continuous batching, streaming to every conversation."""

import asyncio
import hashlib
import math
import json
import shutil
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import torch
from loguru import logger
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig

PAGE_SIZE = 256  # tokens per KV-cache page


@dataclass
class LLMEngineStats:
    """Lifetime request counts; read by tests and metrics."""

    started: int = 0
    finished: int = 0
    cancelled: int = 0
    failed: int = 0


class LLMRequestError(RuntimeError):
    """The engine failed this one request (others keep running)."""


class TransformersLLMEngine:
    """A chat model whose requests from all conversations share one continuous batch.

    `stream()` yields text deltas; leaving the loop early (or `cancel(id)`) cancels the request
    inside the batch so its slot and KV cache are freed at once.
    """

    loads = 0  # models loaded in this process: sessions must share, never add to this

    def __init__(
        self,
        model,
        tokenizer,
        *,
        name: str,
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_p: float = 0.9,
        max_batch_requests: int = 16,
        kv_cache_tokens: int = 16384,
        max_batch_tokens: int = 1024,
    ):
        self.name = name
        TransformersLLMEngine.loads += 1
        self.model = model
        self.tokenizer = tokenizer
        self.max_new_tokens = max_new_tokens
        self.stats = LLMEngineStats()
        self._active: set[str] = set()
        self._lock = threading.Lock()
        eos = model.generation_config.eos_token_id
        if eos is None:
            eos = tokenizer.eos_token_id
        generation_config = GenerationConfig(
            max_new_tokens=max_new_tokens,
            do_sample=temperature > 0,
            temperature=temperature if temperature > 0 else None,
            top_p=top_p if temperature > 0 else None,
            eos_token_id=eos,
            pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos,
        )
        self._manager = model.init_continuous_batching(
            generation_config=generation_config,
            continuous_batching_config=ContinuousBatchingConfig(
                max_requests_per_batch=max_batch_requests,
                # Left unset, the paged KV cache takes 60-90% of all free memory (on CPU: of
                # system RAM, ~14 GB here). Size it for what the sessions need instead.
                num_blocks=math.ceil(kv_cache_tokens / PAGE_SIZE),
                page_size=PAGE_SIZE,
                max_batch_tokens=max_batch_tokens,
                auto_switch_to_flash=False,
            ),
        )
        self._manager.start()
        self._dispatch_loop = asyncio.new_event_loop()
        threading.Thread(target=self._dispatch_loop.run_forever, name="llm-dispatch", daemon=True).start()

    @classmethod
    def load(
        cls,
        source: str,
        *,
        gguf_file: str | None = None,
        cache_dir: Path,
        device: str = "cpu",
        dtype: str = "auto",
        **engine_kwargs,
    ) -> "TransformersLLMEngine":
        """Load an HF hub id, a local HF directory, or a GGUF file (converted once, then cached)."""
        path = Path(source)
        if path.suffix == ".gguf" and path.is_file():
            source, gguf_file = str(path.parent), path.name
        if gguf_file:
            source = str(_hf_cache_of_gguf(Path(source) / gguf_file, cache_dir))
        started = time.perf_counter()
        torch_dtype = _resolve_dtype(dtype, device)
        tokenizer = AutoTokenizer.from_pretrained(source)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype).to(device).eval()
        logger.info(f"LLM {source} loaded on {device} in {time.perf_counter() - started:.1f}s")
        return cls(model, tokenizer, name=Path(source).name or source, **engine_kwargs)

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """Chat messages ({role, content: str}) → prompt ids through the model's chat template."""
        encoded = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=True
        )
        return list(encoded["input_ids"])

    async def stream(
        self,
        messages: list[dict],
        *,
        request_id: str | None = None,
        max_new_tokens: int | None = None,
    ) -> AsyncIterator[str]:
        """Generate a reply to `messages`, yielding text as it is produced."""
        request_id = request_id or f"llm-{uuid.uuid4().hex[:12]}"
        prompt = self.encode_chat(messages)
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue = asyncio.Queue()

        def on_output(output):
            # Runs on the engine's dispatch loop; hop to the loop of the conversation that asked.
            try:
                loop.call_soon_threadsafe(outputs.put_nowait, output)
            except RuntimeError:  # that conversation's loop is closed: nobody is listening
                self.cancel(request_id)

        # Register before adding: the first token may arrive before add_request returns.
        await self._register_handler(request_id, on_output)
        with self._lock:
            self._active.add(request_id)
            self.stats.started += 1
        self._manager.add_request(
            prompt,
            request_id=request_id,
            max_new_tokens=max_new_tokens or self.max_new_tokens,
            streaming=True,
        )
        finished = False
        emitted = ""
        try:
            while True:
                output = await outputs.get()
                if output.error:
                    with self._lock:
                        self.stats.failed += 1
                    finished = True
                    raise LLMRequestError(f"LLM request {request_id} failed: {output.error}")
                text = self.tokenizer.decode(output.generated_tokens, skip_special_tokens=True)
                # A multi-byte character split across tokens decodes to U+FFFD until complete.
                if len(text) > len(emitted) and not text.endswith("\ufffd"):
                    yield text[len(emitted):]
                    emitted = text
                if output.is_finished():
                    finished = True
                    with self._lock:
                        self.stats.finished += 1
                    return
        finally:
            with self._lock:
                self._active.discard(request_id)
            if not finished:
                self.cancel(request_id)

    async def _register_handler(self, request_id: str, callback) -> None:
        """Register `callback` on the engine's own dispatch loop.

        transformers runs a whole step's callbacks on the event loop of whichever request
        registered last, and raises in its generation thread (stopping generation for everyone)
        if that loop has closed. Conversations come and go with their loops (LiveKit runs each
        room on its own thread), so handlers live on one loop that lasts as long as the engine.
        """

        async def register() -> None:
            self._manager.register_result_handler(request_id, callback)

        await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(register(), self._dispatch_loop))

    def cancel(self, request_id: str) -> None:
        """Stop a request inside the batch (idempotent)."""
        self._manager.cancel_request(request_id)
        with self._lock:
            self.stats.cancelled += 1
            self._active.discard(request_id)

    @property
    def active_requests(self) -> int:
        return len(self._active)

    async def warmup(self) -> None:
        """The first request compiles kernels and allocates the paged cache: pay that before users do."""
        async for _ in self.stream([{"role": "user", "content": "Hi"}], max_new_tokens=4):
            pass

    def close(self) -> None:
        if self._manager.is_running():
            self._manager.stop(block=True, timeout=5)
        self._dispatch_loop.call_soon_threadsafe(self._dispatch_loop.stop)


def _resolve_dtype(dtype: str, device: str) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return getattr(torch, dtype)


def _hf_cache_of_gguf(gguf_path: Path, cache_dir: Path) -> Path:
    """Convert a GGUF checkpoint to an HF directory once; later starts load it in under a second.

    transformers de-quantizes GGUF on every load (~35 s for SmolLM2 on 2 cores) and refuses to
    `save_pretrained` the result (it is flagged as quantized), so we write the weights, the
    config without its quantization block, and the tokenizer ourselves.
    """
    stat = gguf_path.stat()
    key = hashlib.sha1(f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    target = cache_dir / f"{gguf_path.stem}-{key}"
    if (target / "config.json").is_file():
        return target
    logger.info(f"converting {gguf_path.name} to an HF checkpoint in {target} (once)")
    from safetensors.torch import save_file

    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    )
    staging = cache_dir / f".{target.name}.{uuid.uuid4().hex[:6]}"
    staging.mkdir(parents=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # tied to the embeddings; safetensors rejects shared storage
    save_file(state, staging / "model.safetensors", metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    (staging / "config.json").write_text(json.dumps(config, indent=2))
    model.generation_config.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    try:
        staging.rename(target)  # atomic: a concurrent start sees all of it or none of it
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)  # another process won the race
    return target
