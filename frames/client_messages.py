"""Which RTVI messages a client may send a conversation: the few our clients use, text no longer than a spoken turn."""

from pipecat.processors.frameworks.rtvi import RTVIProcessor
import pipecat.processors.frameworks.rtvi.models as RTVI

from frames.rtvi_events import LanguageTaggingRTVIObserver

# Pipecat's RTVI processor serves every client message type: text into the shared LLM at any
# length, raw audio at any rate, files, function-call results. Our clients (the browser demo,
# the WebRTC and WebSocket callers) only announce themselves, hang up, or type a line.
ACCEPTED_TYPES = frozenset({"client-ready", "disconnect-bot", "send-text"})
MAX_SEND_TEXT_CHARS = 600  # about a minute of speech: a typed turn is no longer than a spoken one


class ClientMessageGuard(RTVIProcessor):
    """Pipecat's RTVIProcessor, refusing (with an RTVI error response) what `ACCEPTED_TYPES` leaves out
    and `send-text` over `MAX_SEND_TEXT_CHARS`: one client cannot flood the LLM every conversation shares."""

    def create_rtvi_observer(self, *, params=None, **kwargs):
        return LanguageTaggingRTVIObserver(self, params=params, **kwargs)

    # Overrides a protected hook (see frames/pipecat_internals.py): the one place messages are dispatched.
    async def _handle_message(self, message: RTVI.Message, user_id: str | None = None):
        if message.type not in ACCEPTED_TYPES:
            await self._send_error_response(message.id, f"message type {message.type!r} is not accepted")
            return
        if message.type == "send-text":
            content = message.data.get("content") if isinstance(message.data, dict) else None
            if isinstance(content, str) and len(content) > MAX_SEND_TEXT_CHARS:
                await self._send_error_response(
                    message.id, f"text of {len(content)} characters refused: at most {MAX_SEND_TEXT_CHARS}"
                )
                return
        await super()._handle_message(message, user_id)
