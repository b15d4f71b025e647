"""Speech-to-text engine: one faster-whisper model shared by every conversation."""

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from faster_whisper import WhisperModel
from faster_whisper.tokenizer import Tokenizer
from faster_whisper.transcribe import get_ctranslate2_storage, get_suppressed_tokens

from services.audio import INPUT_SAMPLE_RATE, pcm16_to_float, without_leading_quiet
from services.spoken_reply import words

WHISPER_SAMPLE_RATE = INPUT_SAMPLE_RATE
WINDOW_SECS = 30.0  # what Whisper's encoder was trained on: every call encodes 30 s, padded
SHORT_PAD_SECS = 3.0  # silence after a segment: the decoder sees the speech end (less and it mishears more)
SHORT_MIN_WINDOW_SECS = 10.0  # and at least this long a window: shorter ones misheard more in our tests
MAX_WORDS_PER_SECOND = 5.0  # faster than anyone speaks: the decoder is looping


@dataclass
class TranscriptSegment:
    start: float  # seconds from the start of the audio
    end: float
    text: str
    # Whisper's own doubt, where it reports it (the full-window path): the mean log-probability of
    # the segment's tokens, and the probability that the audio held no speech at all.
    avg_logprob: float = 0.0
    no_speech_prob: float = 0.0


