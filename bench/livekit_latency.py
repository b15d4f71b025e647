"""LiveKit latency benchmark: a scripted participant talks to the in-process agent via a local livekit-server."""

import argparse
import asyncio
import datetime
import os
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import asynccontextmanager
from importlib.metadata import version
from pathlib import Path

import httpx
import numpy as np
import uvicorn
from loguru import logger
from pydantic import SecretStr

from agent.config import Settings
from agent.engines import load_engines_warm
from harness.livekit_caller import FRAME_SAMPLES, SAMPLE_RATE, LiveKitCaller
from agent.livekit_dev_server import DEV_API_KEY, DEV_API_SECRET, LiveKitServerProcess, free_port
from agent.conversation import Conversation
from agent.app import create_app
from bench.latency import (
    ANSWER_CAP_SECS,
    POLL_SECS,
    QUESTIONS,
    QUIET_SECS,
    command_line,
    machine_info,
    print_table,
    summary,
    write_json,
)
from harness.observe import TurnLog
from harness.speech import speak_16k

VOICE_RMS = 300.0  # PCM16 RMS above which a 20 ms frame (ours) or a received chunk (the agent's) counts as voice
REPLY_CAP_SECS = 45.0  # longest wait for a reply that started to go quiet
STARTUP_SECS = 30.0  # for the worker to register, the agent to join the room, ...
SHUTDOWN_SECS = 15.0
ROWS = ["participant_v2v", "agent_v2v", "turn_ended", "stt", "llm_first_token", "tts_first_audio"]

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--turns", type=int, default=10, help="user turns in the conversation")
parser.add_argument(
    "--out", type=Path, default=None, help="JSON results (default bench/results/livekit-latency-PROFILE.json)"
)


def trailing_silence(pcm: bytes) -> float:
    """Seconds after the last voiced 20 ms frame of `pcm` (PCM16 mono at 16 kHz)."""
    samples = np.frombuffer(pcm, dtype=np.int16).astype(np.float32)
    frames = np.pad(samples, (0, -samples.size % FRAME_SAMPLES)).reshape(-1, FRAME_SAMPLES)
    voiced = np.nonzero(np.sqrt((frames**2).mean(axis=1)) > VOICE_RMS)[0]
    if not voiced.size:
        return 0.0
    return samples.size / SAMPLE_RATE - (int(voiced[-1]) + 1) * FRAME_SAMPLES / SAMPLE_RATE


class Ear:
    """What the caller heard, as (arrival time, voiced?) — each chunk's energy computed once, not per poll."""

    def __init__(self, caller: LiveKitCaller):
        self.caller, self.at, self.voiced = caller, [], []

    def update(self) -> None:
        for chunk in self.caller.heard[len(self.at) :]:
            self.at.append(chunk.at)
            self.voiced.append(chunk.energy > VOICE_RMS)

    def first_voice_after(self, start: float) -> float | None:
        self.update()
        return next((t for t, v in zip(self.at, self.voiced) if v and t >= start), None)

    def last_voice(self) -> float | None:
        self.update()
        return next((t for t, v in zip(reversed(self.at), reversed(self.voiced)) if v), None)

    def voiced_seconds_after(self, start: float) -> float:
        self.update()
        return sum(len(c.audio) / 2 / SAMPLE_RATE for c, v in zip(self.caller.heard, self.voiced) if v and c.at >= start)


async def wait_for(condition, what: str, timeout: float = STARTUP_SECS, step: float = 0.05):
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(step)
    return value


