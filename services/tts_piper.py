"""Piper text-to-speech engine (the CPU profile's voice): one voice model shared by every conversation."""

import asyncio
import json
import threading
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from piper import PiperConfig, PiperVoice, SynthesisConfig

from services import onnx_sessions
from services.audio import float_to_pcm16, without_leading_quiet

# Each synthesis on one thread; `workers` of them run at once (TTS_WORKERS), as Whisper's do. Over
# LiveKit and P2P, where the transports and the LLM's decoding want the cores too, the first
# chunk's audio took 161 and 151 ms (p50) on one thread against 177 and 165 ms on two.
ONNX_THREADS = 1
LEAD_IN_SECS = 0.01  # quiet kept before a sentence's first sound


class PiperEngine:
    """Streams PCM16 one sentence at a time, so the first sentence plays while the next is synthesized.

    espeak-ng (phonemization) keeps global state and is not thread-safe, so it runs under a lock;
    the ONNX voice model is thread-safe and runs on a bounded pool shared by all conversations.
    """

    loads = 0  # models loaded in this process: sessions must share, never add to this

    def __init__(self, voice_path: str | Path, *, workers: int, use_cuda: bool):
        self.voice_path = Path(voice_path)
        self.voice = self.voice_path.stem
        self.name = self.voice
        PiperEngine.loads += 1
        # PiperVoice.load would open the model with onnxruntime's default, spinning threads.
        config = json.loads(Path(f"{self.voice_path}.json").read_text(encoding="utf-8"))
        self._voice = PiperVoice(
            config=PiperConfig.from_dict(config),
            session=onnx_sessions.session(
                str(self.voice_path),
                threads=ONNX_THREADS,
                providers=[("CUDAExecutionProvider", {"cudnn_conv_algo_search": "HEURISTIC"})] if use_cuda else ["CPUExecutionProvider"],
            ),
        )
        self.sample_rate: int = self._voice.config.sample_rate
        self._phonemize_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="piper")
        self._config = SynthesisConfig()
        # Piper samples noise for every sentence (VITS), so the same text never sounds quite the
        # same twice. Without it, it does: the test suite's and the benchmarks' users say each
        # line the same way in every run, and what Whisper makes of it does not vary between runs.
        self._repeatable_config = SynthesisConfig(noise_scale=0.0, noise_w_scale=0.0)
        self.syntheses = 0  # lifetime count of sentences synthesized
        self.in_flight = 0  # streams being synthesized

    def _phonemize(self, text: str) -> list[list[str]]:
        with self._phonemize_lock:
            return self._voice.phonemize(text)

    def _sentence_audio(self, phonemes: list[str], config: SynthesisConfig) -> bytes:
        ids = self._voice.phonemes_to_ids(phonemes)
        audio = self._voice.phoneme_ids_to_audio(ids, config)
        self.syntheses += 1
        # Piper starts a sentence with 20-60 ms of near-silence (under 0.5 % of its loudest 10 ms),
        # which a reply's listener would wait through before its first word.
        return float_to_pcm16(without_leading_quiet(audio, self.sample_rate, keep_secs=LEAD_IN_SECS, quiet=0.005))

    async def stream(self, text: str, *, voice: str | None = None, repeatable: bool = False) -> AsyncIterator[bytes]:
        """Yield mono PCM16 at `self.sample_rate`, one chunk per sentence of `text`. A Piper model
        is one voice: `voice` may only name it. `repeatable`: the same audio for the same text
        every time (no sampling noise)."""
        if voice not in (None, self.voice):
            raise ValueError(f"Piper model {self.voice} has no voice {voice!r}; load that voice's model instead")
        loop = asyncio.get_running_loop()
        self.in_flight += 1
        try:
            sentences = await loop.run_in_executor(self._pool, self._phonemize, text)
            for phonemes in sentences:
                if phonemes:
                    config = self._repeatable_config if repeatable else self._config
                    yield await loop.run_in_executor(self._pool, self._sentence_audio, phonemes, config)
        finally:
            self.in_flight -= 1

    async def synthesize(self, text: str, *, repeatable: bool = False) -> bytes:
        """All of `text` as one PCM16 buffer."""
        return b"".join([chunk async for chunk in self.stream(text, repeatable=repeatable)])

    async def warmup(self) -> None:
        await self.synthesize("Warming up.")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
