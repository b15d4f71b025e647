"""Speculative end of turn: voice-to-voice p50/p90 with `turn_speculation` on vs off, same spoken turns."""

import argparse
import asyncio
import datetime
import os
import sys
import time
from pathlib import Path

from loguru import logger
from pipecat.frames.frames import EagerEndOfTurnCancelFrame, LLMContextFrame
from pipecat.observers.base_observer import BaseObserver, FramePushed

from agent.config import Settings
from agent.engines import load_engines_warm
from harness.local_session import LocalSession
from bench.report import command_line, machine_info, percentile, write_json
from harness.speech import speak_16k

# Smart-turn v3.2's verdicts on the bundled Piper voice, measured over several renditions: the
# complete questions score p > 0.9, the incomplete turns p < 0.05 (except the one with a comma,
# which Piper pauses at: VAD splits it, and smart-turn judges the lone "um" either way).
ANSWER_CAP_SECS = 15.0  # longest wait for a reply to start after the user stops speaking
POLL_SECS = 0.1  # the user's microphone keeps sending silence in steps this long

TURNS = {
    "complete": [
        ["What is the capital of France?"],
        ["How many legs does a spider have?"],
        ["Who painted the Mona Lisa?"],
        ["How many days are in a leap year?"],
        ["What color do you get if you mix blue and yellow?"],
        ["Who wrote Romeo and Juliet?"],
    ],
    "incomplete": [  # the user trails off and says no more: smart-turn waits out its 3 s
        ["I was wondering if you could tell me and um"],
        ["So the thing I wanted to ask is"],
        ["My number is five five five and um"],
        ["I was thinking about and uh"],
        ["My number is five five five um"],
        ["What is the capital of, um"],
    ],
    "resumed": [  # trails off, then goes on after a pause: a speculation is started and withdrawn
        ["My number is five five five and um", "one two three four"],
        ["So the thing I wanted to ask is", "the capital of Spain."],
        ["I was thinking about and uh", "a joke about cats."],
        ["I was wondering if you could tell me and um", "the time in Paris?"],
    ],
}
PAUSE_SECS = 1.2  # between the parts of a resumed turn: Whisper transcribes the first part by then
METRICS = ["turn_ended", "stt", "llm_first_token", "tts_first_audio", "voice_to_voice"]

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--repeats", type=int, default=1, help="times each turn is spoken per condition")
parser.add_argument(
    "--out", type=Path, default=None, help="JSON results (default bench/results/speculation-PROFILE.json)"
)


class SpeculationCounter(BaseObserver):
    """Speculative LLM requests, and withdrawals, that reached the LLM service."""

    def __init__(self, llm):
        super().__init__()
        self._llm = llm
        self.speculative = 0
        self.withdrawn = 0

    async def on_push_frame(self, data: FramePushed):
        if data.destination is not self._llm:
            return
        if isinstance(data.frame, LLMContextFrame) and data.frame.speculation:
            self.speculative += 1
        elif isinstance(data.frame, EagerEndOfTurnCancelFrame):
            self.withdrawn += 1


async def run_turn(engines, settings, pcm):
    """A fresh conversation (no history, so both conditions prompt the LLM alike) hears one turn.

    The microphone keeps sending room silence (smart-turn's timeout counts it) until the bot's
    first audio, then the conversation is closed: only the start of the reply is timed.
    """
    stats = engines.llm.stats
    cancelled, started = stats.cancelled, stats.started
    async with LocalSession(engines, settings) as session:
        counter = SpeculationCounter(session.conversation.llm)
        session.conversation.worker.add_observer(counter)
        turns = session.turn_log.turns
        await session.silence(0.5)
        await session.speak(pcm)
        spoke = session.now()
        while not turns and session.now() - spoke < ANSWER_CAP_SECS:
            await session.silence(POLL_SECS)
        latency = turns[-1] if turns else None
        return {
            **{m: getattr(latency, m) if latency else None for m in METRICS},
            "llm_requests": stats.started - started,
            "speculative_requests": counter.speculative,
            "withdrawn": counter.withdrawn,
            "engine_cancelled": stats.cancelled - cancelled,  # before the close cancels the reply
            "heard": [m["content"] for m in session.conversation.context.get_messages() if m["role"] == "user"],
        }


