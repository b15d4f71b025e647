"""Spoken turns from callers in other processes, joined with the agent's own timeline into a per-stage waterfall."""

import asyncio
import json
import os
import sys
import tempfile
import time
import wave
from dataclasses import dataclass, field
from pathlib import Path


from agent.config import Settings
from agent.livekit_dev_server import LiveKitServerProcess
from agent.ws_client import write_wav
from agent.turn_metrics import TIMELINE
from bench.report import percentile
from harness.observe import TurnLog
from harness.serving import agent_settings as with_livekit
from harness.serving import serving  # noqa: F401 (the benchmarks serve the agent with it)
from harness.speech import normalize, speak_16k
from services.audio import INPUT_SAMPLE_RATE

# Questions the project's tests never ask, each with the words a right answer says (any one).
QUESTIONS = [
    ("What is the capital of France?", ("paris",)),
    ("How many legs does a spider have?", ("eight", "8")),
    ("What is the tallest mountain in the world?", ("everest",)),
    ("Who wrote Romeo and Juliet?", ("shakespeare",)),
    ("What color do you get if you mix blue and yellow?", ("green",)),
    ("What is the largest planet in our solar system?", ("jupiter",)),
    ("Which ocean is the biggest?", ("pacific",)),
    ("What is the opposite of hot?", ("cold",)),
    ("What do bees make?", ("honey",)),
    ("What is the freezing point of water in Celsius?", ("zero", "0")),
]
# The waterfall: each row is the step ending at that event (the client's first, the agent's
# TIMELINE next, the client's last); a step is the time from the previous event to its own.
EVENTS = ["voiced_end", *(event for event, _ in TIMELINE), "heard"]
STEP_NAMES = {
    "speech_end": "input",
    "vad_stop": "VAD silence",
    "transcript": "STT",
    "turn_end": "turn decision",
    "llm_text": "LLM first text",
    "tts_text": "first chunk",
    "tts_audio": "TTS first audio",
    "bot_started": "output",
    "heard": "delivery",
}
MAX_REPLY_SECS = 12.0  # an answer to a simple question is a sentence or two
STARTUP_SECS = 60.0


@dataclass
class CallerRun:
    """One caller process's conversation: what it sent and heard, and the agent's turn log."""

    transport: str
    client: list[dict]  # harness.caller's turns.json rows
    agent: TurnLog | None
    messages: list[dict] = field(default_factory=list)  # the conversation's context at the end


def question_wavs(directory: Path, audio: list[bytes]) -> list[Path]:
    paths = []
    for i, pcm in enumerate(audio):
        path = directory / f"question-{i:02d}.wav"
        write_wav(path, pcm, INPUT_SAMPLE_RATE)
        paths.append(path)
    return paths


async def spoken_questions(engines, count: int) -> tuple[list[tuple[str, tuple]], list[bytes]]:
    asked = [QUESTIONS[i % len(QUESTIONS)] for i in range(count)]
    return asked, [await speak_16k(engines.tts, text) for text, _ in asked]


def agent_settings(settings: Settings, livekit: LiveKitServerProcess | None) -> Settings:
    # No greeting: timing starts with the user's first words.
    return with_livekit(settings, livekit.url if livekit is not None else None, greeting="")


async def until(condition, what: str, timeout: float, step: float = 0.05):
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(step)
    return value


async def call(
    transport: str,
    port: int,
    wavs: list[Path],
    conversations,
    out: Path,
    *,
    callers: int = 1,
    lead_in_secs: float = 1.0,
    nice: int = 0,
) -> list[CallerRun]:
    """`callers` processes (harness.caller) at once, each asking every question in `wavs` over
    `transport`; while they talk, each new conversation (`conversations()`: key → Conversation)
    gets a TurnLog. `nice`: the callers' CPU niceness (0: the agent's)."""
    before = set(conversations())
    logs: dict[str, TurnLog] = {}
    processes = []
    for n in range(callers):
        command = [sys.executable, "-m", "harness.caller", "--transport", transport,
                   "--agent", f"http://127.0.0.1:{port}", "--out", str(out / f"caller-{n}"),
                   "--lead-in-secs", str(lead_in_secs)]  # fmt: skip
        for wav in wavs:
            command += ["--wav", str(wav)]
        env = {k: v for k, v in os.environ.items() if not k.startswith("LIVEKIT_")}
        if nice:
            command = ["nice", "-n", str(nice), *command]
        processes.append(await asyncio.create_subprocess_exec(*command, env=env))
    waiting = [asyncio.create_task(p.wait()) for p in processes]
    while not all(w.done() for w in waiting):
        for key, conversation in list(conversations().items()):
            if key not in before and key not in logs and conversation is not None:
                logs[key] = TurnLog.attach(conversation)
        await asyncio.sleep(0.05)
    runs = []
    for n in range(callers):
        result = json.loads((out / f"caller-{n}" / "turns.json").read_text())
        runs.append(CallerRun(transport, result["turns"], _log_for(result, logs)))
    return runs


