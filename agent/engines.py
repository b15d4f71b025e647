"""The engine registry: loads each model once per process and hands the same copies to every session."""

import asyncio
import time
from dataclasses import dataclass

from loguru import logger

from agent.config import Settings
from services.llm import TransformersLLMEngine
from services.orpheus import OrpheusEngine
from services.stt import WhisperEngine
from services.tts_piper import PiperEngine


@dataclass
class Engines:
    stt: WhisperEngine
    llm: TransformersLLMEngine
    tts: PiperEngine | OrpheusEngine
    ready: bool = False

    async def warmup(self) -> None:
        """Run each engine once so the first user does not pay for kernel compilation."""
        started = time.perf_counter()
        pcm = await self.tts.synthesize("Warming up.")
        await self.stt.transcribe(pcm, self.tts.sample_rate)
        await self.llm.warmup()
        self.ready = True
        logger.info(f"engines warm in {time.perf_counter() - started:.1f}s")

    def close(self) -> None:
        self.llm.close()
        self.stt.close()
        self.tts.close()


def load_engines(settings: Settings) -> Engines:
    """Load STT, LLM and TTS as configured. Call once per process."""
    if settings.hf_token is not None:
        import os

        os.environ.setdefault("HF_TOKEN", settings.hf_token.get_secret_value())
    stt = WhisperEngine(
        settings.stt_model,
        device=settings.stt_device,
        compute_type=settings.stt_compute_type,
        workers=settings.stt_workers,
        language=settings.stt_language,
    )
    llm = TransformersLLMEngine.load(
        settings.llm_model,
        gguf_file=settings.llm_gguf_file,
        cache_dir=settings.cache_dir,
        device=settings.llm_device,
        dtype=settings.llm_dtype,
        max_new_tokens=settings.llm_max_new_tokens,
        temperature=settings.llm_temperature,
        max_batch_requests=settings.llm_max_batch,
        kv_cache_tokens=settings.llm_kv_cache_tokens,
    )
    return Engines(stt=stt, llm=llm, tts=load_tts(settings))


def load_tts(settings: Settings) -> PiperEngine | OrpheusEngine:
    if settings.tts_engine == "orpheus":
        return OrpheusEngine.load(
            settings.orpheus_model,
            settings.snac_model,
            device=settings.tts_device,
            dtype=settings.tts_dtype,
            compile=settings.tts_compile,
            snac_max_batch=settings.snac_max_batch,
            snac_max_wait_ms=settings.snac_max_wait_ms,
            voice=settings.tts_voice,
            temperature=settings.tts_temperature,
            top_p=settings.tts_top_p,
            max_streams=settings.tts_max_streams,
            kv_cache_tokens=settings.tts_kv_cache_tokens,
        )
    return PiperEngine(
        settings.tts_voice,
        workers=settings.tts_workers,
        use_cuda=settings.tts_device.startswith("cuda"),
    )


async def load_engines_warm(settings: Settings) -> Engines:
    """Load off the event loop, then warm up."""
    engines = await asyncio.to_thread(load_engines, settings)
    await engines.warmup()
    return engines
