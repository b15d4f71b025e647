"""Pipecat LLM service over the shared TransformersLLMEngine."""

import json
import re
import time
import uuid
from contextlib import aclosing

from loguru import logger
from pipecat.frames.frames import (
    Frame,
    FunctionCallFromLLM,
    LLMContextFrame,
    LLMFullResponseEndFrame,
    LLMFullResponseStartFrame,
)
from pipecat.processors.aggregators.llm_context import LLMContext
from pipecat.processors.frame_processor import FrameDirection
from pipecat.services.llm_service import LLMService
from pipecat.services.settings import LLMSettings

from frames.held_reply import HeldReplyTextFrame
from frames.pipecat_internals import holds_its_reply
from services.languages import LANGUAGE_NAMES, ConversationLanguage
from services.llm import TransformersLLMEngine
from services.tool_calls import ToolCall, spoken_json

# Words by which a user asks for more than a sentence or two: the reply is then not capped in
# sentences (only by LLM_MAX_NEW_TOKENS).
LONG_ANSWER = re.compile(
    r"\b(story|stories|explain|describe|details?|detailed|elaborate|more|long|longer|list|steps|everything|poem|essay)\b",
    re.IGNORECASE,
)


# Said to the model whenever it is given tools: small models (Qwen2.5-Coder-0.5B) otherwise call
# a made-up function for a plain question ("get_capital").
TOOL_GUIDANCE = "Answer questions yourself; call a function only to do what its description says."


