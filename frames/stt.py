"""Pipecat STT service over the shared WhisperEngine: one VAD segment in, one transcript out."""

from collections.abc import AsyncGenerator

from loguru import logger
from pipecat.frames.frames import ErrorFrame, Frame, TranscriptionFrame
from pipecat.services.settings import STTSettings
from pipecat.services.stt_service import SegmentedSTTService
from pipecat.transcriptions.language import Language
from pipecat.utils.time import time_now_iso8601

from services.audio import AudioFormatError
from services.stt import WhisperEngine


class WhisperSTTService(SegmentedSTTService):
    """Sends each user speech segment to the process-wide WhisperEngine."""

    def __init__(self, engine: WhisperEngine, **kwargs):
        super().__init__(
            settings=STTSettings(model=engine.model_name, language=engine.language),
            # p99 of end-of-speech → transcript on 2 CPU cores with tiny.en; the turn-stop
            # strategies wait this long for a transcript before giving up on it.
            ttfs_p99_latency=0.8,
            **kwargs,
        )
        self._engine = engine
        self.last_transcript = None  # the engine's Transcript for the latest segment

    @property
    def wants_wav_segments(self) -> bool:
        return False  # raw PCM16; the engine resamples if needed

    def can_generate_metrics(self) -> bool:
        return True

    async def run_stt(self, audio: bytes) -> AsyncGenerator[Frame, None]:
        await self.start_processing_metrics()
        try:
            transcript = await self._engine.transcribe(audio, self.sample_rate)
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
        self.last_transcript = transcript
        if transcript.text:
            logger.debug(f"{self}: transcript [{transcript.text}] ({transcript.processing_seconds:.2f}s)")
            yield TranscriptionFrame(
                transcript.text,
                self._user_id,
                time_now_iso8601(),
                language=_language(transcript.language),
                result=transcript,
            )


def _language(code: str) -> Language | None:
    try:
        return Language(code)
    except ValueError:
        return None
