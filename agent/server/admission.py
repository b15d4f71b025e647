"""The one way into a conversation for every transport: authenticate, check readiness and capacity, reserve → run → release."""

from collections.abc import Callable
from dataclasses import dataclass

from fastapi import HTTPException

from agent.config import Settings
from agent.conversation import Conversation, run_conversation
from agent.engines import Engines
from agent.server.auth import check_api_key
from agent.server.metrics import AgentMetrics
from agent.server.sessions import SessionRegistry

RETRY_AFTER_SECS = 5


@dataclass
class Admission:
    """Shared by the transports of one process: they share the engines, so they share the capacity.

    A transport calls `admit` (refusals are HTTPExceptions: 401, or 503 with Retry-After), then
    `serve` with a builder for its conversation; the slot is freed however the conversation ends.
    """

    settings: Settings
    sessions: SessionRegistry
    metrics: AgentMetrics
    engines_of: Callable[[], Engines | None]

    def ready_engines(self) -> Engines:
        engines = self.engines_of()
        if engines is None or not engines.ready:
            raise HTTPException(503, "models are loading", headers={"Retry-After": str(RETRY_AFTER_SECS)})
        return engines

    def check(self, transport: str, authorization: str | None, *, authenticated: bool = False) -> Engines:
        """Refuse now what `admit` would refuse, without taking a slot (e.g. before minting a LiveKit token).

        `authenticated`: the transport has checked the caller its own way instead of by API key
        (SIP: the source address and digest credentials, as carriers' trunks expect).
        """
        if not authenticated:
            check_api_key(self.settings, authorization)
        engines = self.ready_engines()
        if self.sessions.full:
            self.refuse(transport)
        return engines

    def admit(self, transport: str, key: str, authorization: str | None, *, authenticated: bool = False) -> Engines:
        """Reserve the slot `key` for a conversation that `serve` will run."""
        engines = self.check(transport, authorization, authenticated=authenticated)
        if not self.sessions.reserve(key):
            self.refuse(transport)
        return engines

    def refuse(self, transport: str, reason: str | None = None) -> None:
        """503 with Retry-After, by default because every conversation slot is taken; running ones are untouched."""
        self.metrics.sessions_refused.labels(transport=transport).inc()
        raise HTTPException(
            503,
            reason or f"all {self.sessions.capacity} conversations of this agent are in use",
            headers={"Retry-After": str(RETRY_AFTER_SECS)},
        )

    async def serve(self, key: str, build: Callable[[], Conversation]) -> None:
        """Build and run the conversation of reserved slot `key` until it ends; then free the slot."""
        try:
            conversation = build()
            self.sessions.attach(key, conversation)
            if not await run_conversation(conversation, key):
                self.metrics.count_error("conversation")
        except Exception:
            self.metrics.count_error("conversation")
            raise
        finally:
            self.sessions.release(key)
