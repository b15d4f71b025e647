"""Orpheus in several languages: a checkpoint per language, one SNAC for all, each stream on its voice's model."""

from collections.abc import AsyncIterator
from contextlib import aclosing

from services.orpheus.engine import OrpheusEngine, load_lm
from services.orpheus.snac import SAMPLE_RATE
from services.orpheus.text import normalize_text


class OrpheusByLanguage:
    """Orpheus' per-language checkpoints behind one engine.

    `stream(text, voice=v)` runs on the model of the language whose voice `v` is (in `voices`,
    code → voice, as TTS_VOICES); any other voice, or none, runs on the default (English) model.
    Each distinct checkpoint is loaded once (canopylabs' Spanish and Italian share one) and has
    its own continuous batch and KV cache; all of them decode through the one SNAC (the codec is
    language-independent), so SNAC windows of every language batch together.
    """

    sample_rate = SAMPLE_RATE

    def __init__(self, default: OrpheusEngine, by_language: dict[str, OrpheusEngine], voices: dict[str, str]):
        self.default = default
        self.by_language = by_language
        self.engines = list({id(e): e for e in [default, *by_language.values()]}.values())
        if any(engine.snac is not default.snac for engine in self.engines):
            raise ValueError("every language's Orpheus engine must decode through the same SNAC")
        self.snac = default.snac
        self.voice = default.voice
        self.name = ", ".join([default.name, *(f"{code}: {engine.voice}" for code, engine in by_language.items())])
        self._language_of_voice = {voice: code for code, voice in voices.items() if code in by_language}

    @classmethod
    def load(
        cls,
        default_source: str,
        sources: dict[str, str],
        snac_source: str,
        *,
        voices: dict[str, str],
        device: str,
        dtype: str,
        **load_kwargs,
    ) -> "OrpheusByLanguage":
        """The default model and SNAC as `OrpheusEngine.load` loads them (with `load_kwargs`), then
        each other language's model (`sources`: code → hub id or directory) on the same SNAC,
        speaking in `voices[code]`."""
        unvoiced = sorted(set(sources) - set(voices))
        if unvoiced:
            raise ValueError(f"Orpheus models for {unvoiced} but no voice for them: no reply would reach them")
        default = OrpheusEngine.load(default_source, snac_source, device=device, dtype=dtype, **load_kwargs)
        # What each engine is built with, less what only loading the default and SNAC takes.
        engine_kwargs = {k: v for k, v in load_kwargs.items() if k not in ("voice", "compile") and not k.startswith("snac_")}
        loaded = {default_source: default}
        for code, source in sources.items():
            if source not in loaded:
                model, tokenizer = load_lm(source, device=device, dtype=dtype)
                loaded[source] = OrpheusEngine(
                    model, tokenizer, default.snac, voice=voices[code], lang=code, **engine_kwargs
                )
        return cls(default, {code: loaded[source] for code, source in sources.items()}, voices)

    def engine_for(self, voice: str | None) -> OrpheusEngine:
        """The engine whose model speaks `voice`'s language."""
        code = self._language_of_voice.get(voice)
        return self.default if code is None else self.by_language[code]

    async def stream(
        self, text: str, *, voice: str | None = None, request_id: str | None = None
    ) -> AsyncIterator[bytes]:
        """Speak `text` as PCM16 at 24 kHz on the model of `voice`'s language."""
        engine, code = self.engine_for(voice), self._language_of_voice.get(voice)
        if code is not None and code != engine.lang:  # a shared checkpoint (es, it): numbers in this language
            text = normalize_text(text, code)
        async with aclosing(engine.stream(text, voice=voice, request_id=request_id)) as audio:
            async for pcm in audio:
                yield pcm

    def cancel(self, request_id: str) -> None:
        """Stop the stream `request_id`, on whichever model it runs."""
        for engine in self.engines:
            engine.cancel(request_id)

    async def synthesize(self, text: str, *, voice: str | None = None) -> bytes:
        return b"".join([chunk async for chunk in self.stream(text, voice=voice)])

    @property
    def in_flight(self) -> int:
        return sum(engine.in_flight for engine in self.engines)

    async def warmup(self) -> None:
        for engine in self.engines:
            await engine.warmup()

    def close(self) -> None:
        for engine in self.engines:
            engine.generator.close()
        self.snac.close()