@dataclass
class Transcript:
    text: str
    language: str
    language_probability: float
    audio_seconds: float
    processing_seconds: float
    segments: list[TranscriptSegment] = field(default_factory=list)
    # Whisper's language probabilities, most likely first, when the language was detected.
    language_probabilities: list[tuple[str, float]] = field(default_factory=list)

    @property
    def no_speech_prob(self) -> float:
        """How sure Whisper is that no one spoke: its least doubtful segment's no-speech probability."""
        return min((s.no_speech_prob for s in self.segments), default=1.0)


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
        cpu_threads: int,
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
            cpu_threads=cpu_threads,  # each worker's
            local_files_only=Path(model).is_dir(),  # a directory never needs the hub
        )
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="whisper")
        if language is not None:  # short encodings decode with a fixed language
            self._tokenizer = Tokenizer(
                self._model.hf_tokenizer, self._model.model.is_multilingual, task="transcribe", language=language
            )
            self._suppressed = list(get_suppressed_tokens(self._tokenizer, [-1]))
        else:
            self._tokenizer = None  # language detection: faster-whisper's own path, always the full window
        # Lifetime counts: transcriptions by how they were encoded, and short encodings that
        # looked wrong and were redone on the full window.
        self.short_encodes = self.full_window_encodes = self.fallbacks = 0
        self.detections = 0  # transcriptions that detected the language
        self.in_flight = 0  # submitted and not finished: queued on the pool or running

    async def transcribe(
        self, pcm: bytes, sample_rate: int, *, short: bool = False, language: str | None = None
    ) -> Transcript:
        """Transcribe mono PCM16 audio; resamples to 16 kHz when needed.

        `language`: the language spoken; default the engine's (STT_LANGUAGE), and when neither is
        set Whisper detects it. `short`: encode the audio at its own length rather than in
        Whisper's padded 30 s window (see `_transcribe_short`; only in the engine's own language).
        """
        audio = pcm16_to_float(pcm, sample_rate, WHISPER_SAMPLE_RATE)
        loop = asyncio.get_running_loop()
        self.in_flight += 1
        try:
            return await loop.run_in_executor(self._pool, self._transcribe_sync, audio, short, language or self.language)
        finally:
            self.in_flight -= 1

    def _transcribe_sync(self, audio: np.ndarray, short: bool, language: str | None) -> Transcript:
        started = time.perf_counter()
        duration = audio.size / WHISPER_SAMPLE_RATE
        if audio.size == 0:
            return Transcript("", language or "en", 0.0, 0.0, 0.0)
        short = short and language == self.language and self._tokenizer is not None
        if short and duration + SHORT_PAD_SECS <= WINDOW_SECS:
            segment = self._transcribe_short(audio)
            if segment is not None:
                self.short_encodes += 1
                return Transcript(
                    text=segment.text,
                    language=self.language,
                    language_probability=1.0,
                    audio_seconds=duration,
                    processing_seconds=time.perf_counter() - started,
                    segments=[segment] if segment.text else [],
                )
            self.fallbacks += 1
        self.detections += language is None
        segments, info = self._model.transcribe(
            audio,
            language=language,
            beam_size=self.beam_size,
            condition_on_previous_text=False,
            vad_filter=False,  # Silero already cut the turn; a second VAD only adds latency
        )
        parts = [TranscriptSegment(s.start, s.end, s.text.strip(), s.avg_logprob, s.no_speech_prob) for s in segments]
        self.full_window_encodes += 1
        return Transcript(
            text=" ".join(p.text for p in parts if p.text).strip(),
            language=info.language,
            language_probability=float(info.language_probability),
            audio_seconds=duration,
            processing_seconds=time.perf_counter() - started,
            segments=parts,
            language_probabilities=[(code, float(p)) for code, p in info.all_language_probs or []],
        )

    async def warmup(self) -> None:
        await self.transcribe(b"\x00\x00" * WHISPER_SAMPLE_RATE, WHISPER_SAMPLE_RATE)

    def _transcribe_short(self, audio: np.ndarray) -> TranscriptSegment | None:
        """Encode the segment at its own length instead of the padded 30 s window.

        CTranslate2's Whisper encoder takes any number of frames up to the window, and a 3 s
        turn then costs ~0.06 s to encode instead of ~0.4 s on 2 CPU cores. Whisper was trained
        on whole windows, so now and then the decoder loops on a short encoding ("What is it?
        What is it? ..."); that result is refused (None) and the caller encodes the full window.
        """
        # At its own length, the encoder pays for pre-roll too: a segment comes with up to 3 s of
        # it (frames/stt.py), mostly room tone.
        audio = without_leading_quiet(audio, WHISPER_SAMPLE_RATE, keep_secs=0.3, quiet=0.05, window_secs=0.02)
        window = max(audio.size / WHISPER_SAMPLE_RATE + SHORT_PAD_SECS, SHORT_MIN_WINDOW_SECS)
        padded = np.zeros(int(window * WHISPER_SAMPLE_RATE), np.float32)
        padded[: audio.size] = audio
        features = self._model.feature_extractor(padded)
        features = features[:, : features.shape[1] // 2 * 2]  # the encoder halves the frame count
        encoded = self._model.model.encode(get_ctranslate2_storage(features[None]), to_cpu=False)
        duration = audio.size / WHISPER_SAMPLE_RATE
        result = self._model.model.generate(
            encoded,
            [[*self._tokenizer.sot_sequence, self._tokenizer.no_timestamps]],
            beam_size=self.beam_size,
            max_length=int(20 + 8 * duration),  # tokens: well above speech, bounds a loop
            suppress_blank=True,
            suppress_tokens=self._suppressed,
            return_scores=True,
            return_no_speech_prob=True,
        )[0]
        tokens = result.sequences_ids[0]
        text = first_of_repeats(self._tokenizer.decode([t for t in tokens if t < self._tokenizer.eot]))
        said = words(text)
        runs = [tuple(said[i : i + 3]) for i in range(len(said) - 2)]
        if len(said) > MAX_WORDS_PER_SECOND * duration + 2 or len(set(runs)) < len(runs) - 1:
            return None
        # As faster-whisper reports it: the score is the length-normalized log-probability.
        avg_logprob = result.scores[0] * len(tokens) / (len(tokens) + 1)
        return TranscriptSegment(0.0, duration, text, avg_logprob, result.no_speech_prob)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def first_of_repeats(text: str) -> str:
    """"What is it? What is it? What is" → "What is it?": the decoder's usual loop on a short
    encoding repeats what it heard from the start, so the first round is the transcript."""
    text = " ".join(text.split())
    for cut in range(3, len(text) // 2 + 1):
        head, rest = text[:cut].strip(), text[cut:].strip()
        if text[cut - 1] in ".?!," and rest and (rest.startswith(head) or head.startswith(rest)):
            return head
    return text


def _split_device(device: str) -> tuple[str, int]:
    """'cuda:1' → ('cuda', 1); CTranslate2 takes the index separately."""
    kind, _, index = device.partition(":")
    return kind, int(index or 0)

