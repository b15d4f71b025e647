"""What tests and benchmarks observe of conversations: every LLM request and reply, and each turn's timings."""

import copy
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field, replace

from pipecat.frames.frames import BotStartedSpeakingFrame, TranscriptionFrame, UserStartedSpeakingFrame
from pipecat.observers.base_observer import BaseObserver, FramePushed

from agent.conversation import Conversation
from agent.engines import Engines
from agent.turn_metrics import TurnLatency


@dataclass
class LLMRequests:
    """One conversation's LLM requests, in order: the messages sent and the whole text generated
    (even a reply nobody heard: withdrawn speculation, a barge-in)."""

    prompts: list[list[dict]] = field(default_factory=list)
    replies: list[str] = field(default_factory=list)
    tool_calls: list = field(default_factory=list)  # services.tool_calls.ToolCall, as the model made them


class LLMLog:
    """The real LLM engine, recording every request it serves by the conversation that made it.

    Everything else is the engine's own (`__getattr__`), so a conversation cannot tell the
    difference. Requests are grouped by their id's prefix: the conversation's LLM service name.
    """

    def __init__(self, engine):
        self.engine = engine
        self._by_service: dict[str, LLMRequests] = {}

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def of(self, conversation: Conversation) -> LLMRequests:
        return self._by_service.setdefault(conversation.llm.name, LLMRequests())

    async def stream(self, messages: list[dict], *, request_id: str, **kwargs) -> AsyncIterator[str]:
        log = self._by_service.setdefault(request_id.rsplit("-", 1)[0], LLMRequests())
        log.prompts.append(copy.deepcopy(messages))
        log.replies.append("")
        index = len(log.replies) - 1
        async with aclosing(self.engine.stream(messages, request_id=request_id, **kwargs)) as texts:
            async for output in texts:
                if isinstance(output, str):
                    log.replies[index] += output
                else:
                    log.tool_calls.append(output)
                yield output


class SpeechLog:
    """The real TTS engine, recording the voice and text of every stream it is asked for
    (`spoken`, in order); everything else is the engine's own."""

    def __init__(self, engine):
        self.engine = engine
        self.spoken: list[tuple[str | None, str]] = []

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def stream(self, text: str, *, voice: str | None = None, **kwargs) -> AsyncIterator[bytes]:
        self.spoken.append((voice, text))
        return self.engine.stream(text, voice=voice, **kwargs)


def with_llm_log(engines: Engines) -> Engines:
    """The same engines, the LLM wrapped in an LLMLog (`engines.llm.of(conversation)`)."""
    return replace(engines, llm=LLMLog(engines.llm))


class TurnLog(BaseObserver):
    """A conversation's turns (as its `ConversationMetrics`), and, as an observer of its pipeline,
    when user turns and bot speech started and what the STT heard (the engine's Transcripts)."""

    @classmethod
    def attach(cls, conversation: Conversation) -> "TurnLog":
        """Watch a conversation someone else built (e.g. the server, for a LiveKit room)."""
        log = cls()
        conversation.turns.add_sink(log)
        conversation.worker.add_observer(log)
        return log

    def __init__(self):
        super().__init__()
        self.turns: list[TurnLatency] = []
        self.underruns = 0
        self.errors: list[str] = []
        self.user_turn_started_at: list[float] = []  # pipeline clock, seconds
        self.bot_started_at: list[float] = []
        self.transcripts: list = []  # services.stt.Transcript of each transcribed segment

    def observe_turn(self, turn: TurnLatency) -> None:
        self.turns.append(turn)

    def count_underrun(self) -> None:
        self.underruns += 1

    def count_error(self, kind: str) -> None:
        self.errors.append(kind)

    def observe_tts_sentence(self, audio_seconds: float, wall_seconds: float) -> None:
        pass

    def count_session_started(self) -> None:
        pass

    async def on_push_frame(self, data: FramePushed):
        if not data.first_push:
            return
        if isinstance(data.frame, UserStartedSpeakingFrame):
            self.user_turn_started_at.append(data.timestamp / 1e9)
        elif isinstance(data.frame, BotStartedSpeakingFrame):
            self.bot_started_at.append(data.timestamp / 1e9)
        elif isinstance(data.frame, TranscriptionFrame) and data.frame.result is not None:
            self.transcripts.append(data.frame.result)
