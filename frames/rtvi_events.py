"""The RTVI events a conversation sends its client: Pipecat's, with the language of each final user transcript."""

import pipecat.processors.frameworks.rtvi.models as RTVI
from pipecat.frames.frames import TranscriptionFrame
from pipecat.observers.base_observer import FramePushed
from pipecat.processors.frameworks.rtvi.observer import RTVIObserver


class UserTranscriptionData(RTVI.UserTranscriptionMessageData):
    language: str | None = None  # Whisper's code ("es"): the language the agent answers in


class UserTranscriptionMessage(RTVI.UserTranscriptionMessage):
    data: UserTranscriptionData


class LanguageTaggingRTVIObserver(RTVIObserver):
    """Pipecat's RTVI observer; a final `user-transcription` also says its language
    (`data.language`), which a multilingual agent detects per turn."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._language: str | None = None  # of the transcript being reported

    async def on_push_frame(self, data: FramePushed):
        if isinstance(data.frame, TranscriptionFrame):
            language = data.frame.language
            self._language = getattr(language, "value", language)
        await super().on_push_frame(data)

    # Pipecat's documented hook for sending RTVI messages differently.
    async def send_rtvi_message(self, model, exclude_none: bool = True):
        if isinstance(model, RTVI.UserTranscriptionMessage) and model.data.final:
            model = UserTranscriptionMessage(
                data=UserTranscriptionData(**model.data.model_dump(), language=self._language)
            )
        await super().send_rtvi_message(model, exclude_none)
