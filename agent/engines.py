"""The engine registry: loads each model once per process and hands the same copies to every conversation."""

import asyncio
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from loguru import logger

from agent.config import Settings, environment_without_secrets
from frames.turn_taking import turn_models
from services import bundled
from services.batcher import DynamicBatcher
from services.engine import Engine
from services.llm import TransformersLLMEngine
from services.orpheus.by_language import OrpheusByLanguage
from services.orpheus.engine import OrpheusEngine
from services.stt import WhisperEngine
from services.tts_piper import PiperEngine

if TYPE_CHECKING:  # kokoro-onnx comes with the `multilingual` extra: imported when TTS_ENGINE=kokoro
    from services.tts_kokoro import KokoroEngine


@dataclass
class Engines:
    stt: WhisperEngine
    llm: TransformersLLMEngine
    tts: "PiperEngine | OrpheusEngine | OrpheusByLanguage | KokoroEngine"
    ready: bool = False

    def by_stage(self) -> dict[str, Engine]:
        return {"stt": self.stt, "llm": self.llm, "tts": self.tts}

    def batchers(self) -> dict[str, DynamicBatcher]:
        """The dynamic batchers inside the engines, by name (for queue and batch-size metrics)."""
        return {"snac": self.tts.snac.batcher} if isinstance(self.tts, (OrpheusEngine, OrpheusByLanguage)) else {}

    async def warmup(self) -> None:
        """Run each engine once so the first user does not pay for kernel compilation."""
        started = time.perf_counter()
        for engine in self.by_stage().values():
            await engine.warmup()
        self.ready = True
        logger.info(f"engines warm in {time.perf_counter() - started:.1f}s")

    def close(self) -> None:
        for engine in self.by_stage().values():
            engine.close()


def load_engines(settings: Settings) -> Engines:
    """Load STT, LLM and TTS as configured. Call once per process."""
    if settings.hf_token is not None:
        import os

        os.environ.setdefault("HF_TOKEN", settings.hf_token.get_secret_value())
    engines = Engines(stt=load_stt(settings), llm=load_llm(settings), tts=load_tts(settings))
    turn_models.load_sessions()  # the VAD and turn models every conversation shares
    return engines


def load_stt(settings: Settings) -> WhisperEngine:
    return WhisperEngine(
        bundled.stt_path(settings.stt_model, settings.cache_dir),
        **settings.of_stage("stt", "device", "compute_type", "workers", "language", "beam_size", "cpu_threads"),
    )


def load_llm(settings: Settings) -> TransformersLLMEngine:
    llm = TransformersLLMEngine.load(
        bundled.llm_path(settings.llm_model, settings.cache_dir),
        cache_dir=settings.cache_dir,
        **settings.of_stage("llm", "gguf_file", "device", "dtype", "cpu_threads", "max_new_tokens", "temperature"),
        **settings.of_stage("llm", "max_batch", "kv_cache_tokens", "own_process"),
        child_env=environment_without_secrets(),
        child_secrets={"HF_TOKEN": settings.hf_token.get_secret_value()} if settings.hf_token else None,
    )
    warn_if_tools_unsupported(settings, llm)
    return llm


def warn_if_tools_unsupported(settings: Settings, llm: TransformersLLMEngine) -> bool:
    """Say at start when tools are configured for a model that cannot call them (SmolLM2)."""
    if settings.tools_configured and not llm.knows_tools:
        logger.warning(
            f"tools are configured (TOOLS_*, MCP_SERVERS) but {llm.name}'s chat template has none: the "
            "model will never call them; conversations go on without. Use a tool-capable LLM_MODEL "
            "(qwen2.5-coder-0.5b on CPU, Llama-3.1-8B-Instruct on GPU)."
        )
        return True
    return False


def load_tts(settings: Settings) -> "PiperEngine | OrpheusEngine | OrpheusByLanguage | KokoroEngine":
    if settings.tts_engine == "orpheus":
        kwargs = {
            **settings.of_stage("tts", "device", "dtype", "compile", "voice", "temperature", "top_p"),
            **settings.of_stage("tts", "max_streams", "kv_cache_tokens"),
            **{f"snac_{name}": value for name, value in settings.of_stage("snac", "max_batch", "max_wait_ms").items()},
        }
        if settings.orpheus_model_by_language:  # ORPHEUS_MODELS: a model per language, one SNAC
            return OrpheusByLanguage.load(
                settings.orpheus_model,
                settings.orpheus_model_by_language,
                settings.snac_model,
                voices=settings.voice_by_language,
                **kwargs,
            )
        return OrpheusEngine.load(settings.orpheus_model, settings.snac_model, **kwargs)
    if settings.tts_engine == "kokoro":
        from services.tts_kokoro import KokoroEngine

        return KokoroEngine(
            bundled.kokoro_model(settings.cache_dir),
            bundled.kokoro_voices(settings.cache_dir),
            voice=settings.tts_voice,
            workers=settings.tts_workers,
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
