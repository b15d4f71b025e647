"""The one interface every engine offers the agent: warm up, report work in flight, close."""

from typing import Protocol, runtime_checkable


@runtime_checkable
class Engine(Protocol):
    """What the agent needs of an engine, whatever it runs (Whisper, an LLM, Piper, Orpheus).

    An engine is built once per process from values the agent's `Settings` hold (engines have no
    defaults of their own for those), shared by every conversation, and safe to call from any
    event loop. Metrics and capacity read `in_flight`; start-up calls `warmup` before reporting
    healthy; shutdown calls `close`.
    """

    name: str  # what /health reports: a model or voice name, never a filesystem path

    @property
    def in_flight(self) -> int:
        """Requests accepted and not finished: queued or running."""
        ...

    async def warmup(self) -> None:
        """Run once so the first user does not pay for kernel compilation and allocation."""
        ...

    def close(self) -> None: ...
