"""Built-in tools the LLM may be given (TOOLS_END_CALL, TOOLS_TRANSFER_CALL): ending and handing on the call."""

import asyncio
import time
from loguru import logger
from pipecat.adapters.llm.schemas.function_schema import FunctionSchema
from pipecat.frames.frames import FunctionCallResultProperties, TTSSpeakFrame
from pipecat.services.llm_service import FunctionCallParams

from agent.config import Settings

GOODBYE_SECS = 30.0  # longest wait for the goodbye to be spoken before the call ends anyway

END_CALL = FunctionSchema(
    name="end_call",
    # Worded so that Qwen2.5-Coder-0.5B calls it on "Thank you, that's all, goodbye." (other
    # wordings made it just say "Goodbye."), and still answers a question itself.
    description="When the user says goodbye or that they need nothing more, call this instead of replying: it says goodbye and hangs up.",
    properties={},
    required=[],
)
TRANSFER_CALL = FunctionSchema(
    name="transfer_call",
    description="Transfer the caller to a human. Call this when the user asks for a person, an operator or an agent.",
    properties={},
    required=[],
)


def add_call_tools(conversation, settings: Settings) -> None:
    """Give `conversation` (agent.conversation.Conversation, which calls this) the enabled built-ins."""
    if settings.tools_end_call:
        conversation.add_tool(END_CALL, end_call_handler(conversation, settings.goodbye))
    if settings.tools_transfer_call:
        conversation.add_tool(TRANSFER_CALL, transfer_call_handler(conversation))


def end_call_handler(conversation, goodbye: str):
    async def end_call(params: FunctionCallParams) -> None:
        # The goodbye is said here, not left to the model (a small one calls end_call again
        # instead); the conversation, and with it the call, room or socket, ends once it is spoken.
        logger.info("the agent ends the call")
        queued_at = time.monotonic()
        await params.llm.push_frame(TTSSpeakFrame(goodbye))
        ending = asyncio.create_task(conversation.end_after_speech_since(queued_at, GOODBYE_SECS, "the agent ended the call"))
        conversation.background_tasks.add(ending)
        ending.add_done_callback(conversation.background_tasks.discard)
        await params.result_callback({"status": "ended"}, properties=FunctionCallResultProperties(run_llm=False))

    return end_call


def transfer_call_handler(conversation):
    async def transfer_call(params: FunctionCallParams) -> None:
        transfer = getattr(conversation.transport, "transfer_call", None)
        if transfer is None:
            await params.result_callback({"error": "this call cannot be transferred (not a phone call)"})
            return
        try:
            await transfer()
        except ValueError as e:
            await params.result_callback({"error": str(e)})
            return
        await params.result_callback({"status": "transferring the caller now"})

    return transfer_call