def summarize(runs, kinds):
    """voice_to_voice p50/p90, off and on, for the runs of `kinds`."""
    row = {}
    for condition in ("off", "on"):
        on = condition == "on"
        values = [r["voice_to_voice"] for r in runs if r["kind"] in kinds and r["speculation"] == on]
        row[condition] = {
            "n": sum(v is not None for v in values),
            "p50": percentile(values, 50),
            "p90": percentile(values, 90),
        }
    for q in ("p50", "p90"):
        off, on = row["off"][q], row["on"][q]
        row[f"ratio_{q}"] = on / off if off and on is not None else None
    return row


def print_table(summary):
    print(f"{'voice-to-voice (s)':<19} {'n':>3}", end="")
    print(f" {'off p50':>8} {'on p50':>7} {'on/off':>7} {'off p90':>8} {'on p90':>7} {'on/off':>7}")
    fmt = lambda v, w: f"{v:{w}.3f}" if v is not None else f"{'-':>{w}}"  # noqa: E731
    for name, row in summary.items():
        off, on = row["off"], row["on"]
        print(
            f"{name:<19} {on['n']:>3} {fmt(off['p50'], 8)} {fmt(on['p50'], 7)} {fmt(row['ratio_p50'], 7)}"
            f" {fmt(off['p90'], 8)} {fmt(on['p90'], 7)} {fmt(row['ratio_p90'], 7)}"
        )


async def main(args):
    base = Settings(greeting="")  # timing starts with the user's first words
    out = args.out or Path(__file__).parent / "results" / f"speculation-{base.profile}.json"
    print(f"loading engines ({base.profile} profile) ...", flush=True)
    started = time.perf_counter()
    engines = await load_engines_warm(base)
    print(f"engines loaded and warm in {time.perf_counter() - started:.1f}s", flush=True)

    pause = b"\x00\x00" * int(PAUSE_SECS * 16000)
    turns = []
    for kind, spoken in TURNS.items():
        for parts in spoken:
            audio = [await speak_16k(engines.tts, text) for text in parts]
            turns.append({"kind": kind, "text": f" [{PAUSE_SECS} s] ".join(parts), "pcm": pause.join(audio)})
    print(f"{len(turns)} turns x {args.repeats} x speculation off/on, one fresh conversation each", flush=True)

    conditions = {flag: base.model_copy(update={"turn_speculation": flag}) for flag in (False, True)}
    runs = []
    started = time.perf_counter()
    for repeat in range(args.repeats):
        for i, turn in enumerate(turns):
            # Interleaved, first one then the other, so a change in the machine's load hits both alike.
            for flag in (False, True) if (i + repeat) % 2 == 0 else (True, False):
                result = await run_turn(engines, conditions[flag], turn["pcm"])
                runs.append(
                    {"kind": turn["kind"], "text": turn["text"], "repeat": repeat, "speculation": flag, **result}
                )
                v2v = result["voice_to_voice"]
                print(
                    f"  {turn['kind']:<10} speculation {'on ' if flag else 'off'} "
                    f"{f'{v2v:5.2f}s' if v2v is not None else ' NONE '} "
                    f"requests {result['llm_requests']} (speculative {result['speculative_requests']}, "
                    f"withdrawn {result['withdrawn']}) {turn['text']!r}",
                    flush=True,
                )
    run_seconds = time.perf_counter() - started
    engines.close()

    summary = {kind: summarize(runs, {kind}) for kind in TURNS}
    summary["all"] = summarize(runs, set(TURNS))
    on = [r for r in runs if r["speculation"]]
    load = os.getloadavg()[0]
    print(f"\n{len(runs)} turns in {run_seconds:.1f}s, load average {load:.2f}")
    print(
        f"speculation on: {sum(r['speculative_requests'] for r in on)} speculative requests, "
        f"{sum(r['withdrawn'] for r in on)} withdrawn, "
        f"{sum(r['engine_cancelled'] for r in on)} cancelled in the engine mid-generation"
    )
    print_table(summary)

    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command_line("bench.speculation"),
        "machine": machine_info(load),
        "settings": base.model_dump(mode="json"),  # secrets dump as "**********"
        "run": {"repeats": args.repeats, "pause_secs": PAUSE_SECS, "conversation_seconds": run_seconds},
        "summary": summary,
        "runs": runs,
    }
    write_json(out, result)
    print(f"\nwrote {out}")


if __name__ == "__main__":
    logger.remove()
    logger.add(sys.stderr, level="WARNING")  # pipecat logs every frame at DEBUG
    asyncio.run(main(parser.parse_args()))
