"""Pipecat STT service over the shared WhisperEngine: one VAD segment in, one transcript out."""

import asyncio
from collections.abc import AsyncGenerator
from dataclasses import dataclass

import numpy as np
from loguru import logger
from pipecat.frames.frames import (
    BotStartedSpeakingFrame,
    BotStoppedSpeakingFrame,
    ErrorFrame,
    Frame,
    InputAudioRawFrame,
    TranscriptionFrame,
    VADUserStartedSpeakingFrame,
    VADUserStoppedSpeakingFrame,
)
from pipecat.processors.frame_processor import FrameDirection, FrameProcessorSetup
from pipecat.services.settings import STTSettings
from pipecat.services.stt_service import SegmentedSTTService
from pipecat.transcriptions.language import Language
from pipecat.utils.time import time_now_iso8601

from frames.pipecat_internals import segment_in_progress, set_stt_pre_roll, transcribe_segment_head
from services.audio import AudioFormatError
from services.languages import ConversationLanguage
from services.stt import Transcript, WhisperEngine

# Audio kept from before the VAD says the user started speaking. The VAD runs downstream, in the
# user aggregator, so its start event reaches this service after the audio it marks; on a loaded
# machine that lag passed Pipecat's 1 s and clipped the user's first words ("...weather lichen
# pairs"). Whisper ignores the extra leading silence.
PRE_ROLL_SECS = 3.0
# Longest stretch of speech transcribed at once: Whisper's own window. A user who talks on without
# a pause is transcribed every 30 s, so neither the buffer nor one transcription grows with them.
MAX_SEGMENT_SECS = 30.0
# Silence appended to each segment, so Whisper hears its last word end (Pipecat's default).
TRAILING_SILENCE_SECS = 0.5


@dataclass
class EarlyTranscript:
    """A segment's transcription started when the user paused, before the VAD's stop."""

    pcm: bytes  # the segment as it was at the pause
    task: asyncio.Task


