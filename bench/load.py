"""Load ramp: N callers at once against one agent process → voice-to-voice, stage latency, underruns, memory."""

import argparse
import asyncio
import datetime
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from loguru import logger

from agent.cli import settings_from
from agent.engines import load_engines_warm
from agent.livekit_dev_server import LiveKitServerProcess
from bench.latency import (
    QUESTIONS,
    command_line,
    machine_info,
    print_table,
    process_memory_mb,
    run_session,
    summary,
    write_json,
)
from bench.livekit_latency import (
    call_agent,
    converse,
    exit_despite_lingering_threads,
    hang_up,
    livekit_agent_settings,
    livekit_versions,
    serving_agent,
)
from services import bundled
from services.tts_piper import PiperEngine
from harness.observe import TurnLog
from harness.speech import speak_16k

STAGES = ["turn_ended", "stt", "llm_first_token", "tts_first_audio"]
PLOTTED_STAGES = ["stt", "llm_first_token", "tts_first_audio"]
# What a caller tolerates before the reply starts: a 2-core CPU box is slow, a GPU should be conversational.
TARGET_P95_SECS = {"cpu": 6.0, "gpu": 2.0}


def ramp_of(text: str) -> list[int]:
    """'1,2,4,8' → [1, 2, 4, 8] (sorted, no repeats)."""
    counts = sorted({int(part) for part in text.split(",") if part.strip()})
    if not counts or counts[0] < 1:
        raise argparse.ArgumentTypeError("the ramp is a comma-separated list of caller counts ≥ 1")
    return counts


parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--ramp", type=ramp_of, default=ramp_of("1,2,4,8"), help="callers per step (default 1,2,4,8)")
parser.add_argument("--turns", type=int, default=2, help="questions each caller asks per step (default 2)")
parser.add_argument(
    "--target-p95",
    type=float,
    default=None,
    help="voice-to-voice p95 a step must stay under, seconds (default: "
    + ", ".join(f"{secs:g} on the {profile} profile" for profile, secs in TARGET_P95_SECS.items())
    + ")",
)
parser.add_argument("--profile", choices=["cpu", "gpu"], help="settings profile (default: $PROFILE or cpu)")
parser.add_argument(
    "--in-process",
    action="store_true",
    help="callers are LocalSessions on the in-memory transport (no LiveKit); voice-to-voice is then the agent's own",
)
parser.add_argument(
    "--out", type=Path, default=None, help="JSON results (default bench/results/load-PROFILE.json), PNG beside it"
)


def questions_for(caller: int, turns: int) -> list[str]:
    """Each caller asks different questions (as far as the list goes)."""
    return [QUESTIONS[(caller * turns + turn) % len(QUESTIONS)] for turn in range(turns)]


async def livekit_step(app, settings, n: int, turns: int, speech: dict[str, bytes]) -> list[dict]:
    """N callers join at once, each in a room of its own from /api/session, and ask their questions."""
    joined = await asyncio.gather(*(call_agent(app, settings) for _ in range(n)), return_exceptions=True)
    calls = [j for j in joined if not isinstance(j, BaseException)]
    try:
        failures = [j for j in joined if isinstance(j, BaseException)]
        if failures:
            raise failures[0]
        asked = [questions_for(i, turns) for i in range(n)]
        logs = [TurnLog.attach(conversation) for _, conversation in calls]
        spoken = await asyncio.gather(
            *(
                converse(caller, conversation, log, questions, [speech[q] for q in questions], f"caller {i} ")
                for i, ((caller, conversation), log, questions) in enumerate(zip(calls, logs, asked))
            )
        )
        # Read the agent's records while the rooms still exist: leaving ends the conversations.
        callers = [
            {
                "caller": i,
                "voice_to_voice": [row["participant_v2v"] for row in rows if row["participant_v2v"] is not None],
                "spoken": rows,
                "agent_turns": [vars(t).copy() for t in log.turns],
                "underruns": log.underruns,
            }
            for i, (rows, log) in enumerate(zip(spoken, logs))
        ]
    finally:
        await hang_up(app, [caller for caller, _ in calls])
    return callers


async def in_process_step(engines, settings, n: int, turns: int, speech: dict[str, bytes]) -> list[dict]:
    """N LocalSessions start at once on the in-memory transport and ask their questions."""
    asked = [questions_for(i, turns) for i in range(n)]
    sessions = await asyncio.gather(
        *(
            run_session(i, engines, settings, questions, [speech[q] for q in questions])
            for i, questions in enumerate(asked)
        )
    )
    return [
        {
            "caller": s["session"],
            "voice_to_voice": [t["voice_to_voice"] for t in s["turns"] if t["voice_to_voice"] is not None],
            "spoken": s["spoken"],
            "agent_turns": s["turns"],
            "underruns": s["underruns"],
        }
        for s in sessions
    ]


