"""Past one process: two `voice-agent worker` processes behind one livekit-server, dispatched by load.

The tests run in order on one pair of workers: A (capacity 1) and B (capacity 8). A is killed in
the second test; B is drained with SIGTERM in the third.

livekit-server picks among available workers at random, weighted by load, so with both up from the
start A would get no room at all in about one run in twelve. A therefore starts alone and takes
the first room; B joins after, and every later room must go to B because A is full.
"""

import asyncio
import os
import signal
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest
from pydantic import SecretStr

from agent.config import Settings
from harness.livekit_caller import LiveKitCaller
from agent.livekit_dev_server import DEV_API_KEY, DEV_API_SECRET
from agent.transports.livekit import user_token
from harness.speech import heard_as, normalize

AGENT_NAME = "fleet-test"  # not the in-process agent's name: only these workers take these rooms
DRAIN_GRACE_SECS = 30
ROOMS = 3  # A takes one; B the rest (kept few: every idle room costs B VAD and Opus work on 2 cores)


@dataclass
class Worker:
    name: str
    process: asyncio.subprocess.Process
    log: Path

    @property
    def id(self) -> str:
        """What the worker puts in its agents' `agent.worker` attribute."""
        return f"{os.uname().nodename}:{self.process.pid}"


async def start_worker(name: str, livekit_url: str, max_sessions: int, log: Path) -> Worker:
    """A `voice-agent worker` process, returned once its models are warm and it is registered."""
    env = {
        **os.environ,
        "LIVEKIT_URL": livekit_url,
        "LIVEKIT_API_KEY": DEV_API_KEY,
        "LIVEKIT_API_SECRET": DEV_API_SECRET,
        "AGENT_NAME": AGENT_NAME,
        "MAX_SESSIONS": str(max_sessions),
        "DRAIN_GRACE_SECS": str(DRAIN_GRACE_SECS),
        "GREETING": "",
        "LLM_MAX_NEW_TOKENS": "48",
    }
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "agent", "worker", env=env, stdout=log.open("w"), stderr=asyncio.subprocess.STDOUT
    )
    worker = Worker(name, process, log)
    await until(lambda: "voice-agent worker: registered as" in log.read_text(), 180, f"worker {name} to register")
    return worker


async def until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)


@dataclass
class Fleet:
    livekit_url: str
    logs: Path
    a: Worker  # capacity 1
    b: Worker | None  # capacity 8, started by the first test
    callers: dict[str, LiveKitCaller]  # room → its caller

    async def open_room(self, room: str) -> LiveKitCaller:
        """A caller in a new room whose token dispatches the workers' agent, as /api/session's does."""
        settings = Settings(
            _env_file=None,
            livekit_url=self.livekit_url,
            livekit_api_key=DEV_API_KEY,
            livekit_api_secret=SecretStr(DEV_API_SECRET),
            agent_name=AGENT_NAME,
        )
        caller = LiveKitCaller(self.livekit_url, user_token(settings, room, identity=f"user-{room}"))
        await caller.join()
        self.callers[room] = caller
        return caller


def worker_of(caller: LiveKitCaller) -> str | None:
    agents = caller.agents()
    return agents[0].attributes.get("agent.worker") if agents else None


@pytest.fixture(scope="module")
async def fleet(livekit_url, tmp_path_factory):
    logs = tmp_path_factory.mktemp("workers")
    fleet = Fleet(livekit_url, logs, await start_worker("A", livekit_url, 1, logs / "a.log"), None, {})
    yield fleet
    for caller in fleet.callers.values():
        await caller.leave()
    for worker in (fleet.a, fleet.b):
        if worker is not None and worker.process.returncode is None:
            worker.process.kill()
            await worker.process.wait()


