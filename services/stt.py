"""Speech-to-text engine: one faster-whisper model shared by every conversation."""

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from faster_whisper import WhisperModel

from services.audio import INPUT_SAMPLE_RATE, pcm16_to_float

WHISPER_SAMPLE_RATE = INPUT_SAMPLE_RATE


@dataclass
class TranscriptSegment:
    start: float  # seconds from the start of the audio
    end: float
    text: str


@dataclass
class Transcript:
    text: str
    language: str
    language_probability: float
    audio_seconds: float
    processing_seconds: float
    segments: list[TranscriptSegment] = field(default_factory=list)


class WhisperEngine:
    """faster-whisper behind an async API.

    CTranslate2 releases the GIL and runs `num_workers` transcriptions in parallel on one
    model, so segments from concurrent conversations go to a bounded thread pool of that size
    instead of each conversation loading its own copy.
    """

    loads = 0  # models loaded in this process: sessions must share, never add to this

    def __init__(
        self,
        model: str,
        *,
        device: str,
        compute_type: str,
        workers: int,
        language: str | None,
        beam_size: int,
    ):
        self.model_name = model
        # A bundled model's directory is just ".../model"; /health shows a name, not a path.
        self.name = Path(model).name if Path(model).is_dir() else model
        if self.name == "model":
            self.name = Path(model).parent.name
        WhisperEngine.loads += 1
        self.language = language
        self.beam_size = beam_size
        whisper_device, device_index = _split_device(device)
        self._model = WhisperModel(
            model,
            device=whisper_device,
            device_index=device_index,
            compute_type=compute_type,
            num_workers=workers,
            local_files_only=Path(model).is_dir(),  # a directory never needs the hub
        )
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="whisper")
        self.transcriptions = 0  # lifetime count
        self.in_flight = 0  # submitted and not finished: queued on the pool or running

    async def transcribe(self, pcm: bytes, sample_rate: int) -> Transcript:
        """Transcribe mono PCM16 audio; resamples to 16 kHz when needed."""
        audio = pcm16_to_float(pcm, sample_rate, WHISPER_SAMPLE_RATE)
        loop = asyncio.get_running_loop()
        self.in_flight += 1
        try:
            return await loop.run_in_executor(self._pool, self._transcribe_sync, audio)
        finally:
            self.in_flight -= 1

    def _transcribe_sync(self, audio) -> Transcript:
        started = time.perf_counter()
        duration = audio.size / WHISPER_SAMPLE_RATE
        if audio.size == 0:
            return Transcript("", self.language or "en", 0.0, 0.0, 0.0)
        segments, info = self._model.transcribe(
            audio,
            language=self.language,
            beam_size=self.beam_size,
            condition_on_previous_text=False,
            vad_filter=False,  # Silero already cut the turn; a second VAD only adds latency
        )
        parts = [TranscriptSegment(s.start, s.end, s.text.strip()) for s in segments]
        self.transcriptions += 1
        return Transcript(
            text=" ".join(p.text for p in parts if p.text).strip(),
            language=info.language,
            language_probability=float(info.language_probability),
            audio_seconds=duration,
            processing_seconds=time.perf_counter() - started,
            segments=parts,
        )

    async def warmup(self) -> None:
        await self.transcribe(b"\x00\x00" * WHISPER_SAMPLE_RATE, WHISPER_SAMPLE_RATE)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _split_device(device: str) -> tuple[str, int]:
    """'cuda:1' → ('cuda', 1); CTranslate2 takes the index separately."""
    kind, _, index = device.partition(":")
    return kind, int(index or 0)

