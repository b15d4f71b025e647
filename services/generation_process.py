"""Continuous batching in a child process: the LLM's step loop with a GIL of its own.

torch lets go of the GIL around each kernel and takes it back after, hundreds of times per decode
step. In the agent's process the conversations' event loops (live audio, VAD, WebRTC) hold it in
between, and every take-back waits behind them: four LiveKit rooms slowed the first words of four
replies from ~0.5 s (the same requests, engine alone) to 1-2.5 s, with the CPUs a quarter idle. In
a process of its own the step loop waits for nobody.

`GeneratorProcess` has `ContinuousBatchGenerator`'s interface (`stream`, `finish`, `cancel`,
`in_flight`, `stats`, `close`) and runs a real one in the child, built there by a picklable
callable. The parent keeps the bookkeeping (stats, the streams' queues); the child keeps the
model and the batch. Messages are pickled tuples over two pipes:

    parent → child   ("add", request_id, prompt_ids, max_new_tokens) | ("cancel", request_id)
                     | ("finish", request_id) | ("close",)
    child → parent   ("ready", None, None) | ("tokens", request_id, [ids])
                     | ("finished", request_id, None) | ("failed", request_id, error text)

multiprocessing's Connection frames them; a fresh interpreter (`python -m`, not multiprocessing's
spawn) is started so the child never re-imports the parent's `__main__`, and with an environment
the parent chooses (no secrets).
"""

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from multiprocessing.connection import Connection

from services.batched_generation import ContinuousBatchGenerator, GenerationError, GenerationStats, RequestOutputs

READY_SECS = 600.0  # loading a large model from disk in the child


class GeneratorProcess:
    """A `ContinuousBatchGenerator` in a child process, streamed to any event loop here."""

    def __init__(
        self,
        build: Callable[[], ContinuousBatchGenerator],
        *,
        name: str = "generator",
        env: dict[str, str] | None = None,
        secrets: dict[str, str] | None = None,
    ):
        """`build` (picklable: a module-level function or a partial of one) makes the generator in
        the child. `secrets` (an HF token) reach the child through the pipe, never its environment."""
        self.name = name
        self.stats = GenerationStats()
        self._active: dict[str, RequestOutputs] = {}
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._exited: str | None = None  # why the child is gone, once it is
        to_child_read, to_child_write = os.pipe()
        from_child_read, from_child_write = os.pipe()
        self._process = subprocess.Popen(
            [sys.executable, "-m", "services.generation_process",
             "--read-fd", str(to_child_read), "--write-fd", str(from_child_write)],  # fmt: skip
            pass_fds=(to_child_read, from_child_write),
            env=env,
        )
        os.close(to_child_read)
        os.close(from_child_write)
        self._to_child = Connection(to_child_write, readable=False)
        self._from_child = Connection(from_child_read, writable=False)
        self._send((build, secrets or {}))
        if not self._from_child.poll(READY_SECS):
            self._process.kill()
            raise RuntimeError(f"{name}: the generation process was not ready within {READY_SECS:.0f} s")
        try:
            kind, _, detail = self._from_child.recv()
        except EOFError:
            kind, detail = "failed", f"exit code {self._process.wait()}"
        if kind != "ready":
            self._process.wait()
            raise RuntimeError(f"{name}: the generation process failed to start: {detail}")
        threading.Thread(target=self._read, name=f"{name}-from-process", daemon=True).start()

    async def stream(
        self, prompt_ids: list[int], *, request_id: str | None = None, max_new_tokens: int | None = None
    ) -> AsyncIterator[list[int]]:
        """Generate after `prompt_ids`, yielding the new token ids of each step."""
        request_id = request_id or f"{self.name}-{uuid.uuid4().hex[:12]}"
        if self._exited is not None:
            raise GenerationError(f"request {request_id} failed: {self._exited}")
        outputs = RequestOutputs(asyncio.get_running_loop())
        with self._lock:
            self._active[request_id] = outputs
            self.stats.started += 1
        self._send(("add", request_id, list(prompt_ids), max_new_tokens))
        finished = False
        try:
            while True:
                kind, payload = await outputs.queue.get()
                if kind == "tokens" and not outputs.ended:
                    yield payload
                    continue
                # The end: the child's ("finished", "failed"), or cancel()/finish() from elsewhere,
                # which counted it. Whichever takes the request out of `_active` counts it, once.
                finished = True
                with self._lock:
                    ends_here = self._active.pop(request_id, None) is not None
                    if ends_here and kind == "finished":
                        self.stats.finished += 1
                    elif ends_here and kind == "failed":
                        self.stats.failed += 1
                if ends_here and kind == "failed":
                    raise GenerationError(f"request {request_id} failed: {payload}")
                return
        finally:
            if not finished:
                self.cancel(request_id)
            with self._lock:
                self._active.pop(request_id, None)

    def finish(self, request_id: str) -> None:
        """End a request early because its caller has all it wants (counted as finished, not cancelled)."""
        self._send(("finish", request_id))
        with self._lock:
            outputs = self._active.pop(request_id, None)
            if outputs is not None:
                outputs.ended = True
                self.stats.finished += 1

    def cancel(self, request_id: str) -> None:
        """Stop a request inside the batch and end its stream at once (idempotent)."""
        self._send(("cancel", request_id))
        with self._lock:
            outputs = self._active.pop(request_id, None)
            if outputs is not None:
                outputs.ended = True
                self.stats.cancelled += 1
        if outputs is not None:
            outputs.put(("cancelled", None))  # wake the stream

    @property
    def in_flight(self) -> int:
        return len(self._active)

    @property
    def failure(self) -> str | None:
        """Why no request can be served any more (the child exited), or None."""
        return self._exited

    @property
    def pid(self) -> int:
        return self._process.pid

    def close(self) -> None:
        self._send(("close",))
        try:
            self._process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()

    def _send(self, message) -> None:
        if self._exited is not None:
            return  # nobody to tell; stream() reports why
        with self._send_lock:
            try:
                self._to_child.send(message)
            except OSError:  # the child is gone; _read() ends every stream with the reason
                pass

    def _read(self) -> None:
        """The child's outputs, each to the loop of the conversation that asked (a thread of its own)."""
        while True:
            try:
                kind, request_id, payload = self._from_child.recv()
            except (EOFError, OSError):
                break
            # The request stays active until its stream reads how it ended: a cancel in between
            # (a barge-in just as the child finished) is then counted, once, as a cancel.
            with self._lock:
                outputs = self._active.get(request_id)
            if outputs is not None and not outputs.put((kind, payload)):  # its loop has closed
                self.cancel(request_id)
        code = self._process.wait()
        self._exited = f"the generation process exited (code {code})"
        with self._lock:
            orphans = list(self._active.values())
        for outputs in orphans:  # each stream takes itself out of `_active` as it reads this
            outputs.put(("failed", self._exited))