def reset_peak_memory() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM, the peak RSS, to the current RSS
    if torch.cuda.is_available():
        for device in range(torch.cuda.device_count()):
            torch.cuda.reset_peak_memory_stats(device)


def gpu_memory_mb() -> dict | None:
    """torch's own allocations, and the whole device's use (CTranslate2 and ONNX Runtime allocate outside torch)."""
    if not torch.cuda.is_available():
        return None
    devices = range(torch.cuda.device_count())
    free_and_total = [torch.cuda.mem_get_info(d) for d in devices]
    return {
        "torch_allocated": sum(torch.cuda.memory_allocated(d) for d in devices) / 2**20,
        "torch_peak_allocated": sum(torch.cuda.max_memory_allocated(d) for d in devices) / 2**20,
        "device_used": sum(total - free for free, total in free_and_total) / 2**20,
    }


async def measure_step(n: int, step, rows: list[str], target: float) -> dict:
    """Run one step (a coroutine returning per-caller records) and summarize it."""
    print(f"\n--- {n} caller(s) at once ---", flush=True)
    reset_peak_memory()
    started, cpu_started = time.perf_counter(), os.times()
    callers = await step
    wall, cpu = time.perf_counter() - started, os.times()
    cpu_seconds = cpu.user + cpu.system - cpu_started.user - cpu_started.system  # this process, all threads
    memory = process_memory_mb()
    agent_turns = [t for c in callers for t in c["agent_turns"]]
    stats = {
        "voice_to_voice": summary([v for c in callers for v in c["voice_to_voice"]]),
        "agent_v2v": summary([t["voice_to_voice"] for t in agent_turns]),
        **{m: summary([t[m] for t in agent_turns]) for m in STAGES},
    }
    spoken = sum(len(c["spoken"]) for c in callers)
    answered = sum(len(c["voice_to_voice"]) for c in callers)
    p95 = stats["voice_to_voice"]["p95"]
    print(f"{n} caller(s): {answered}/{spoken} turns answered, {wall:.1f}s wall, "
          f"{cpu_seconds:.1f}s CPU, RSS {memory['rss']:.0f} MB")
    print_table(stats, rows)
    return {
        "callers": n,
        "turns_spoken": spoken,
        "turns_answered": answered,
        # An unanswered turn is a caller who waited past the cap: no step with one is within the target.
        "within_target": answered == spoken and p95 is not None and p95 < target,
        "summary": stats,
        "underruns": sum(c["underruns"] for c in callers),
        "rss_mb": memory["rss"],  # after the step's conversations ended
        "rss_peak_mb": memory["peak"],  # highest during the step
        "gpu_mb": gpu_memory_mb(),
        "wall_seconds": wall,
        "cpu_seconds": cpu_seconds,
        "per_caller": callers,
    }


def print_ramp(steps: list[dict]) -> None:
    gpu = steps[0]["gpu_mb"] is not None
    fmt = lambda v: f"{v:8.2f}" if v is not None else f"{'-':>8}"  # noqa: E731
    header = f"{'N':>3} {'answered':>9} {'v2v p50':>8} {'v2v p95':>8} {'stt p95':>8} {'llm p95':>8} {'tts p95':>8}"
    header += f" {'underruns':>9} {'RSS MB':>7} {'peak MB':>7}" + (f" {'GPU MB':>7}" if gpu else "")
    print(header + "  p95 < target")
    for s in steps:
        stats = s["summary"]
        line = (
            f"{s['callers']:>3} {s['turns_answered']:>4}/{s['turns_spoken']:<4} "
            f"{fmt(stats['voice_to_voice']['p50'])} {fmt(stats['voice_to_voice']['p95'])} "
            + " ".join(fmt(stats[m]["p95"]) for m in PLOTTED_STAGES)
            + f" {s['underruns']:>9} {s['rss_mb']:>7.0f} {s['rss_peak_mb']:>7.0f}"
            + (f" {s['gpu_mb']['device_used']:>7.0f}" if gpu else "")
            + f"  {'yes' if s['within_target'] else 'NO'}"
        )
        print(line)


