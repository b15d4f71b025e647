"""The shared dynamic batcher: requests from any event loop → one batched call on a worker thread → results back."""

import asyncio
import queue
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

Item = TypeVar("Item")
Result = TypeVar("Result")


@dataclass
class BatcherStats:
    """Lifetime counts; read by tests, benchmarks and metrics."""

    batches: int = 0
    items: int = 0
    dropped: int = 0  # submitted, then cancelled before their batch ran
    largest_batch: int = 0
    batch_sizes: dict[int, int] = field(default_factory=dict)  # size → how many batches had it


@dataclass
class _Pending:
    item: Any
    key: Hashable
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    cancelled: bool = False  # set from the submitter's loop; read by the worker thread


class DynamicBatcher(Generic[Item, Result]):
    """Runs `run_batch(items) -> results` on one thread, on as many queued items as arrive together.

    The worker takes the first queued item, waits up to `max_wait_ms` for more (fewer if
    `max_batch` arrive sooner), and runs the items that share a `key` (e.g. a tensor shape) as
    one call. Results go back to each caller's own event loop, so conversations on different
    threads share one model. A caller that stops waiting (cancelled, e.g. on barge-in) has its
    still-queued items dropped before they cost compute.

    Written here because the libraries that do this (Baseten's `batched`, Ray Serve) bring a
    server framework along; this is the one piece we need.
    """

    def __init__(
        self,
        run_batch: Callable[[list[Item]], list[Result]],
        *,
        max_batch: int = 16,
        max_wait_ms: float = 2.0,
        key: Callable[[Item], Hashable] = lambda item: None,
        name: str = "batcher",
    ):
        self._run_batch = run_batch
        self.max_batch = max_batch
        self.max_wait = max_wait_ms / 1000
        self._key = key
        self.stats = BatcherStats()
        self._queue: queue.Queue[_Pending | None] = queue.Queue()
        self._held: list[_Pending] = []  # taken from the queue but left for a later batch (other key)
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    @property
    def queue_depth(self) -> int:
        return self._queue.qsize() + len(self._held)

    async def submit(self, item: Item) -> Result:
        """Queue `item` and wait for its result (exceptions of its batch are raised here)."""
        loop = asyncio.get_running_loop()
        pending = _Pending(item, self._key(item), loop.create_future(), loop)
        self._queue.put(pending)
        try:
            return await pending.future
        except asyncio.CancelledError:
            pending.cancelled = True
            raise

    def _work(self) -> None:
        while True:
            batch = self._collect()
            if batch is None:
                return
            live = [p for p in batch if not p.cancelled]
            self.stats.dropped += len(batch) - len(live)
            if not live:
                continue
            try:
                results = self._run_batch([p.item for p in live])
            except Exception as error:  # fails this batch's callers only; the worker goes on
                for p in live:
                    p.loop.call_soon_threadsafe(_settle, p.future, None, error)
                continue
            self.stats.batches += 1
            self.stats.items += len(live)
            self.stats.largest_batch = max(self.stats.largest_batch, len(live))
            self.stats.batch_sizes[len(live)] = self.stats.batch_sizes.get(len(live), 0) + 1
            for p, result in zip(live, results, strict=True):
                try:
                    p.loop.call_soon_threadsafe(_settle, p.future, result, None)
                except RuntimeError:  # that caller's loop has closed: nobody is waiting
                    pass

    def _collect(self) -> list[_Pending] | None:
        """Block for one item, then gather items of the same key until full or timed out."""
        first = self._held.pop(0) if self._held else self._queue.get()
        if first is None:
            return None
        batch, other = [first], []
        for p in self._held:  # items of this key taken earlier
            (batch if p.key == first.key and len(batch) < self.max_batch else other).append(p)
        deadline = time.monotonic() + self.max_wait
        while len(batch) < self.max_batch:
            try:
                p = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if p is None:
                self._queue.put(None)  # close after this batch
                break
            (batch if p.key == first.key else other).append(p)
        self._held = other
        return batch

    def close(self) -> None:
        self._queue.put(None)


def _settle(future: asyncio.Future, result, error: BaseException | None) -> None:
    if future.done():  # the caller was cancelled meanwhile
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