async def converse(caller: LiveKitCaller, conversation, log: TurnLog, questions, audio, label: str = "") -> list[dict]:
    """Speak every question, each time keeping the microphone open (silence) until the reply has played out."""
    ear = Ear(caller)
    clock = getattr(conversation.worker, "_clock", None)  # the pipeline clock: monotonic_ns() - _time
    spoken = []
    stop_timeouts = []  # the user aggregator's watchdog ended a turn no stop strategy ended (after 5 s)
    conversation.user_aggregator.add_event_handler(
        "on_user_turn_stop_timeout", lambda aggregator: stop_timeouts.append(time.monotonic())
    )
    for turn, (question, pcm) in enumerate(zip(questions, audio)):
        agent_turns_before, timeouts_before = len(log.turns), len(stop_timeouts)
        started, ended = await caller.speak(pcm)
        queued = caller._source.queued_duration  # estimate of our audio still waiting to be sent
        tail = trailing_silence(pcm)
        voiced_end = ended - tail  # when the last voiced frame was sent (the Piper clip ends in silence)
        talked_over = ear.first_voice_after(started)
        talked_over = talked_over if talked_over is not None and talked_over < voiced_end else None
        while True:
            await caller.silence(POLL_SECS)
            now, first = time.monotonic(), ear.first_voice_after(voiced_end)
            if first is None and now - voiced_end >= ANSWER_CAP_SECS:
                break
            if first is not None and (now - ear.last_voice() >= QUIET_SECS or now - first >= REPLY_CAP_SECS):
                break
        agent_turns = log.turns[agent_turns_before:]
        agent = agent_turns[0] if agent_turns else None
        messages = [m for m in conversation.context.get_messages() if isinstance(m, dict)]
        users = [m.get("content") for m in messages if m.get("role") == "user"]
        replies = [m.get("content") for m in messages if m.get("role") == "assistant"]
        row = {
            "turn": turn,
            "question": question,
            "speech_started": started,
            "speech_ended": ended,  # last sample (trailing silence included) handed to the audio source
            "trailing_silence": tail,
            "voiced_end": voiced_end,
            "send_queue_at_end": queued,
            "participant_v2v": first - voiced_end if first is not None else None,
            "reply_voiced_seconds": ear.voiced_seconds_after(voiced_end) if first is not None else 0.0,
            "agent_voice_during_question": talked_over - started if talked_over is not None else None,
            "agent_turns": len(agent_turns),  # TurnLatency records added while this turn was waited on
            "agent_v2v": agent.voice_to_voice if agent else None,
            "turn_ended": agent.turn_ended if agent else None,
            "stt": agent.stt if agent else None,
            "llm_first_token": agent.llm_first_token if agent else None,
            "tts_first_audio": agent.tts_first_audio if agent else None,
            "turn_stop_timeouts": len(stop_timeouts) - timeouts_before,
            "heard": users[-1] if users else None,
            "reply": replies[-1] if replies else None,
        }
        if agent is not None and clock is not None and getattr(clock, "_time", 0):
            # The agent's view on our clock: where its VAD put the end of speech, and when it started playing.
            speech_end = clock._time / 1e9 + agent.user_speech_ended
            row["agent_speech_end_minus_voiced_end"] = speech_end - voiced_end
            if agent.voice_to_voice is not None and first is not None:
                row["heard_minus_agent_bot_started"] = first - (speech_end + agent.voice_to_voice)
        spoken.append(row)
        v2v = f"{row['participant_v2v']:.2f}s v2v" if first is not None else "NO REPLY"
        watchdog = " (turn ended by the 5 s stop watchdog)" if row["turn_stop_timeouts"] else ""
        print(f"  {label}turn {turn + 1}/{len(questions)}: {v2v} to {question!r}, heard {row['heard']!r}{watchdog}",
              flush=True)
    return spoken