def _serve(commands: Connection, outputs: Connection) -> None:
    """The child: build the generator, then run requests until told to close or the parent is gone."""
    build, secrets = commands.recv()
    try:
        os.environ.update(secrets)  # for the load only (a gated model on the hub)
        generator = build()
    except BaseException as e:
        outputs.send(("failed", None, f"{type(e).__name__}: {e}"))
        raise
    finally:
        for name in secrets:
            os.environ.pop(name, None)
    loop = asyncio.new_event_loop()
    send_lock = threading.Lock()

    def send(message) -> None:
        with send_lock:
            outputs.send(message)

    async def run(request_id: str, prompt_ids: list[int], max_new_tokens: int | None) -> None:
        try:
            tokens = generator.stream(prompt_ids, request_id=request_id, max_new_tokens=max_new_tokens)
            async with aclosing(tokens):
                async for new in tokens:
                    send(("tokens", request_id, new))
        except GenerationError as e:
            send(("failed", request_id, str(e)))
            return
        send(("finished", request_id, None))  # the parent drops it if it had cancelled or finished it

    def read_commands() -> None:
        while True:
            try:
                command = commands.recv()
            except (EOFError, OSError):  # the parent is gone
                break
            if command[0] == "add":
                loop.call_soon_threadsafe(lambda c=command: loop.create_task(run(*c[1:])))
            elif command[0] == "cancel":
                generator.cancel(command[1])
            elif command[0] == "finish":
                generator.finish(command[1])
            else:  # "close"
                break
        loop.call_soon_threadsafe(loop.stop)

    threading.Thread(target=read_commands, name="commands", daemon=True).start()
    send(("ready", None, None))
    loop.run_forever()
    generator.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="The child of GeneratorProcess; not for direct use.")
    parser.add_argument("--read-fd", type=int, required=True)
    parser.add_argument("--write-fd", type=int, required=True)
    args = parser.parse_args()
    # A Ctrl-C or SIGTERM for the agent's process group is the agent's to handle: it drains, and
    # the replies it lets finish still need this process. It ends when the agent closes it or the
    # agent's end of the pipe closes (the agent exited, however it exited).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _serve(Connection(args.read_fd, writable=False), Connection(args.write_fd, readable=False))
    # The generation threads are daemons and the batch is stopped; nothing is left to flush.
    os._exit(0)
