"""Voice-to-voice latency over real transports, heard by callers in other processes, with a waterfall per stage.

    python -m bench.latency                      # /ws, P2P WebRTC and LiveKit, 10 turns each
    python -m bench.latency --baseline stock     # and the stock Pipecat pipeline over each, side by side
    python -m bench.latency --transports ws --callers 3

The agent (HTTP server and LiveKit worker, as `voice-agent serve` runs them) is served in this
process on the bundled models; each caller (harness.caller) is its own process that speaks the
questions (Piper) in real time and records, on the machine-wide monotonic clock, when its last
voiced frame went out and when the first voiced reply audio came back. The agent's side of each
turn (agent.turn_metrics.TIMELINE) is joined on the same clock, so every millisecond of a
turn is in one step: input, VAD silence, STT, turn decision, LLM first text, first chunk, TTS
first audio, output, delivery. Each reply is transcribed to check it holds a right answer.

With `--baseline stock`, the stock pipeline (bench.stock) answers the same questions over each
transport too ("stock-ws", "stock-p2p", "stock-livekit"), and each transport's ratio is to
stock over the same transport; the ratio to stock over /ws is kept beside it.
"""

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path
from contextlib import AsyncExitStack

from loguru import logger

from agent.app import create_app
from agent.config import Settings
from agent.engines import load_engines_warm
from agent.livekit_dev_server import LiveKitServerProcess, free_port
from bench.report import RESULTS, command_line, machine_info, now_iso, write_json
from bench.stock import create_stock_app
from bench.waterfall import (
    agent_settings,
    call,
    judge,
    print_waterfalls,
    question_wavs,
    scratch_dir,
    serving,
    spoken_questions,
    summarize,
)

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--transports", default="ws,p2p,livekit", help="comma-separated: ws, p2p, livekit")
parser.add_argument("--baseline", choices=["stock"], help="also measure the stock Pipecat pipeline over each transport")
parser.add_argument("--turns", type=int, default=10, help="spoken questions per caller")
parser.add_argument("--callers", type=int, default=1, help="callers at once on each transport")
parser.add_argument("--out", default=None, help="JSON results (default bench/results/latency-PROFILE.json)")


async def main(args) -> dict:
    settings = Settings()
    transports = [t for t in args.transports.split(",") if t]
    engines = await load_engines_warm(settings)
    asked, audio = await spoken_questions(engines, args.turns)
    scratch = scratch_dir()
    wavs = question_wavs(scratch, audio)
    results, summaries = {}, {}
    async with AsyncExitStack() as stack:
        livekit = stack.enter_context(LiveKitServerProcess()) if "livekit" in transports else None
        ours = agent_settings(settings, livekit)
        app = await stack.enter_async_context(serving(create_app(ours, engines), ours.port))
        runs = [(t, ours.port, lambda: app.state.sessions.snapshot()) for t in transports]
        if args.baseline == "stock":
            stock_port = free_port()
            stock_app = await stack.enter_async_context(serving(create_stock_app(ours, engines), stock_port))
            runs += [(f"stock-{t}", stock_port, lambda: dict(stock_app.state.conversations)) for t in transports]
        for label, port, conversations in runs:
            print(f"\n{label}: {args.callers} caller(s) x {args.turns} questions", flush=True)
            started = time.perf_counter()
            # A stock conversation loads a Whisper and a Piper of its own before it listens.
            lead_in_secs = 6.0 if label.startswith("stock-") else 1.0
            calls = await call(
                label.removeprefix("stock-"), port, wavs, conversations, scratch / label,
                callers=args.callers, lead_in_secs=lead_in_secs,
            )  # fmt: skip
            rows = [row for run in calls for row in await judge(engines, run, asked)]
            summaries[label] = summarize(rows)
            results[label] = {"seconds": time.perf_counter() - started, "summary": summaries[label], "turns": rows}
            for row in rows:
                v2v = f"{row['voice_to_voice']:.2f} s" if row["voice_to_voice"] is not None else "no reply"
                print(f"  {v2v}  {row['question']!r} -> {row['reply']!r}", flush=True)
    print()
    print_waterfalls(summaries)
    for label in transports:
        ours = summaries[label]["v2v_p50"]
        same, over_ws = (summaries.get(stock, {}).get("v2v_p50") for stock in (f"stock-{label}", "stock-ws"))
        if ours and same:
            summaries[label]["v2v_p50_vs_stock"] = ours / same
            print(f"{label}: voice-to-voice p50 {ours / same:.2f}x stock's over {label}")
        if ours and over_ws and label != "ws":
            summaries[label]["v2v_p50_vs_stock_ws"] = ours / over_ws
            print(f"{label}: voice-to-voice p50 {ours / over_ws:.2f}x stock's over ws")
    engines.close()
    result = {
        "date": now_iso(),
        "command": command_line("bench.latency"),
        "machine": machine_info(os.getloadavg()[0]),
        "models": {"stt": settings.stt_model, "llm": settings.llm_model, "tts": settings.tts_voice},
        "settings": settings.model_dump(mode="json"),
        "callers": args.callers,
        "summary": summaries,
        "runs": results,
    }
    out = args.out or RESULTS / f"latency-{settings.profile}.json"
    write_json(Path(out), result)
    print(f"\nwrote {out}")
    return result


if __name__ == "__main__":
    logger.remove()
    logger.add(sys.stderr, level="WARNING")  # pipecat logs every frame at DEBUG
    asyncio.run(main(parser.parse_args()))
    os._exit(0)  # LiveKit's job threads can outlive the loop
