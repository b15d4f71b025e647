"""Latency benchmark: simulated spoken turns through LocalSession → p50/p95 of STT, LLM, TTS, voice-to-voice."""

import argparse
import asyncio
import datetime
import json
import os
import platform
import resource
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path

import numpy as np
import torch
from loguru import logger

from agent.config import Settings
from agent.engines import load_engines_warm
from harness.local_session import LocalSession
from harness.speech import speak_16k

QUESTIONS = [
    "What is the capital of France?",
    "How many legs does a spider have?",
    "What is the tallest mountain in the world?",
    "Who wrote Romeo and Juliet?",
    "How many days are in a leap year?",
    "What color do you get if you mix blue and yellow?",
    "What is the boiling point of water?",
    "Can you tell me a fun fact about octopuses?",
    "What is the largest planet in our solar system?",
    "How do you say hello in Spanish?",
    "What is the square root of sixty four?",
    "Which ocean is the biggest?",
]
METRICS = ["turn_ended", "stt", "llm_first_token", "tts_first_audio", "voice_to_voice"]
QUIET_SECS = 1.5  # the bot counts as done once nothing has played for this long
ANSWER_CAP_SECS = 15.0  # longest wait for a reply to start after the user stops speaking
POLL_SECS = 0.1  # the user's microphone keeps sending silence in steps this long

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--turns", type=int, default=10, help="user turns per session")
parser.add_argument("--sessions", type=int, default=1, help="concurrent conversations sharing the engines")
parser.add_argument("--out", type=Path, default=None, help="JSON results (default bench/results/latency-PROFILE.json)")


def percentile(values, q):
    """q-th percentile (0..100, linear interpolation) of the non-missing values; None if there are none."""
    values = np.asarray([v for v in values if v is not None], dtype=np.float64)
    return float(np.percentile(values, q)) if values.size else None


def summary(values):
    values = [v for v in values if v is not None]
    mean = float(np.mean(values)) if values else None
    return {"n": len(values), "mean": mean, "p50": percentile(values, 50), "p95": percentile(values, 95)}


def print_table(stats, names=None):
    """`stats` maps a metric name to summary(): one row each (n, mean, p50, p95), in seconds."""
    print(f"{'metric (seconds)':<18} {'n':>4} {'mean':>7} {'p50':>7} {'p95':>7}")
    fmt = lambda v: f"{v:7.3f}" if v is not None else f"{'-':>7}"  # noqa: E731
    for m in names or stats:
        print(f"{m:<18} {stats[m]['n']:>4} {fmt(stats[m]['mean'])} {fmt(stats[m]['p50'])} {fmt(stats[m]['p95'])}")


def machine_info(load_average_1m, **extra):
    """The machine and library versions a result was measured with (call at the end of the run)."""
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = None
    return {
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "pipecat": version("pipecat-ai"),
        "transformers": version("transformers"),
        "faster_whisper": version("faster-whisper"),
        **extra,
        "cuda_available": torch.cuda.is_available(),
        "load_average_1m": load_average_1m,  # at the end of the run: other work on the machine skews every number
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
        "git_commit": commit,
    }


def process_memory_mb() -> dict[str, float]:
    """This process' resident memory, MB: rss = anon (heap, tensors) + file (mapped files) + shmem.

    `pss` counts a page mapped k times as 1/k each time: a file mapped twice (a safetensors
    checkpoint loaded twice) is in `rss` twice but in `pss` about once. `peak` is the highest RSS
    since the start, or since "5" was written to /proc/self/clear_refs.
    """
    fields = {"VmRSS": "rss", "RssAnon": "anon", "RssFile": "file", "VmHWM": "peak", "Pss": "pss"}
    memory = {}
    for status in ("/proc/self/status", "/proc/self/smaps_rollup"):
        for line in Path(status).read_text().splitlines():
            name, _, value = line.partition(":")
            if name in fields:
                memory[fields[name]] = int(value.split()[0]) / 1024  # kB
    return memory


def command_line(module):
    return " ".join([Path(sys.executable).name, "-m", module, *sys.argv[1:]])