class WhisperSTTService(SegmentedSTTService):
    """Sends each user speech segment to the process-wide WhisperEngine.

    With `short_encode` (STT_SHORT_ENCODE), a segment spoken into silence is encoded at its own
    length; one heard while the agent was speaking always gets Whisper's full window: the barge-in
    policy stops the agent for words, and a short encoding writes words for a hum ("Mhm." → "and
    may chant."); the full window rarely does (bench.stt_window).

    A segment is transcribed as soon as the user pauses (`user_paused`, from the VAD analyzer),
    not after the VAD's 0.2 s of quiet that ends it: when the stop comes with no speech since the
    pause, the early transcript is the segment's, and the reply starts ~0.2 s sooner. Speech
    before the stop throws it away (`user_resumed`).

    With `language` (a multilingual agent), each turn's language is detected and decides the
    conversation's (`ConversationLanguage`); a turn it does not switch to is transcribed again in
    the conversation's language. The transcript carries the language the reply is to be in.
    """

    def __init__(
        self, engine: WhisperEngine, *, short_encode: bool, language: ConversationLanguage | None = None, **kwargs
    ):
        super().__init__(
            settings=STTSettings(model=engine.model_name, language=engine.language),
            # p99 of end-of-speech → transcript on 2 CPU cores with tiny.en; the turn-stop
            # strategies wait this long for a transcript before giving up on it.
            ttfs_p99_latency=0.8,
            trailing_silence_secs=TRAILING_SILENCE_SECS,
            **kwargs,
        )
        self._engine = engine
        self._short_encode = short_encode
        self._language = language
        self._bot_speaking = False
        self._segment_over_bot = False  # the agent spoke during the segment being heard
        self._early: EarlyTranscript | None = None
        self.early_transcripts_used = self.early_transcripts_dropped = 0

    async def setup(self, setup: FrameProcessorSetup):
        await super().setup(setup)
        set_stt_pre_roll(self, PRE_ROLL_SECS)

    @property
    def wants_wav_segments(self) -> bool:
        return False  # raw PCM16; the engine resamples if needed

    def can_generate_metrics(self) -> bool:
        return True

    async def process_frame(self, frame: Frame, direction: FrameDirection):
        if isinstance(frame, BotStartedSpeakingFrame):
            self._bot_speaking = self._segment_over_bot = True
        elif isinstance(frame, BotStoppedSpeakingFrame):
            self._bot_speaking = False
        elif isinstance(frame, VADUserStartedSpeakingFrame):
            self._segment_over_bot = self._bot_speaking
        await super().process_frame(frame, direction)

    async def process_audio_frame(self, frame: InputAudioRawFrame, direction: FrameDirection):
        await super().process_audio_frame(frame, direction)
        segment = segment_in_progress(self)
        if segment is not None and len(segment) >= MAX_SEGMENT_SECS * self.sample_rate * 2:
            cut = quietest_point(segment, self.sample_rate)
            logger.debug(f"{self}: {MAX_SEGMENT_SECS:.0f}s of speech without a pause, transcribing {cut / (2 * self.sample_rate):.1f}s of it")
            self._drop_early()
            await transcribe_segment_head(self, VADUserStoppedSpeakingFrame(), cut)

    def user_paused(self) -> None:
        """The user paused (see PauseListener): transcribe the segment so far, in case the pause ends it."""
        segment = segment_in_progress(self)
        if segment is None:
            logger.debug(f"{self}: the user paused outside a segment")
            return
        self._drop_early()
        pcm = bytes(segment)
        logger.debug(f"{self}: the user paused, transcribing {len(pcm) / 2 / self.sample_rate:.2f}s early")
        # A plain task, not Pipecat's create_task: that one logs and swallows the engine's errors,
        # and run_stt reports them as it does for a segment transcribed at the stop.
        task = asyncio.create_task(self._transcribe(pcm + _silence(TRAILING_SILENCE_SECS, self.sample_rate)))
        self._early = EarlyTranscript(pcm, task)

    def user_resumed(self) -> None:
        """The user spoke again before the VAD's stop: the early transcript misses those words."""
        logger.debug(f"{self}: the user spoke again before the VAD's stop")
        self._drop_early()

    def _drop_early(self) -> None:
        early, self._early = self._early, None
        if early is None:
            return
        self.early_transcripts_dropped += 1
        if early.task.done():
            if not early.task.cancelled():
                early.task.exception()  # retrieved, so asyncio does not log it as lost
        else:
            early.task.cancel()  # still queued for a worker: it never costs compute

    async def _transcribe_segment(self, audio: bytes) -> Transcript:
        """`audio`'s transcript: the early one if it was made of this segment (no speech since)."""
        early = self._early
        if early is not None and audio.startswith(early.pcm):
            self._early = None
            self.early_transcripts_used += 1
            return await early.task
        return await self._transcribe(audio)

    async def cleanup(self):
        self._drop_early()
        await super().cleanup()

    async def run_stt(self, audio: bytes) -> AsyncGenerator[Frame, None]:
        await self.start_processing_metrics()
        try:
            transcript = await self._transcribe_segment(audio)
        except AudioFormatError as e:
            logger.error(f"{self}: rejected audio segment: {e}")
            yield ErrorFrame(error=f"STT rejected audio: {e}")
            return
        except Exception as e:  # an engine failure loses this segment, not the conversation
            logger.exception(f"{self}: transcription failed")
            yield ErrorFrame(error=f"STT failed: {e}")
            return
        finally:
            await self.stop_processing_metrics()
        if transcript.text:
            logger.debug(
                f"{self}: transcript [{transcript.text}] ({transcript.processing_seconds:.2f}s, "
                f"no speech {transcript.no_speech_prob:.2f})"
            )
            yield TranscriptionFrame(
                transcript.text,
                self._user_id,
                time_now_iso8601(),
                language=_language(transcript.language),
                result=transcript,
            )

    async def _transcribe(self, audio: bytes) -> Transcript:
        short = self._short_encode and not self._segment_over_bot
        if self._language is None or self._language.pinned:
            language = self._language.current if self._language else None
            return await self._engine.transcribe(audio, self.sample_rate, short=short, language=language)
        transcript = await self._engine.transcribe(audio, self.sample_rate)  # detects the language
        language = self._language.decide(transcript.language_probabilities, transcript.text)
        if language != transcript.language:
            logger.debug(f"{self}: [{transcript.text}] heard as {transcript.language}, kept in {language}")
            transcript = await self._engine.transcribe(audio, self.sample_rate, language=language)
        return transcript


def quietest_point(pcm: bytearray, sample_rate: int, search_secs: float = 1.0, window_secs: float = 0.02) -> int:
    """Byte offset of the quietest 20 ms in the last second of `pcm`: most likely a gap between words,
    where a cut costs Whisper no word on either side."""
    window = int(sample_rate * window_secs)
    samples = np.frombuffer(pcm, dtype=np.int16)
    start = max(0, len(samples) - int(sample_rate * search_secs))
    tail = samples[start : start + (len(samples) - start) // window * window].astype(np.float32)
    if not len(tail):
        return len(pcm)
    energy = (tail.reshape(-1, window) ** 2).mean(axis=1)
    return 2 * (start + int(np.argmin(energy)) * window + window // 2)


def _silence(seconds: float, sample_rate: int) -> bytes:
    return b"\x00\x00" * int(seconds * sample_rate)


def _language(code: str) -> Language | None:
    try:
        return Language(code)
    except ValueError:
        return None
