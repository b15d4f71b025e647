"""Whisper's padded 30 s window vs the short encoding (STT_SHORT_ENCODE): word error rate and time per turn, same speech."""

import argparse
import asyncio
import os
import statistics
from pathlib import Path

import numpy as np

from agent.config import Settings
from agent.engines import load_engines_warm
from bench.report import RESULTS, command_line, machine_info, now_iso, write_json
from bench.waterfall import QUESTIONS
from harness.speech import speak_16k, wer
from services.stt import WhisperEngine

# The bench's questions, the suite's spoken turns and everyday requests, in the bundled Piper voice.
PHRASES = [question for question, _ in QUESTIONS] + [
    "Let me tell you about my day, it was long and full of meetings.",
    "Sorry, what is the capital of Spain?",
    "Stop, wait, I have another question. What is the capital of Germany?",
    "Stop. What is the capital of Italy?",
    "Tell me a long story about a dragon and a brave knight.",
    "Wait, stop. Tell me about cats instead.",
    "Wait, stop, I wanted to ask about my train ticket instead.",
    "Can you recommend a good book for a long flight?",
    "How do I make a cup of green tea?",
    "What time does the sun set in winter?",
    "Please remind me to call my mother tomorrow.",
    "Why is the sky blue?",
    "What's the difference between a frog and a toad?",
    "How far is the moon from the earth?",
    "Tell me a joke about computers.",
    "What should I cook for dinner tonight?",
]
# Sounds over the agent's reply that must not come back as words (the barge-in policy counts words).
HUMS = ["Mhm."]
ROOM_NOISE_RMS = 30.0  # about -60 dBFS
PRE_ROLL_SECS = 0.3  # the room tone before the speech that a VAD segment starts with
TAIL_SECS = 0.2  # and after it (the VAD's stop)

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--out", type=Path, default=RESULTS / "stt-window-cpu.json", help="JSON results")


async def main(args):
    settings = Settings(_env_file=None, greeting="", llm_max_new_tokens=4)
    engines = await load_engines_warm(settings)
    stt = settings.of_stage("stt", "device", "compute_type", "language", "beam_size", "cpu_threads")
    engine = WhisperEngine(settings.stt_model, **stt, workers=1)
    short_by_window = {"30 s window": False, "short": True}
    rng = np.random.default_rng(0)

    async def heard(phrase: str) -> dict:
        speech = np.frombuffer(await speak_16k(engines.tts, phrase), np.int16).astype(np.float32)
        audio = np.concatenate([np.zeros(int(PRE_ROLL_SECS * 16000)), speech, np.zeros(int(TAIL_SECS * 16000))])
        audio += rng.normal(0.0, ROOM_NOISE_RMS, audio.size)
        pcm = np.clip(audio, -32768, 32767).astype(np.int16).tobytes()
        row = {"phrase": phrase}
        for name, short in short_by_window.items():
            transcript = await engine.transcribe(pcm, 16000, short=short)
            row[name] = {"heard": transcript.text, "wer": wer(phrase, transcript.text), "seconds": transcript.processing_seconds}
        return row

    rows = []
    for phrase in PHRASES:
        rows.append(row := await heard(phrase))
        print(f"{row['30 s window']['wer']:.2f} {row['short']['wer']:.2f}  {phrase!r} -> {row['short']['heard']!r}", flush=True)
    hums = [await heard(hum) for hum in HUMS]

    summary = {
        name: {
            "mean_wer": statistics.mean(r[name]["wer"] for r in rows),
            "phrases_worse": sum(r[name]["wer"] > min(r[n]["wer"] for n in short_by_window) for r in rows),
            "p50_seconds": statistics.median(r[name]["seconds"] for r in rows),
        }
        for name in short_by_window
    }
    summary["short"]["fallbacks"] = engine.fallbacks
    print(f"\n{'window':<12} {'mean WER':>9} {'worse on':>9} {'p50 time':>9}")
    for name, s in summary.items():
        print(f"{name:<12} {s['mean_wer']:9.3f} {s['phrases_worse']:>6}/{len(rows)} {s['p50_seconds']:8.2f}s")
    for hum in hums:
        print(f"{hum['phrase']!r} heard as " + ", ".join(f"{hum[n]['heard']!r} ({n})" for n in short_by_window))
    write_json(
        args.out,
        {
            "date": now_iso(),
            "command": command_line("bench.stt_window"),
            "machine": machine_info(os.getloadavg()[0]),
            "model": settings.stt_model,
            "summary": summary,
            "phrases": rows,
            "hums": hums,
        },
    )
    engines.close()


if __name__ == "__main__":
    asyncio.run(main(parser.parse_args()))
