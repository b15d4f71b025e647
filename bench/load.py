"""Load ramp over a real livekit-server: 1, 2, 4, 8 callers at once, each its own process, against one agent.

    python -m bench.load [--ramp 1,2,4,8] [--turns 3] [--transport livekit]

Per step: turns answered of turns asked, voice-to-voice p50/p95 as the callers heard it, the
agent's underruns (reply audio that ran dry and restarted), memory; a table, JSON and a plot.
"""

import argparse
import asyncio
import os
import sys
import time
from contextlib import AsyncExitStack
from pathlib import Path

import numpy as np
from loguru import logger

from agent.app import create_app
from agent.config import Settings
from agent.engines import load_engines_warm
from agent.livekit_dev_server import LiveKitServerProcess
from bench.report import (
    RESULTS,
    children_cpu_seconds,
    command_line,
    cpu_seconds,
    machine_info,
    now_iso,
    percentile,
    process_memory_mb,
    write_json,
)
from bench.waterfall import agent_settings, call, judge, question_wavs, scratch_dir, serving, spoken_questions

# What a caller tolerates before the reply starts (p95).
TARGET_P95_SECS = {"cpu": 2.5, "gpu": 1.0}


def ramp_of(text: str) -> list[int]:
    counts = sorted({int(part) for part in text.split(",") if part.strip()})
    if not counts or counts[0] < 1:
        raise argparse.ArgumentTypeError("the ramp is a comma-separated list of caller counts ≥ 1")
    return counts


parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--ramp", type=ramp_of, default=ramp_of("1,2,4,8"), help="callers per step (default 1,2,4,8)")
parser.add_argument("--turns", type=int, default=3, help="questions each caller asks per step (default 3)")
parser.add_argument("--transport", default="livekit", choices=["livekit", "ws", "p2p"])
parser.add_argument(
    "--caller-nice",
    type=int,
    default=0,
    help="CPU niceness of the callers (default 0). The callers stand for phones and browsers elsewhere but "
    "share the agent's cores here; at 10 the agent is served first. A caller served late hears late: "
    "that counts against the agent, never for it.",
)
parser.add_argument("--out", type=Path, default=None, help="JSON results (default bench/results/load-PROFILE.json)")


async def step(n: int, args, port: int, app, engines, asked, wavs, scratch: Path, livekit) -> dict:
    transport = args.transport
    print(f"\n--- {n} caller(s) at once over {transport} ---", flush=True)
    llm_pid = getattr(engines.llm.generator, "pid", None)
    pids = {"agent": "self", "llm_process": llm_pid, "livekit_server": livekit.pid if livekit else None}
    cpu_before = {name: cpu_seconds(pid) for name, pid in pids.items()} | {"callers": children_cpu_seconds()}
    started = time.perf_counter()
    runs = await call(transport, port, wavs, app.state.sessions.snapshot, scratch / f"{transport}-{n}", callers=n,
                      nice=args.caller_nice)  # fmt: skip
    wall = time.perf_counter() - started
    cpu_after = {name: cpu_seconds(pid) for name, pid in pids.items()} | {"callers": children_cpu_seconds()}
    # Where the 2 cores went while the callers talked: the callers stand for phones and browsers
    # elsewhere, but here they share the agent's cores.
    cpu = {name: cpu_after[name] - cpu_before[name] for name in cpu_before if cpu_before[name] is not None}
    rows = [row for run in runs for row in await judge(engines, run, asked)]
    llm_rss = process_memory_mb(llm_pid)["rss"] if llm_pid is not None else None
    rss = process_memory_mb()["rss"]
    v2v = [r["voice_to_voice"] for r in rows if r["voice_to_voice"] is not None]
    result = {
        "callers": n,
        "asked": len(rows),
        "answered": len(v2v),
        "correct": sum(r["correct"] for r in rows),
        "v2v_p50": percentile(v2v, 50),
        "v2v_p95": percentile(v2v, 95),
        "underruns": sum(run.agent.underruns for run in runs if run.agent is not None),
        "conversations_logged": sum(run.agent is not None for run in runs),
        "rss_mb": rss,
        # The LLM's own process (LLM_OWN_PROCESS), counted apart and in the total.
        "llm_process_rss_mb": llm_rss,
        "total_rss_mb": rss + (llm_rss or 0.0),
        "wall_seconds": wall,
        "caller_nice": args.caller_nice,
        "cpu_seconds": cpu,
        "cores_busy": sum(cpu.values()) / wall,
        "turns": rows,
    }
    print(f"{n} caller(s): {result['answered']}/{result['asked']} answered, p50 {fmt(result['v2v_p50'])}, "
          f"p95 {fmt(result['v2v_p95'])}, underruns {result['underruns']}, cores busy {result['cores_busy']:.2f} "
          f"(callers {cpu['callers'] / wall:.2f})", flush=True)  # fmt: skip
    return result


