"""LLM engine: one transformers model with continuous batching, streaming to every conversation."""

import hashlib
import json
import shutil
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from functools import partial
from pathlib import Path

import torch
from loguru import logger
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from services.batched_generation import PAGE_SIZE, ContinuousBatchGenerator, resolve_dtype
from services.generation_process import GeneratorProcess
from services.quantized_linear import pack_4bit_linear_layers, quantize_output_layer
from services.spoken_reply import SpokenReply
from services.tool_calls import ToolCall, ToolCallSplitter

SAMPLING_TOP_P = 0.9  # nucleus sampling, when LLM_TEMPERATURE > 0
MAX_BATCH_TOKENS = 1024  # prompt + generated tokens one batched step may process
# KV-cache page size on CPU, where a prompt's new tokens cost ~3 ms each (~8 on the int4 kernel this
# was measured on): a prompt computes its question and the history's last, partial page again (at
# 32, up to 31 tokens more). Over the 10 benchmark questions in one conversation, the first token
# came after 0.19-0.20 s on average at 8, 0.22 s at 16 and 0.26-0.31 s at 32 (prefill only: the
# tokens after it did not slow down). On a GPU, where prefill is cheap, the default stays (not
# measured there).
CPU_PAGE_SIZE = 8


def load_model(source: str, *, device: str, dtype: str, cpu_threads: int):
    """The model from an HF hub id or directory, on `device`; on CPU with `dtype` auto, its 4-bit
    layers and its output layer on torch's int8 kernel."""
    started = time.perf_counter()
    if device == "cpu":
        # The continuous-batching thread takes torch's thread count as it is when it starts.
        torch.set_num_threads(cpu_threads)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=resolve_dtype(dtype, device)).to(device).eval()
    loaded_as = str(model.dtype)
    if device == "cpu" and dtype == "auto":
        packed, kept = pack_4bit_linear_layers(model)
        loaded_as += f", {packed} of {packed + kept} Linear layers (the 4-bit ones) on the int8 kernel"
        if quantize_output_layer(model):
            loaded_as += ", the output layer on the int8 kernel"
    logger.info(f"LLM {source} loaded on {device} as {loaded_as} in {time.perf_counter() - started:.1f}s")
    return model


def load_batch_generator(
    source: str,
    *,
    device: str,
    dtype: str,
    cpu_threads: int,
    max_new_tokens: int,
    temperature: float,
    max_batch: int,
    kv_cache_tokens: int,
) -> ContinuousBatchGenerator:
    """The model of `source` in a continuous batch (run in the agent's process or in a child)."""
    model = load_model(source, device=device, dtype=dtype, cpu_threads=cpu_threads)
    tokenizer = AutoTokenizer.from_pretrained(source)
    eos = model.generation_config.eos_token_id
    if eos is None:
        eos = tokenizer.eos_token_id
    return ContinuousBatchGenerator(
        model,
        GenerationConfig(
            max_new_tokens=max_new_tokens,
            do_sample=temperature > 0,
            temperature=temperature if temperature > 0 else None,
            top_p=SAMPLING_TOP_P if temperature > 0 else None,
            eos_token_id=eos,
            pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos,
        ),
        max_batch_requests=max_batch,
        kv_cache_tokens=kv_cache_tokens,
        max_batch_tokens=MAX_BATCH_TOKENS,
        name="llm",
        page_size=CPU_PAGE_SIZE if device == "cpu" else PAGE_SIZE,
    )


