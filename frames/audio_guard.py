"""Input audio guard: makes sure only well-formed PCM16 at the pipeline's rate reaches VAD and STT."""

import time
from collections import OrderedDict

import numpy as np
import soxr
from loguru import logger
from pipecat.frames.frames import Frame, InputAudioRawFrame
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor, FrameProcessorSetup

from services.audio import INPUT_SAMPLE_RATE, MAX_SAMPLE_RATE, MIN_SAMPLE_RATE

ERROR_LOG_INTERVAL_SECS = 5.0  # a broken client sends 50 bad frames a second; log, don't flood
# Resamplers kept (one per source rate, least recently used dropped): a real client uses one rate;
# a hostile one cycling through thousands must not grow the session's memory.
MAX_RESAMPLERS = 4


class InputAudioGuard(FrameProcessor):
    """Repairs what can be repaired (other sample rates, stereo) and drops what cannot.

    Silero and Whisper silently misbehave on audio at the wrong rate or misaligned bytes, so
    the check happens once, right after the transport, with a clear log line for each kind of
    problem. Counters are kept for tests and metrics.
    """

    def __init__(self, *, on_drop=None, **kwargs):
        super().__init__(**kwargs)
        self._rate = INPUT_SAMPLE_RATE  # the pipeline's, from setup()
        self._resamplers: OrderedDict[int, soxr.ResampleStream] = OrderedDict()
        self._last_logged: dict[str, float] = {}
        self.dropped: dict[str, int] = {}
        self._on_drop = on_drop  # e.g. a metrics counter: on_drop(kind)
        self.resampled_frames = 0

    async def setup(self, setup: FrameProcessorSetup):
        await super().setup(setup)
        self._rate = setup.audio_in_sample_rate or self._rate

    async def process_frame(self, frame: Frame, direction: FrameDirection):
        await super().process_frame(frame, direction)
        if isinstance(frame, InputAudioRawFrame) and direction == FrameDirection.DOWNSTREAM:
            frame = self._repair(frame)
            if frame is None:
                return
        await self.push_frame(frame, direction)

    def _repair(self, frame: InputAudioRawFrame) -> InputAudioRawFrame | None:
        audio, rate, channels = frame.audio, frame.sample_rate, frame.num_channels
        if not audio:
            self._drop("empty", "empty audio frame")
            return None
        if channels < 1 or len(audio) % (2 * channels):
            self._drop(
                "misaligned",
                f"audio frame of {len(audio)} bytes is not whole 16-bit samples of {channels} channel(s)",
            )
            return None
        if not MIN_SAMPLE_RATE <= rate <= MAX_SAMPLE_RATE:
            self._drop("bad_rate", f"audio frame at {rate} Hz is outside {MIN_SAMPLE_RATE}..{MAX_SAMPLE_RATE} Hz")
            return None
        if channels == 1 and rate == self._rate:
            return frame
        samples = np.frombuffer(audio, dtype=np.int16).reshape(-1, channels).mean(axis=1)
        if rate != self._rate:
            # A stream per source rate keeps filter state across frames (no clicks at 20 ms edges).
            resampler = self._resamplers.get(rate)
            if resampler is None:
                self._log("resampled", f"input audio arrives at {rate} Hz; resampling to {self._rate} Hz")
                resampler = soxr.ResampleStream(rate, self._rate, 1, dtype="float32")
                self._resamplers[rate] = resampler
                if len(self._resamplers) > MAX_RESAMPLERS:
                    self._resamplers.popitem(last=False)
            self._resamplers.move_to_end(rate)
            samples = resampler.resample_chunk(samples.astype(np.float32))
        self.resampled_frames += 1
        pcm = np.clip(samples, -32768, 32767).astype(np.int16).tobytes()
        repaired = InputAudioRawFrame(audio=pcm, sample_rate=self._rate, num_channels=1)
        repaired.transport_source = frame.transport_source
        return repaired

    def _drop(self, kind: str, message: str) -> None:
        self.dropped[kind] = self.dropped.get(kind, 0) + 1
        if self._on_drop is not None:
            self._on_drop(kind)
        self._log(kind, f"dropped invalid input: {message} ({self.dropped[kind]} so far)", error=kind != "empty")

    def _log(self, kind: str, message: str, error: bool = False) -> None:
        now = time.monotonic()
        if now - self._last_logged.get(kind, -ERROR_LOG_INTERVAL_SECS) >= ERROR_LOG_INTERVAL_SECS:
            self._last_logged[kind] = now
            (logger.error if error else logger.warning)(f"{self}: {message}")