def fmt(value: float | None) -> str:
    return f"{value:.2f} s" if value is not None else "-"


def plot(steps: list[dict], target: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    callers = [s["callers"] for s in steps]
    fig, ax = plt.subplots(figsize=(7, 4))
    for key, style in (("v2v_p50", "o-"), ("v2v_p95", "s-")):
        ax.plot(callers, np.array([s[key] for s in steps], dtype=float), style, label=key.replace("_", " "))
    ax.axhline(target, color="tab:red", linestyle=":", label=f"target p95 {target:g} s")
    ax.set_xscale("log", base=2)
    ax.set_xticks(callers, [str(n) for n in callers])
    ax.minorticks_off()
    ax.set(xlabel="simultaneous callers", ylabel="voice-to-voice, seconds", ylim=(0, None))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


async def main(args) -> None:
    settings = Settings()
    settings = settings.model_copy(update={"max_sessions": max(settings.max_sessions, args.ramp[-1])})
    target = TARGET_P95_SECS[settings.profile]
    engines = await load_engines_warm(settings)
    asked, audio = await spoken_questions(engines, args.turns)
    scratch = scratch_dir()
    wavs = question_wavs(scratch, audio)
    async with AsyncExitStack() as stack:
        livekit = stack.enter_context(LiveKitServerProcess()) if args.transport == "livekit" else None
        ours = agent_settings(settings, livekit)
        app = await stack.enter_async_context(serving(create_app(ours, engines), ours.port))
        steps = [await step(n, args, ours.port, app, engines, asked, wavs, scratch, livekit) for n in args.ramp]
    engines.close()

    print(f"\nload ramp over {args.transport}, {settings.profile} profile, target voice-to-voice p95 ≤ {target:g} s")
    print(f"{'callers':>7} {'answered':>9} {'right':>6} {'v2v p50':>8} {'v2v p95':>8} {'underruns':>9} {'RSS MB':>7} "
          f"{'cores busy':>10} {'by callers':>10}")  # fmt: skip
    for s in steps:
        print(f"{s['callers']:>7} {s['answered']:>4}/{s['asked']:<4} {s['correct']:>6} {fmt(s['v2v_p50']):>8} "
              f"{fmt(s['v2v_p95']):>8} {s['underruns']:>9} {s['total_rss_mb']:>7.0f} {s['cores_busy']:>10.2f} "
              f"{s['cpu_seconds']['callers'] / s['wall_seconds']:>10.2f}")  # fmt: skip
    out = args.out or RESULTS / f"load-{settings.profile}.json"
    write_json(out, {
        "date": now_iso(),
        "command": command_line("bench.load"),
        "machine": machine_info(os.getloadavg()[0]),
        "transport": args.transport,
        "target_p95_seconds": target,
        "steps": steps,
    })  # fmt: skip
    plot(steps, target, out.with_suffix(".png"))
    print(f"\nwrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    logger.remove()
    logger.add(sys.stderr, level="WARNING")
    asyncio.run(main(parser.parse_args()))
    os._exit(0)  # LiveKit's job threads can outlive the loop