class TransformersLLMService(LLMService):
    """Streams a reply for each context the user aggregator sends.

    Interruption cancels the task running `process_frame`; leaving the engine's stream early
    cancels the request inside the shared batch, so no tokens are spent on a reply nobody hears.

    While Pipecat's SpeculationGate holds a reply (its turn may not be over), a copy of the text
    goes past the gate as HeldReplyTextFrames, so that the voice can synthesize the reply's first
    words meanwhile (frames/held_reply.py).
    """

    def __init__(
        self,
        engine: TransformersLLMEngine,
        *,
        system_prompt: str | None,
        max_tokens: int | None = None,
        max_sentences: int | None = None,
        context_tokens: int | None = None,
        language: ConversationLanguage | None = None,
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
        self._language = language  # a multilingual agent: the reply is in the user's language
        self.requests = 0  # engine requests this conversation made: numbers their ids
        self.generating = False
        self.last_output_at = 0.0  # time.monotonic() of the latest text generated

    def can_generate_metrics(self) -> bool:
        return True

    async def chat_messages(self, context: LLMContext) -> tuple[list[dict], list[dict] | None]:
        """The context as chat-template messages, and its tools as JSON schemas (None when the
        context has none or the model's template cannot render them)."""
        params = await self.get_llm_adapter().get_llm_invocation_params(
            context,
            system_instruction=self._settings.system_instruction,
            convert_developer_to_user=False,
        )
        tools = params.get("tools")
        tools = list(tools) if isinstance(tools, list) and tools and self._engine.knows_tools else None
        # A call a barge-in cancelled is left out, call and result: the user moved on, and a
        # small model shown it books again what the user has just said to forget. (Pipecat 1.14's
        # assistant aggregator writes "CANCELLED" as such a call's result.)
        cancelled = {m.get("tool_call_id") for m in params["messages"] if m.get("role") == "tool" and m.get("content") == "CANCELLED"}
        messages = []
        for message in params["messages"]:
            role = message.get("role")
            if role == "tool" and message.get("tool_call_id") in cancelled:
                continue
            content = message.get("content") or ""
            if not isinstance(content, str):  # multi-part content: keep the text parts
                content = " ".join(p.get("text", "") for p in content if isinstance(p, dict))
            if role == "user" and messages and messages[-1]["role"] == "user":
                # A turn split at a pause, its reply withdrawn: one message, as it was said. Shown
                # two, the 0.5B model answered the last alone ("Goodbye!" instead of end_call).
                messages[-1] = {"role": "user", "content": f"{messages[-1]['content']} {content}".strip()}
            elif role in ("system", "developer", "user"):
                messages.append({"role": "system" if role == "developer" else role, "content": content})
            elif role == "assistant" and message.get("tool_calls"):
                # Chat templates take a call's arguments as a mapping, not OpenAI's JSON string.
                calls = [template_tool_call(c["function"]) for c in message["tool_calls"] if c.get("id") not in cancelled]
                if tools and calls:
                    messages.append({"role": "assistant", "content": content, "tool_calls": calls})
            elif role == "assistant":
                messages.append({"role": "assistant", "content": content})
            elif role == "tool" and tools:
                messages.append({"role": "tool", "content": content})
        if tools:
            add_system_note(messages, TOOL_GUIDANCE)
        if self._language is not None:
            name = LANGUAGE_NAMES.get(self._language.current, self._language.current)
            add_system_note(messages, f"The user speaks {name}. Always answer in {name}.")
        return messages, tools

    def sentences_for(self, messages: list[dict]) -> int | None:
        """The reply's sentence cap: none when the user's last words ask for a longer answer."""
        asked = next((m["content"] for m in reversed(messages) if m["role"] == "user"), "")
        return None if LONG_ANSWER.search(asked) else self._max_sentences

    async def _reply(self, messages: list[dict], tools: list[dict] | None) -> list[ToolCall]:
        """Stream one reply's text downstream; return the calls the model made."""
        request_id = f"{self.name}-{self.requests}"
        self.requests += 1
        calls: list[ToolCall] = []
        outputs = self._engine.stream(
            messages,
            tools=tools,
            request_id=request_id,
            max_new_tokens=self._settings.max_tokens,
            max_sentences=self.sentences_for(messages),
        )
        # A barge-in may cancel this task while it pushes text: the stream is closed then, and its
        # request leaves the batch at once, not whenever the garbage collector finds it.
        async with aclosing(outputs):
            async for output in outputs:
                await self.stop_ttfb_metrics()  # the first output ends it; later calls do nothing
                self.last_output_at = time.monotonic()
                if isinstance(output, ToolCall):
                    calls.append(output)
                else:
                    await self._push_llm_text(output)
                    if holds_its_reply(self):  # the voice may say its first words meanwhile
                        await self.push_frame(HeldReplyTextFrame(reply_id=request_id, text=output))
        if holds_its_reply(self):
            await self.push_frame(HeldReplyTextFrame(reply_id=request_id, text="", reply_ended=True))
        return calls

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
            messages, tools = await self.chat_messages(frame.context)
            messages = self._engine.fit(messages, self._context_tokens, tools)
            calls = await self._reply(messages, tools)
            if calls and all(call_key(c) in answered_calls(messages) for c in calls):
                # Small models (Qwen2.5-Coder-0.5B) may call again what they have the result of,
                # for ever: the user hears the results instead.
                logger.debug(f"{self}: the model repeated {[c.name for c in calls]}; saying their results")
                await self._push_llm_text(spoken_results(messages))
                calls = []
            if calls:
                # Pipecat runs the registered handlers, puts each call and its result in the
                # context, and asks for the reply that follows (a new LLMContextFrame).
                logger.debug(f"{self}: the model called {[c.name for c in calls]}")
                await self.run_function_calls(
                    [
                        FunctionCallFromLLM(
                            function_name=call.name,
                            tool_call_id=f"call_{uuid.uuid4().hex[:12]}",
                            arguments=call.arguments,
                            context=frame.context,
                        )
                        for call in calls
                    ]
                )
        except Exception as e:  # the engine failed this request; the conversation goes on
            logger.exception(f"{self}: generation failed")
            await self.push_error(error_msg=f"LLM failed: {e}", exception=e)
        finally:
            self.generating = False
            await self.stop_processing_metrics()
            await self.push_frame(LLMFullResponseEndFrame())


def add_system_note(messages: list[dict], note: str) -> None:
    """`note` at the end of the system prompt (the start of the chat when there is none)."""
    if messages and messages[0]["role"] == "system":
        messages[0] = {"role": "system", "content": f"{messages[0]['content']}\n\n{note}"}
    else:
        messages.insert(0, {"role": "system", "content": note})


def template_tool_call(function: dict) -> dict:
    """OpenAI's {"name", "arguments": "<json>"} as chat templates render a call."""
    arguments = function.get("arguments") or {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            arguments = {}
    return {"type": "function", "function": {"name": function.get("name", ""), "arguments": arguments}}


def call_key(call: ToolCall) -> str:
    return json.dumps([call.name, call.arguments], sort_keys=True)


def answered_calls(messages: list[dict]) -> set[str]:
    """The calls made since the user last spoke (chat-template form), as `call_key`s."""
    keys: set[str] = set()
    for message in reversed(messages):
        if message["role"] == "user":
            break
        for call in message.get("tool_calls") or []:
            keys.add(call_key(ToolCall(call["function"]["name"], call["function"]["arguments"])))
    return keys


def spoken_results(messages: list[dict]) -> str:
    """The tool results since the user last spoke, as words: "booked yes, confirmation code blue harbor."."""
    results = []
    for message in reversed(messages):
        if message["role"] == "user":
            break
        if message["role"] == "tool":
            text = spoken_json(message["content"]).replace("`", "").replace("True", "yes").replace("False", "no")
            results.insert(0, text.strip().rstrip(".") + ".")
    return " ".join(results)