def write_json(out, result):
    """Write `result` to `out` atomically (via a temporary file next to it)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=2, default=str) + "\n")
    tmp.replace(out)


async def run_session(index, engines, settings, questions, audio):
    """One user speaks every question, each time waiting in silence until the bot has answered."""
    spoken = []
    stop_timeouts = []  # the user aggregator's watchdog ended a turn no stop strategy ended (after 5 s)
    async with LocalSession(engines, settings) as session:
        log = session.turn_log
        session.conversation.user_aggregator.add_event_handler(
            "on_user_turn_stop_timeout", lambda aggregator: stop_timeouts.append(session.now())
        )
        await session.silence(0.5)  # a moment of room tone before the first word
        for turn, (question, pcm) in enumerate(zip(questions, audio)):
            heard_before, timeouts_before = len(log.transcripts), len(stop_timeouts)
            speech_started = session.now()
            await session.speak(pcm)
            speech_ended = session.now()
            # Keep the microphone open (silence) until the reply has played out, or nothing came for a while.
            # Only audio that started after the question ended counts: the tail of an earlier reply is no answer.
            while True:
                await session.silence(POLL_SECS)
                reply = [c for c in session.played if c.started_at >= speech_ended]
                if reply and session.now() - max(c.started_at + c.seconds for c in reply) >= QUIET_SECS:
                    break
                if not reply and session.now() - speech_ended >= ANSWER_CAP_SECS:
                    break
            reply_seconds = sum(c.seconds for c in reply)
            last = log.transcripts[-1] if len(log.transcripts) > heard_before else None
            spoken.append(
                {
                    "turn": turn,
                    "question": question,
                    "speech_started": speech_started,
                    "speech_ended": speech_ended,  # includes the trailing silence of the Piper clip
                    "reply_started_after": reply[0].started_at - speech_ended if reply else None,
                    "reply_audio_seconds": reply_seconds,
                    "heard": last.text if last else None,  # last segment only
                    "whisper_seconds": last.processing_seconds if last else None,
                    "turn_stop_timeouts": len(stop_timeouts) - timeouts_before,
                }
            )
            replied = f"{reply_seconds:.1f}s reply" if reply else "NO REPLY"
            watchdog = " (turn ended by the 5 s stop watchdog)" if spoken[-1]["turn_stop_timeouts"] else ""
            print(f"  session {index} turn {turn + 1}/{len(questions)}: {replied} to {question!r}", end="")
            print(f", heard {spoken[-1]['heard']!r}{watchdog}", flush=True)
        await session.silence(0.5)
        latencies = list(log.turns)
        underruns = log.underruns
        messages = [
            {"role": m.get("role"), "content": m.get("content")}
            for m in session.conversation.context.get_messages()
            if isinstance(m, dict)
        ]
    # Match each measured turn to the spoken question it followed (its speech ended in that turn's window).
    turns = []
    for t in latencies:
        matched = [s for s in spoken if s["speech_started"] <= t.user_speech_ended]
        question = matched[-1] if matched else None
        turns.append(
            {
                "session": index,
                "turn": question["turn"] if question else None,
                "question": question["question"] if question else None,
                "user_speech_ended": t.user_speech_ended,
                **{m: getattr(t, m) for m in METRICS},
            }
        )
    return {"session": index, "spoken": spoken, "turns": turns, "underruns": underruns, "messages": messages}


async def main(args):
    settings = Settings(greeting="")  # timing starts with the user's first words
    out = args.out or Path(__file__).parent / "results" / f"latency-{settings.profile}.json"
    print(f"loading engines ({settings.profile} profile) ...", flush=True)
    started = time.perf_counter()
    engines = await load_engines_warm(settings)
    load_seconds = time.perf_counter() - started
    print(f"engines loaded and warm in {load_seconds:.1f}s", flush=True)

    questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(args.turns)]
    audio = [await speak_16k(engines.tts, q) for q in questions]
    speech_seconds = sum(len(a) for a in audio) / 2 / 16000
    print(f"{args.sessions} session(s) x {args.turns} turns, {speech_seconds:.1f}s of user speech each", flush=True)

    started, cpu_started = time.perf_counter(), os.times()
    sessions = await asyncio.gather(
        *(run_session(i, engines, settings, questions, audio) for i in range(args.sessions))
    )
    run_seconds = time.perf_counter() - started
    cpu = os.times()
    cpu_seconds = cpu.user + cpu.system - cpu_started.user - cpu_started.system  # this process, all threads
    engines.close()

    turns = [t for s in sessions for t in s["turns"]]
    spoken = sum(len(s["spoken"]) for s in sessions)
    replied = sum(turn["reply_audio_seconds"] > 0 for s in sessions for turn in s["spoken"])
    stats = {m: summary([t[m] for t in turns]) for m in METRICS}

    load = os.getloadavg()[0]
    print(f"\nconversation {run_seconds:.1f}s wall, {cpu_seconds:.1f}s CPU in this process, load average {load:.2f}")
    print(f"user turns spoken {spoken}, answered {len(turns)} (turns with latency metrics), {replied} got reply audio")
    if stats["stt"]["n"] < len(turns):
        print("note: pipecat drops the STT metric of a turn whose transcript took over 2 s (stt_ttfb_timeout)")
    print_table(stats, METRICS)

    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command_line("bench.latency"),
        "machine": machine_info(load),
        "models": {"stt": settings.stt_model, "llm": settings.llm_model, "tts": settings.tts_voice},
        "settings": settings.model_dump(mode="json"),  # secrets dump as "**********"
        "run": {
            "sessions": args.sessions,
            "turns_per_session": args.turns,
            "engine_load_seconds": load_seconds,
            "conversation_seconds": run_seconds,
            "conversation_cpu_seconds": cpu_seconds,
            "quiet_secs": QUIET_SECS,
            "answer_cap_secs": ANSWER_CAP_SECS,
        },
        "turns_spoken": spoken,
        "turns_answered": len(turns),
        "turns_with_reply_audio": replied,
        "summary": stats,
        "turns": turns,
        "sessions": sessions,
    }
    write_json(out, result)
    print(f"\nwrote {out}")


if __name__ == "__main__":
    logger.remove()
    logger.add(sys.stderr, level="WARNING")  # pipecat logs every frame at DEBUG
    asyncio.run(main(parser.parse_args()))