async def main(args):
    settings = Settings(greeting="")  # timing starts with the user's first words
    out = args.out or Path(__file__).parent / "results" / f"livekit-latency-{settings.profile}.json"
    log_dir = Path(tempfile.mkdtemp(prefix="livekit-bench-"))
    print(f"loading engines ({settings.profile} profile) ...", flush=True)
    started = time.perf_counter()
    engines = await load_engines_warm(settings)
    load_seconds = time.perf_counter() - started
    print(f"engines loaded and warm in {load_seconds:.1f}s", flush=True)
    try:
        questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(args.turns)]
        audio = [await speak_16k(engines.tts, q) for q in questions]
        print(f"{args.turns} turns, {sum(len(a) for a in audio) / 2 / SAMPLE_RATE:.1f}s of user speech", flush=True)
        with LiveKitServerProcess(log_path=log_dir / "livekit.log") as lk:
            print(f"livekit-server at {lk.url} (log {lk.log_path})", flush=True)
            agent_settings = livekit_agent_settings(settings, lk)
            result = await run_with_agent(args, agent_settings, engines, questions, audio)
            result["livekit_versions"] = livekit_versions(lk)
        print("livekit-server stopped", flush=True)
    finally:
        engines.close()

    spoken = result.pop("spoken")
    answered = [t for t in spoken if t["participant_v2v"] is not None]
    stats = {m: summary([t[m] for t in spoken]) for m in ROWS}
    load = os.getloadavg()[0]
    run = result["run"]
    print(f"\nconversation {run['conversation_seconds']:.1f}s wall, {run['conversation_cpu_seconds']:.1f}s CPU "
          f"in this process, load average {load:.2f}")
    print(f"user turns spoken {len(spoken)}, answered {len(answered)} (agent audio heard), "
          f"{sum(t['agent_turns'] > 0 for t in spoken)} with agent-side metrics")
    print("participant_v2v = first received agent audio with RMS > "
          f"{VOICE_RMS:.0f} minus when the last voiced 20 ms frame of the question was sent")
    print("  (the question's send end, minus its trailing silence of "
          f"{np.mean([t['trailing_silence'] for t in spoken]):.2f}s on average); agent_v2v etc. are the agent's own metrics")
    if any(t["turn_stop_timeouts"] for t in spoken):
        print(f"note: {sum(t['turn_stop_timeouts'] > 0 for t in spoken)} turn(s) ended only by the 5 s stop watchdog "
              "(smart-turn judged the question unfinished): their voice-to-voice includes that wait")
    if stats["stt"]["n"] < stats["agent_v2v"]["n"]:
        print("note: pipecat drops the STT metric of a turn whose transcript took over 2 s (stt_ttfb_timeout)")
    print_table(stats, ROWS)

    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command_line("bench.livekit_latency"),
        "machine": machine_info(load, **result.pop("livekit_versions")),
        "models": {"stt": settings.stt_model, "llm": settings.llm_model, "tts": settings.tts_voice},
        "settings": agent_settings.model_dump(mode="json"),  # secrets dump as "**********"
        "run": {
            **run,
            "engine_load_seconds": load_seconds,
            "quiet_secs": QUIET_SECS,
            "answer_cap_secs": ANSWER_CAP_SECS,
            "reply_cap_secs": REPLY_CAP_SECS,
            "voice_rms": VOICE_RMS,
        },
        "definitions": {
            "participant_v2v": "first received agent audio chunk with RMS > voice_rms after the question's voiced end, "
            "minus that voiced end = speech_ended - trailing_silence (monotonic clock of this process)",
            "agent_v2v": "the agent's TurnLatency.voice_to_voice: VAD end of speech (minus stop_secs) to "
            "BotStartedSpeakingFrame, on the pipeline clock",
            "agent_speech_end_minus_voiced_end": "where the agent's VAD put the end of speech, relative to voiced_end",
            "heard_minus_agent_bot_started": "participant hearing the reply minus the agent's BotStartedSpeakingFrame",
        },
        "turns_spoken": len(spoken),
        "turns_answered": len(answered),
        "turns_with_agent_metrics": sum(t["agent_turns"] > 0 for t in spoken),
        "summary": stats,
        "turns": spoken,
        **result,
    }
    write_json(out, result)
    print(f"\nwrote {out}", flush=True)


def livekit_agent_settings(settings: Settings, lk: LiveKitServerProcess, **update) -> Settings:
    """`settings` pointed at the local livekit-server (dev keys), with the HTTP server on a free port."""
    return settings.model_copy(
        update={
            "livekit_url": lk.url,
            "livekit_api_key": DEV_API_KEY,
            "livekit_api_secret": SecretStr(DEV_API_SECRET),
            "port": free_port(),
            **update,
        }
    )


def livekit_versions(lk: LiveKitServerProcess) -> dict:
    """The LiveKit pieces a result was measured with (extra fields for machine_info)."""
    binary = subprocess.run([lk.binary, "--version"], capture_output=True, text=True)
    return {
        "livekit_rtc": version("livekit"),
        "livekit_agents": version("livekit-agents"),
        "livekit_server": binary.stdout.strip() or None,
    }