async def test_rooms_go_to_both_workers_and_a_full_one_gets_no_more(fleet):
    for n in range(ROOMS):
        caller = await fleet.open_room(f"fleet-{n}")
        await until(lambda: worker_of(caller) is not None, 60, f"an agent in room {n}")
        if n == 0:  # A's, the only worker; now B comes up beside the full A
            assert worker_of(caller) == fleet.a.id
            fleet.b = await start_worker("B", fleet.livekit_url, 8, fleet.logs / "b.log")
    holders = Counter(worker_of(caller) for caller in fleet.callers.values())
    assert holders[fleet.a.id] == 1, holders  # capacity 1: never more than one room
    assert holders[fleet.b.id] == ROOMS - 1, holders


async def test_a_killed_worker_loses_its_rooms_and_the_other_goes_on(fleet, say, engines):
    a_room = next(room for room, c in fleet.callers.items() if worker_of(c) == fleet.a.id)
    b_room = next(room for room, c in fleet.callers.items() if worker_of(c) == fleet.b.id)
    fleet.a.process.kill()
    await fleet.a.process.wait()
    # Its caller sees the agent leave.
    await until(lambda: worker_of(fleet.callers[a_room]) is None, 60, "the dead worker's agent to leave")
    # A new room goes to the survivor.
    caller = await fleet.open_room("fleet-after-crash")
    await until(lambda: worker_of(caller) is not None, 60, "an agent in the new room")
    assert worker_of(caller) == fleet.b.id
    # And a conversation on the survivor is undisturbed: asked now, it answers.
    b_caller = fleet.callers[b_room]
    asked = len(b_caller.messages)
    _, ended = await b_caller.speak(await say("What is the capital of France?"))
    # Generous: two worker processes with five rooms each, livekit-server and this process share
    # two cores, and the survivor's LLM has been seen to take 15 s for one sentence.
    await until(lambda: b_caller.last_voice_between(ended, float("inf")) is not None, 120, "an answer")
    await until(lambda: time.monotonic() - b_caller.last_voice_between(ended, float("inf")) > 2.5, 120, "its end")
    # The answer is right, and what was heard is that answer (tiny.en on Opus-coded speech from a
    # loaded machine mishears single words, e.g. "Paris" as "fair": judged by WER, not one word).
    reply = "".join(e["data"]["text"] for e in b_caller.messages[asked:] if e.get("type") == "bot-llm-text")
    assert "paris" in normalize(reply), reply
    spoken = (await engines.stt.transcribe(b_caller.audio(start=ended), 16000)).text
    assert heard_as(reply, spoken), (reply, spoken)


async def test_sigterm_drains_the_worker_after_the_reply_it_is_giving(fleet, say):
    b_room = next(room for room, c in fleet.callers.items() if worker_of(c) == fleet.b.id)
    caller = fleet.callers[b_room]
    asked = len(caller.messages)
    _, ended = await caller.speak(await say("Tell me a long story about a dragon and a brave knight."))
    await until(lambda: caller.first_voice_after(ended) is not None, 120, "the story to start")
    await asyncio.sleep(1.0)
    terminated = time.monotonic()
    fleet.b.process.send_signal(signal.SIGTERM)

    # No new room is taken while draining (and the other worker is gone).
    newcomer = await fleet.open_room("fleet-while-draining")
    # The process exits within the grace period, having finished the story first.
    await asyncio.wait_for(fleet.b.process.wait(), DRAIN_GRACE_SECS + 5)
    exited = time.monotonic()
    assert exited - terminated <= DRAIN_GRACE_SECS + 1, f"exited {exited - terminated:.1f}s after SIGTERM"
    assert worker_of(newcomer) is None, "a draining worker took a new room"
    for room, c in fleet.callers.items():
        await until(lambda: worker_of(c) is None, 10, f"the agent to leave {room}")

    # The whole story was spoken: every word the LLM generated for it was played.
    events = caller.messages[asked:]
    generated = "".join(e["data"]["text"] for e in events if e.get("type") == "bot-llm-text")
    spoken = " ".join(e["data"]["text"] for e in events if e.get("type") == "bot-tts-text")
    assert generated and normalize(spoken) == normalize(generated), (generated, spoken)
    assert caller.last_voice_between(terminated, float("inf")) is not None, "the story stopped at SIGTERM"
