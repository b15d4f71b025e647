"""Pipecat TTS service over the shared PiperEngine."""

from collections.abc import AsyncGenerator

from loguru import logger
from pipecat.frames.frames import ErrorFrame, Frame
from pipecat.services.settings import TTSSettings
from pipecat.services.tts_service import TTSService

from services.tts_piper import PiperEngine


class PiperTTSService(TTSService):
    """Speaks each sentence from the LLM with the process-wide Piper voice."""

    def __init__(self, engine: PiperEngine, **kwargs):
        super().__init__(
            push_start_frame=True,
            push_stop_frames=True,
            settings=TTSSettings(model=None, voice=engine.voice_path.stem, language=None),
            **kwargs,
        )
        self._engine = engine

    def can_generate_metrics(self) -> bool:
        return True

    async def run_tts(self, text: str, context_id: str) -> AsyncGenerator[Frame, None]:
        await self.start_tts_usage_metrics(text)
        try:
            async for frame in self._stream_audio_frames_from_iterator(
                self._engine.stream(text), in_sample_rate=self._engine.sample_rate, context_id=context_id
            ):
                await self.stop_ttfb_metrics()
                yield frame
        except Exception as e:  # one failed sentence must not end the conversation
            logger.exception(f"{self}: synthesis failed for [{text}]")
            yield ErrorFrame(error=f"TTS failed: {e}")
        finally:
            await self.stop_ttfb_metrics()