class TransformersLLMEngine:
    """A chat model whose requests from all conversations share one continuous batch.

    `stream()` yields text deltas; leaving the loop early (or `cancel(id)`) cancels the request
    inside the batch so its slot and KV cache are freed at once. The batch runs in this process or,
    with `own_process`, in a child of its own (`GeneratorProcess`); the tokenizer is always here.
    """

    loads = 0  # models loaded in this process: sessions must share, never add to this

    def __init__(
        self,
        generator: "ContinuousBatchGenerator | GeneratorProcess",
        tokenizer,
        *,
        name: str,
        source: str,
        max_new_tokens: int,
    ):
        TransformersLLMEngine.loads += 1
        self.generator = generator
        self.tokenizer = tokenizer
        self.name = name
        self.source = source  # the HF directory or hub id the model was loaded from
        self.max_new_tokens = max_new_tokens
        self.stats = generator.stats

    @classmethod
    def load(
        cls,
        source: str,
        *,
        gguf_file: str | None = None,
        cache_dir: Path,
        device: str,
        dtype: str,
        cpu_threads: int,
        max_new_tokens: int,
        own_process: bool = False,
        child_env: dict[str, str] | None = None,
        child_secrets: dict[str, str] | None = None,
        **batch_kwargs,
    ) -> "TransformersLLMEngine":
        """Load an HF hub id, a local HF directory, or a GGUF file (converted once, then cached).
        With `own_process`, the model is loaded in the child, which gets `child_env` as its
        environment and `child_secrets` (an HF token) through its pipe."""
        path = Path(source)
        if path.suffix == ".gguf" and path.is_file():
            source, gguf_file = str(path.parent), path.name
        if gguf_file:
            source = str(_hf_cache_of_gguf(Path(source) / gguf_file, cache_dir))
        build = partial(
            load_batch_generator,
            source,
            device=device,
            dtype=dtype,
            cpu_threads=cpu_threads,
            max_new_tokens=max_new_tokens,
            **batch_kwargs,
        )
        if device == "cpu":
            # Torch's other users in this process (Kokoro) keep the thread count they had beside the LLM.
            torch.set_num_threads(cpu_threads)
        if own_process:
            generator = GeneratorProcess(build, name="llm", env=child_env, secrets=child_secrets)
        else:
            generator = build()
        tokenizer = AutoTokenizer.from_pretrained(source)
        return cls(generator, tokenizer, name=Path(source).name or source, source=source, max_new_tokens=max_new_tokens)

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """Chat messages ({role, content: str}, and the template's tool-call messages) and the
        tools' JSON schemas → prompt ids through the model's chat template."""
        encoded = self.tokenizer.apply_chat_template(
            messages, tools=tools or None, add_generation_prompt=True, tokenize=True, return_dict=True
        )
        return list(encoded["input_ids"])

    @property
    def knows_tools(self) -> bool:
        """The chat template renders tools (Qwen2.5, Llama 3.1, ...); SmolLM2's ignores them."""
        return "tools" in (self.tokenizer.chat_template or "")

    def fit(self, messages: list[dict], budget: int | None, tools: list[dict] | None = None) -> list[dict]:
        """`messages` without their oldest turns, so that the prompt takes at most `budget` tokens.

        System messages and the end of the last message always stay. The prompt is what every step of the
        reply's prefill pays for: on CPU a long one delays the first word noticeably, and a small
        model answers the newest question better without a long history.
        """
        if budget is None or len(self.encode_chat(messages, tools)) <= budget:
            return messages
        system = [m for m in messages if m["role"] == "system"]
        turns = [m for m in messages if m["role"] != "system"]
        while len(turns) > 1 and len(self.encode_chat(system + turns, tools)) > budget:
            turns = turns[1:]
            while len(turns) > 1 and turns[0]["role"] != "user":  # start at a user turn
                turns = turns[1:]
        if len(self.encode_chat(system + turns, tools)) > budget:
            # One turn longer than the budget (a user talking for minutes): its latest words stay.
            last = turns[-1]
            room = budget - len(self.encode_chat(system + [{**last, "content": ""}], tools))
            words = self.tokenizer.encode(last["content"], add_special_tokens=False)[-max(1, room) :]
            turns = [{**last, "content": self.tokenizer.decode(words).lstrip()}]
        return system + turns

    async def stream(
        self,
        messages: list[dict],
        *,
        tools: list[dict] | None = None,
        request_id: str | None = None,
        max_new_tokens: int | None = None,
        max_sentences: int | None = None,
    ) -> AsyncIterator[str | ToolCall]:
        """Generate a reply to `messages`, yielding text as it is produced: at most
        `max_sentences` sentences (None: as many as the token budget allows), and never a
        sentence that repeats the reply (see SpokenReply); generation stops there.

        With `tools`, the calls the model makes come last, as ToolCall objects, and are never
        part of the text (see ToolCallSplitter)."""
        request_id = request_id or f"llm-{uuid.uuid4().hex[:12]}"
        tokens: list[int] = []
        text, emitted = "", 0
        reply = SpokenReply(max_sentences)
        splitter = ToolCallSplitter() if tools else None
        generated = self.generator.stream(
            self.encode_chat(messages, tools),
            request_id=request_id,
            max_new_tokens=max_new_tokens or self.max_new_tokens,
        )
        async with aclosing(generated):  # leaving early cancels the request in the batch
            async for new in generated:
                tokens += new
                text = self.tokenizer.decode(tokens, skip_special_tokens=True)
                # A multi-byte character split across tokens decodes to U+FFFD until complete.
                if text.endswith("\ufffd"):
                    continue
                speech = text[: splitter.speakable(text)] if splitter else text
                if (release := reply.update(speech)) > emitted:
                    yield speech[emitted:release]
                    emitted = release
                if reply.over:
                    self.generator.finish(request_id)  # the rest would not be spoken
                    return
        calls: list[ToolCall] = []
        speech = text
        if splitter:
            rest, calls = splitter.finish(text)
            speech = text[: splitter.speakable(text)] + rest
        if (release := reply.finish(speech)) > emitted:
            yield speech[emitted:release]
        for call in calls:
            yield call

    def cancel(self, request_id: str) -> None:
        """Stop a request inside the batch (idempotent)."""
        self.generator.cancel(request_id)

    @property
    def in_flight(self) -> int:
        return self.generator.in_flight

    @property
    def failure(self) -> str | None:
        """Why this engine can serve no request any more (its generation process exited), or None."""
        return self.generator.failure

    async def warmup(self) -> None:
        """The first request compiles kernels and allocates the paged cache: pay that before users do."""
        async for _ in self.stream([{"role": "user", "content": "Hi"}], max_new_tokens=4):
            pass

    def close(self) -> None:
        self.generator.close()


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
