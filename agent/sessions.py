"""The live conversations of this process, against the capacity its shared engines are sized for."""

import threading

from agent.pipeline import Conversation


class SessionRegistry:
    """Reserve a slot before building a conversation, release it when the conversation ends.

    Conversations run on several threads (LiveKit's THREAD executor) and event loops, so every
    change happens under a lock. `load` is what LiveKit sees: at 1.0 it stops dispatching here.
    """

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._sessions: dict[str, Conversation | None] = {}
        self._lock = threading.Lock()

    def reserve(self, key: str) -> bool:
        with self._lock:
            if len(self._sessions) >= self.capacity or key in self._sessions:
                return False
            self._sessions[key] = None
            return True

    def attach(self, key: str, conversation: Conversation) -> None:
        with self._lock:
            self._sessions[key] = conversation

    def release(self, key: str) -> None:
        with self._lock:
            self._sessions.pop(key, None)

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
        return len(self._sessions) >= self.capacity

    @property
    def load(self) -> float:
        return min(1.0, len(self._sessions) / self.capacity)