def plot(steps: list[dict], target: float, title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    callers = [s["callers"] for s in steps]

    def p(metric: str, q: str) -> np.ndarray:
        return np.array([s["summary"][metric][q] for s in steps], dtype=float)  # a missing value plots as a gap

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    ax.plot(callers, p("voice_to_voice", "p50"), "o-", color="black", label="voice-to-voice p50")
    ax.plot(callers, p("voice_to_voice", "p95"), "o-", color="black", lw=2.5, alpha=0.45, label="voice-to-voice p95")
    for metric in PLOTTED_STAGES:
        ax.plot(callers, p(metric, "p95"), "s--", markersize=4, label=f"{metric} p95")
    ax.axhline(target, color="tab:red", linestyle=":", label=f"target p95 {target:g} s")
    ax.set_xscale("log", base=2)
    ax.set_xticks(callers, [str(n) for n in callers])
    ax.minorticks_off()
    ax.set_xlabel("simultaneous callers")
    ax.set_ylabel("seconds")
    ax.set_ylim(bottom=0)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


async def main(args):
    settings = settings_from(args, "profile")
    # Every step's callers must fit in one process: none may be refused.
    # No greeting: timing starts with the user's first words.
    settings = settings.model_copy(update={"max_sessions": max(settings.max_sessions, args.ramp[-1]), "greeting": ""})
    target = args.target_p95 or TARGET_P95_SECS[settings.profile]
    mode = "in-process" if args.in_process else "livekit"
    stem = f"load-in-process-{settings.profile}" if args.in_process else f"load-{settings.profile}"
    out = args.out or Path(__file__).parent / "results" / f"{stem}.json"
    rows = ["voice_to_voice", *([] if args.in_process else ["agent_v2v"]), *STAGES]

    print(f"loading engines ({settings.profile} profile) ...", flush=True)
    started = time.perf_counter()
    engines = await load_engines_warm(settings)
    load_seconds = time.perf_counter() - started
    print(f"engines loaded and warm in {load_seconds:.1f}s; RSS {process_memory_mb()['rss']:.0f} MB", flush=True)
    extra_versions = {}
    try:
        # The callers always speak with Piper's voice, whichever voice the agent answers with.
        voice = engines.tts if isinstance(engines.tts, PiperEngine) else PiperEngine(bundled.piper_joe())
        asked = sorted({q for i in range(args.ramp[-1]) for q in questions_for(i, args.turns)}, key=QUESTIONS.index)
        speech = {q: await speak_16k(voice, q) for q in asked}
        print(f"ramp {args.ramp} x {args.turns} turns ({mode}), target voice-to-voice p95 < {target:g}s", flush=True)
        if args.in_process:
            steps = [
                await measure_step(n, in_process_step(engines, settings, n, args.turns, speech), rows, target)
                for n in args.ramp
            ]
        else:
            log_dir = Path(tempfile.mkdtemp(prefix="load-bench-"))
            with LiveKitServerProcess(log_path=log_dir / "livekit.log") as lk:
                print(f"livekit-server at {lk.url} (log {lk.log_path})", flush=True)
                settings = livekit_agent_settings(settings, lk)
                async with serving_agent(settings, engines) as app:
                    steps = [
                        await measure_step(n, livekit_step(app, settings, n, args.turns, speech), rows, target)
                        for n in args.ramp
                    ]
                extra_versions = livekit_versions(lk)
    finally:
        engines.close()

    # "Stays under": the first step over the target ends the ramp's good range, whatever comes after it.
    passed = [s["within_target"] for s in steps]
    good = steps[: passed.index(False)] if False in passed else steps
    max_callers = good[-1]["callers"] if good else 0
    load = os.getloadavg()[0]
    print(f"\nload ramp, {mode}, {settings.profile} profile, load average {load:.2f}; "
          f"target voice-to-voice p95 < {target:g}s")
    print_ramp(steps)
    print(f"largest N with voice-to-voice p95 under {target:g}s (and every turn answered): {max_callers or 'none'}")

    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command_line("bench.load"),
        "machine": machine_info(load, **extra_versions),
        "models": {"stt": settings.stt_model, "llm": settings.llm_model, "tts": settings.tts_voice},
        "settings": settings.model_dump(mode="json"),  # secrets dump as "**********"
        "run": {
            "mode": mode,
            "ramp": args.ramp,
            "turns_per_caller": args.turns,
            "engine_load_seconds": load_seconds,
            "target_p95_seconds": target,
        },
        "max_callers_under_target": max_callers,
        "definitions": {
            "voice_to_voice": (
                "in-process: the agent's TurnLatency.voice_to_voice (VAD end of speech to BotStartedSpeakingFrame); "
                "livekit: participant_v2v, first received agent audio minus the question's voiced end "
                "(as bench.livekit_latency)"
            ),
            "agent_v2v": "livekit: the agent's own TurnLatency.voice_to_voice",
            "within_target": "every turn answered and voice-to-voice p95 < target_p95_seconds",
            "max_callers_under_target": "largest N before the first step that is not within_target",
            "underruns": "sum of each conversation's underruns (TurnLog): agent audio that stopped and restarted "
            "with no user turn between",
            "rss_mb": "VmRSS after the step's conversations ended; rss_peak_mb: VmHWM during the step",
        },
        "steps": steps,
    }
    write_json(out, result)
    plot_path = out.with_suffix(".png")
    title = f"{mode}, {settings.profile} profile, {args.turns} turn(s) per caller, {os.cpu_count()} CPUs"
    plot(steps, target, title, plot_path)
    print(f"\nwrote {out} and {plot_path}", flush=True)


if __name__ == "__main__":
    logger.remove()
    logger.add(sys.stderr, level="WARNING")  # pipecat logs every frame at DEBUG
    asyncio.run(main(parser.parse_args()))
    exit_despite_lingering_threads()
