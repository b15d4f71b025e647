"""The live conversations of this process, against the capacity its shared engines are sized for."""

import threading
import time

from loguru import logger

from agent.config import Settings
from agent.conversation import Conversation

LLM_TOKENS_PER_SESSION = 2048  # context + reply a conversation may hold in the LLM's KV cache


def session_capacity(settings: Settings) -> int:
    """Conversations this process takes: MAX_SESSIONS, unless an engine budget allows fewer.

    Past the LLM's KV cache (LLM_KV_CACHE_TOKENS / 2048 per conversation) requests would queue
    for cache pages; past Orpheus' batch (TTS_MAX_STREAMS) speech would fall behind real time.
    """
    limits = {
        "MAX_SESSIONS": settings.max_sessions,
        "LLM_KV_CACHE_TOKENS": max(1, settings.llm_kv_cache_tokens // LLM_TOKENS_PER_SESSION),
    }
    if settings.tts_engine == "orpheus":
        limits["TTS_MAX_STREAMS"] = settings.tts_max_streams
    binding = min(limits, key=limits.get)
    if binding != "MAX_SESSIONS":
        logger.warning(f"capacity {limits[binding]} conversations (set by {binding}), below MAX_SESSIONS")
    return limits[binding]


class SessionRegistry:
    """Reserve a slot before building a conversation, release it when the conversation ends.

    Conversations run on several threads (LiveKit's THREAD executor) and event loops, so every
    change happens under a lock. `load` is what LiveKit sees: at 1.0 it stops dispatching here.
    """

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.draining = False  # shutting down: no new conversation, and LiveKit sees this one as full
        self.drain_deadline = 0.0  # time.monotonic() by which every conversation must have ended
        self._sessions: dict[str, Conversation | None] = {}
        self._lock = threading.Lock()

    def reserve(self, key: str) -> bool:
        with self._lock:
            if self.draining or len(self._sessions) >= self.capacity or key in self._sessions:
                return False
            self._sessions[key] = None
            return True

    def attach(self, key: str, conversation: Conversation) -> None:
        with self._lock:
            self._sessions[key] = conversation

    def release(self, key: str) -> None:
        with self._lock:
            self._sessions.pop(key, None)

    def start_draining(self, grace_secs: float) -> None:
        self.drain_deadline = time.monotonic() + grace_secs
        self.draining = True

    def snapshot(self) -> dict[str, Conversation | None]:
        """The conversations now, by key (None while one is still being built)."""
        with self._lock:
            return dict(self._sessions)

    def get(self, key: str) -> Conversation | None:
        with self._lock:
            return self._sessions.get(key)

    def __contains__(self, key: str) -> bool:
        return key in self._sessions

    @property
    def active(self) -> int:
        return len(self._sessions)

    @property
    def full(self) -> bool:
        return self.draining or len(self._sessions) >= self.capacity

    @property
    def load(self) -> float:
        return 1.0 if self.draining else min(1.0, len(self._sessions) / self.capacity)
