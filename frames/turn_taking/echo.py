"""Pipecat input audio filter that removes the agent's own voice from the microphone (EchoCanceller)."""

from pipecat.audio.filters.base_audio_filter import BaseAudioFilter
from pipecat.frames.frames import FilterControlFrame, FilterEnableFrame

from services.audio import AudioFormatError
from services.echo import EchoCanceller


class EchoCancellingFilter(BaseAudioFilter):
    """The input transport's `audio_in_filter`: it runs before VAD, so the agent's echo never starts a turn.

    Only the microphone side: the same canceller's `playback()` must be fed the agent's audio
    as it is played (an output filter), or there is nothing to cancel.
    """

    def __init__(self, canceller: EchoCanceller):
        self.canceller = canceller
        self._enabled = True

    async def start(self, sample_rate: int):
        if sample_rate != self.canceller.sample_rate:
            raise ValueError(
                f"the input transport delivers {sample_rate} Hz but the echo canceller was built for "
                f"{self.canceller.sample_rate} Hz; build it with EchoCanceller(sample_rate={sample_rate})"
            )

    async def stop(self):
        pass

    async def process_frame(self, frame: FilterControlFrame):
        if isinstance(frame, FilterEnableFrame):
            self._enabled = frame.enable

    async def filter(self, audio: bytes) -> bytes:
        if not self._enabled:
            return audio
        try:
            return self.canceller.cancel(audio)
        except AudioFormatError:
            # An exception here would end the transport's audio task for good. InputAudioGuard,
            # right after the transport, drops and logs a malformed frame.
            return audio
