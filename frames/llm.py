"""Pipecat LLM service over the shared TransformersLLMEngine."""

import re
import time

from loguru import logger
from pipecat.frames.frames import (
    Frame,
    LLMContextFrame,
    LLMFullResponseEndFrame,
    LLMFullResponseStartFrame,
)
from pipecat.processors.aggregators.llm_context import LLMContext
from pipecat.processors.frame_processor import FrameDirection
from pipecat.services.llm_service import LLMService
from pipecat.services.settings import LLMSettings

from services.llm import TransformersLLMEngine

# Words by which a user asks for more than a sentence or two: the reply is then not capped in
# sentences (only by LLM_MAX_NEW_TOKENS).
LONG_ANSWER = re.compile(
    r"\b(story|stories|explain|describe|details?|detailed|elaborate|more|long|longer|list|steps|everything|poem|essay)\b",
    re.IGNORECASE,
)


class TransformersLLMService(LLMService):
    """Streams a reply for each context the user aggregator sends.

    Interruption cancels the task running `process_frame`; leaving the engine's stream early
    cancels the request inside the shared batch, so no tokens are spent on a reply nobody hears.
    """

    def __init__(
        self,
        engine: TransformersLLMEngine,
        *,
        system_prompt: str | None,
        max_tokens: int | None = None,
        max_sentences: int | None = None,
        context_tokens: int | None = None,
        **kwargs,
    ):
        super().__init__(
            settings=LLMSettings(
                model=engine.name,
                system_instruction=system_prompt,
                temperature=None,
                max_tokens=max_tokens or engine.max_new_tokens,
                top_p=None,
                top_k=None,
                frequency_penalty=None,
                presence_penalty=None,
                seed=None,
                filter_incomplete_user_turns=False,
                user_turn_completion_config=None,
            ),
            **kwargs,
        )
        self._engine = engine
        self._max_sentences = max_sentences or None
        self._context_tokens = context_tokens  # prompt budget: older turns are left out
        self._requests = 0  # engine requests this conversation made: numbers their ids
        self.generating = False
        self.last_output_at = 0.0  # time.monotonic() of the latest text generated

    def can_generate_metrics(self) -> bool:
        return True

    async def chat_messages(self, context: LLMContext) -> list[dict]:
        """The context as plain {role, content: str} messages for a chat template."""
        params = await self.get_llm_adapter().get_llm_invocation_params(
            context,
            system_instruction=self._settings.system_instruction,
            convert_developer_to_user=False,
        )
        messages = []
        for message in params["messages"]:
            role = message.get("role")
            if role not in ("system", "developer", "user", "assistant"):
                continue  # tool calls are not supported by the local engine yet
            content = message.get("content") or ""
            if not isinstance(content, str):  # multi-part content: keep the text parts
                content = " ".join(p.get("text", "") for p in content if isinstance(p, dict))
            messages.append({"role": "system" if role == "developer" else role, "content": content})
        return messages

    def sentences_for(self, messages: list[dict]) -> int | None:
        """The reply's sentence cap: none when the user's last words ask for a longer answer."""
        asked = next((m["content"] for m in reversed(messages) if m["role"] == "user"), "")
        return None if LONG_ANSWER.search(asked) else self._max_sentences

    async def process_frame(self, frame: Frame, direction: FrameDirection):
        await super().process_frame(frame, direction)
        if not isinstance(frame, LLMContextFrame):
            await self.push_frame(frame, direction)
            return
        await self.push_frame(LLMFullResponseStartFrame())
        await self.start_processing_metrics()
        await self.start_ttfb_metrics()
        self.generating = True
        try:
            messages = self._engine.fit(await self.chat_messages(frame.context), self._context_tokens)
            request_id = f"{self.name}-{self._requests}"
            self._requests += 1
            first = True
            async for text in self._engine.stream(
                messages,
                request_id=request_id,
                max_new_tokens=self._settings.max_tokens,
                max_sentences=self.sentences_for(messages),
            ):
                if first:
                    await self.stop_ttfb_metrics()
                    first = False
                self.last_output_at = time.monotonic()
                await self._push_llm_text(text)
        except Exception as e:  # the engine failed this request; the conversation goes on
            logger.exception(f"{self}: generation failed")
            await self.push_error(error_msg=f"LLM failed: {e}", exception=e)
        finally:
            self.generating = False
            await self.stop_processing_metrics()
            await self.push_frame(LLMFullResponseEndFrame())