def _log_for(result: dict, logs: dict[str, TurnLog]) -> TurnLog | None:
    """The agent's log of the conversation this caller had: by the session key the caller learned
    (a LiveKit room, a peer id), else the one whose turns ended while it spoke. Callers that speak
    at the same moment all overlap every log, so only the key tells them apart."""
    if result.get("session") in logs:
        return logs[result["session"]]
    client_turns = result["turns"]

    def overlap(log: TurnLog) -> int:
        return sum(
            1
            for turn in log.turns
            for row in client_turns
            if row["speech_started"] <= turn.at.get("speech_end", -1) <= (row["first_heard"] or row["voiced_end"] + 30)
        )

    best = max(logs.values(), key=overlap, default=None)
    return best if best is not None and overlap(best) else None


def waterfall(row: dict, log: TurnLog | None) -> dict:
    """One client turn joined with the agent turn that answered it: the time of every event and
    each step's share of the voice-to-voice time (negative where the agent's VAD put the end of
    speech before the client's last voiced frame)."""
    at = {"voiced_end": row["voiced_end"], "heard": row["first_heard"]}
    heard = row["first_heard"]
    if log is not None and heard is not None:
        answered = [t for t in log.turns if row["speech_started"] <= t.at.get("speech_end", -1) <= heard]
        if answered:
            at |= answered[-1].at
            at["heard"] = heard
    steps, previous = {}, None
    for event in EVENTS:
        if at.get(event) is None:
            continue
        if previous is not None and event in STEP_NAMES:
            steps[STEP_NAMES[event]] = at[event] - at[previous]
        previous = event
    v2v = row["voice_to_voice"]
    accounted = sum(steps.values()) if steps else 0.0
    return {"at": at, "steps": steps, "voice_to_voice": v2v, "unaccounted": v2v - accounted if v2v is not None else None}


async def judge(engines, run: CallerRun, asked: list[tuple[str, tuple]]) -> list[dict]:
    """Each turn: its waterfall, what the agent's reply said (transcribed by the STT engine), whether
    it holds a right answer, and how long and repetitive it was."""
    rows = []
    for row, (question, answers) in zip(run.client, asked):
        reply_text = ""
        if row.get("reply_wav") and Path(row["reply_wav"]).is_file():
            with wave.open(row["reply_wav"]) as wav:
                pcm = wav.readframes(wav.getnframes())
                rate = wav.getframerate()
            if pcm:
                reply_text = (await engines.stt.transcribe(pcm, rate)).text
        words = normalize(reply_text).split()
        rows.append(
            {
                "question": question,
                **waterfall(row, run.agent),
                "reply": reply_text,
                "correct": any(word.startswith(answer) for word in words for answer in answers),
                "reply_voiced_seconds": row.get("reply_voiced_seconds"),
                "repeats_a_phrase": repeats(words),
            }
        )
    return rows


def repeats(words: list[str], n: int = 4) -> bool:
    """Whether some run of `n` words occurs twice (a reply looping on itself)."""
    grams = [tuple(words[i : i + n]) for i in range(len(words) - n + 1)]
    return len(grams) != len(set(grams))


def summarize(rows: list[dict]) -> dict:
    answered = [r for r in rows if r["voice_to_voice"] is not None]
    v2v = [r["voice_to_voice"] for r in answered]
    names = list(STEP_NAMES.values())
    return {
        "turns": len(rows),
        "answered": len(answered),
        "correct": sum(r["correct"] for r in rows),
        "v2v_p50": percentile(v2v, 50),
        "v2v_p95": percentile(v2v, 95),
        "steps_p50": {name: percentile([r["steps"].get(name) for r in answered], 50) for name in names},
        "unaccounted_p50": percentile([r["unaccounted"] for r in answered], 50),
        "longest_reply_secs": max((r["reply_voiced_seconds"] or 0 for r in rows), default=0.0),
        "replies_repeating": sum(r["repeats_a_phrase"] for r in rows),
    }


def print_waterfalls(summaries: dict[str, dict]) -> None:
    """Columns: one per run (transport, or stock baseline); rows: the steps' p50, then the totals."""
    labels = list(summaries)
    width = max(14, *(len(label) + 2 for label in labels))
    cell = lambda v: (f"{v * 1000:.0f} ms" if v is not None else "-").rjust(width)  # noqa: E731
    print("step (p50)".ljust(18) + "".join(label.rjust(width) for label in labels))
    for name in STEP_NAMES.values():
        print(name.ljust(18) + "".join(cell(summaries[l]["steps_p50"][name]) for l in labels))
    print("unaccounted".ljust(18) + "".join(cell(summaries[l]["unaccounted_p50"]) for l in labels))
    print("voice-to-voice p50".ljust(18) + "".join(cell(summaries[l]["v2v_p50"]) for l in labels))
    print("voice-to-voice p95".ljust(18) + "".join(cell(summaries[l]["v2v_p95"]) for l in labels))
    print("answered".ljust(18) + "".join(f"{summaries[l]['answered']}/{summaries[l]['turns']}".rjust(width) for l in labels))
    print("right answer".ljust(18) + "".join(f"{summaries[l]['correct']}/{summaries[l]['turns']}".rjust(width) for l in labels))
    print("longest reply".ljust(18) + "".join(f"{summaries[l]['longest_reply_secs']:.1f} s".rjust(width) for l in labels))
    print()


def scratch_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="voice-agent-bench-"))