@asynccontextmanager
async def serving_agent(settings: Settings, engines):
    """The agent (HTTP + LiveKit worker) served in this process for the block; yields its FastAPI app."""
    app = create_app(settings, engines)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=settings.port, log_level="warning"))
    serving = asyncio.create_task(server.serve())
    try:
        await wait_for(lambda: server.started or serving.done(), "the HTTP server")
        if serving.done():
            raise RuntimeError("the agent's HTTP server failed to start")
        await wait_for(
            lambda: app.state.livekit.worker_id not in (None, "unregistered"),
            "the LiveKit worker to register",
        )
        print(f"agent worker {app.state.livekit.worker_id} registered; HTTP on port {settings.port}", flush=True)
        yield app
    finally:
        server.should_exit = True
        try:
            await asyncio.wait_for(serving, SHUTDOWN_SECS)
            print("agent HTTP server and worker stopped", flush=True)
        except asyncio.TimeoutError:
            print(f"warning: uvicorn did not exit within {SHUTDOWN_SECS:.0f}s", flush=True)


async def call_agent(app, settings: Settings) -> tuple[LiveKitCaller, Conversation]:
    """A fresh room from POST /api/session, joined once the agent is in it and any greeting has played out."""
    headers = {"Authorization": f"Bearer {settings.api_key.get_secret_value()}"} if settings.api_key else {}
    async with httpx.AsyncClient() as http:
        response = await http.post(f"http://127.0.0.1:{settings.port}/api/session", headers=headers)
    response.raise_for_status()
    session = response.json()
    caller = LiveKitCaller(session["url"], session["token"])
    try:
        joined = time.monotonic()
        await caller.join()
        await caller.wait_for_agent(STARTUP_SECS)
        conversation = await wait_for(lambda: app.state.sessions.get(session["room"]), "the room's conversation")
        print(f"joined room {session['room']}; agent audio track after {time.monotonic() - joined:.2f}s", flush=True)
        await caller.silence(1.0)  # a moment of room tone before the first word
        ear = Ear(caller)
        if ear.last_voice() is not None:  # a greeting: let it finish
            while time.monotonic() - ear.last_voice() < QUIET_SECS:
                await caller.silence(POLL_SECS)
    except BaseException:
        await caller.leave()
        raise
    return caller, conversation


async def hang_up(app, callers: list[LiveKitCaller]) -> None:
    """Leave every room and wait until the agent has ended those conversations (it does when the last user leaves)."""
    await asyncio.gather(*(caller.leave() for caller in callers))
    print(f"{len(callers)} caller(s) left", flush=True)
    try:
        await wait_for(lambda: app.state.sessions.active == 0, "the agent to end the rooms", SHUTDOWN_SECS, 0.1)
    except TimeoutError as e:
        print(f"warning: {e}", flush=True)


async def run_with_agent(args, settings, engines, questions, audio) -> dict:
    """Serve the agent (HTTP + LiveKit worker) in this process, join its room, converse, and shut it all down."""
    async with serving_agent(settings, engines) as app:
        caller, conversation = await call_agent(app, settings)
        try:
            started, cpu_started = time.perf_counter(), os.times()
            log = TurnLog.attach(conversation)
            spoken = await converse(caller, conversation, log, questions, audio)
            run_seconds = time.perf_counter() - started
            cpu = os.times()
            await caller.silence(0.5)
            messages = [
                {"role": m.get("role"), "content": m.get("content")}
                for m in conversation.context.get_messages()
                if isinstance(m, dict)
            ]
            agent_turns = [vars(t).copy() for t in log.turns]
        finally:
            await hang_up(app, [caller])

    return {
        "run": {
            "turns": args.turns,
            "conversation_seconds": run_seconds,
            "conversation_cpu_seconds": cpu.user + cpu.system - cpu_started.user - cpu_started.system,
        },
        "spoken": spoken,
        "agent_turns": agent_turns,  # every TurnLatency the agent recorded, pipeline clock
        "messages": messages,
    }


def exit_despite_lingering_threads() -> None:
    """End the process even if threads are left (e.g. LiveKit's job threads, which would keep it alive)."""
    lingering = [t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon]
    if lingering:
        print(f"exiting with os._exit: threads still alive: {', '.join(t.name for t in lingering)}", flush=True)
        os._exit(0)


if __name__ == "__main__":
    logger.remove()
    logger.add(sys.stderr, level="WARNING")  # pipecat logs every frame at DEBUG
    asyncio.run(main(parser.parse_args()))
    exit_despite_lingering_threads()
