"""Orpheus benchmark: SNAC windowing (ours vs the reference), batcher throughput, time to first audio, streams.

    python -m bench.orpheus                      # CPU: random real-size SNAC, tiny random LM
    python -m bench.orpheus --device cuda --lm random-3b --streams 1,8,32,64,128   # GPU
    python -m bench.orpheus --device cuda --lm canopylabs/orpheus-3b-0.1-ft --snac hubertsiuzdak/snac_24khz

Writes bench/results/orpheus-DEVICE.json. Random weights have the real architecture, so compute
figures hold for the real models; the audio itself is noise.
"""

import argparse
import asyncio
import os
import time
from pathlib import Path

import numpy as np
import torch
from snac import SNAC
from transformers import LlamaConfig, LlamaForCausalLM

from bench.report import command_line, machine_info, percentile, write_json
from services.orpheus.engine import OrpheusEngine
from services.orpheus.tokens import END_OF_SPEECH, PAD, TOKENS_PER_SECOND
from services.orpheus.snac import SAMPLES_PER_FRAME, SAMPLE_RATE, SnacDecoder, SnacWindowPlanner
from agent.config import Settings
from harness.orpheus_models import (
    ORPHEUS_VOCAB,
    build_random_orpheus_3b,
    build_random_snac,
    build_tiny_orpheus_lm,
    build_tiny_tokenizer,
)

TEXT = "Hello there! It is a lovely day for a walk in the park, isn't it?"

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
parser.add_argument("--seconds", type=float, default=5.0, help="audio per utterance in the windowing comparison")
parser.add_argument("--batcher-streams", default="1,4,16,64", help="concurrent streams for the batcher test")
parser.add_argument("--batcher-frames", type=int, default=12, help="frames per stream in the batcher test")
parser.add_argument("--lm", default="tiny", help="tiny | random-3b | hub id or directory of an Orpheus LM")
parser.add_argument("--snac", default=None, help="SNAC hub id or directory (default: random real-size)")
parser.add_argument("--streams", default="1,8", help="concurrent Orpheus streams (GPU: 1,8,32,64,128)")
parser.add_argument("--compile", action="store_true", help="torch.compile the SNAC decoder")
parser.add_argument("--out", type=Path, default=None)


def random_frames(count: int, seed: int) -> list[tuple[int, ...]]:
    rng = np.random.default_rng(seed)
    return [tuple(int(c) for c in rng.integers(0, 4096, 7)) for _ in range(count)]


def decode_window(snac: SnacDecoder, frames, first: int) -> np.ndarray:
    return snac.decode_frames(torch.tensor([frames]), torch.tensor([first]))[0].cpu().numpy()


def ours(snac: SnacDecoder, frames, *, max_hop: int = 4, context: int = 2) -> tuple[np.ndarray, int]:
    """Our planner, one stream, decoding as frames arrive. Returns (audio of frames 0..n-1, first-audio tokens)."""
    planner, audio, first_tokens = SnacWindowPlanner(context=context, max_hop=max_hop), [], None
    for i, frame in enumerate(frames):
        planner.push(frame)
        while (window := planner.next_window()) is not None:
            audio.append(window.kept(decode_window(snac, window.frames, window.first_frame)))
            first_tokens = first_tokens or 7 * (i + 1)
    while (window := planner.next_window(final=True)) is not None:
        audio.append(window.kept(decode_window(snac, window.frames, window.first_frame)))
    return np.concatenate(audio), first_tokens


def reference(snac: SnacDecoder, frames) -> np.ndarray:
    """canopyai/Orpheus-TTS decoder.py: after each frame (count > 27), decode the last 28 tokens, keep [2048:4096].

    It emits frames 1 .. n-3: never frame 0, never the last two.
    """
    audio = []
    for k in range(4, len(frames) + 1):
        audio.append(decode_window(snac, frames[k - 4 : k], k - 4)[SAMPLES_PER_FRAME : 2 * SAMPLES_PER_FRAME])
    return np.concatenate(audio)


def windowing(snac: SnacDecoder, seconds: float) -> list[dict]:
    count = round(seconds * SAMPLE_RATE / SAMPLES_PER_FRAME)
    frames = random_frames(count, seed=1)
    full = snac.decode_utterance(frames)
    rows = []

    def measure(name, run, emitted_frames: range, first_tokens):
        snac.decode_seconds, started = 0.0, time.perf_counter()
        audio = run()
        audio = audio[0] if isinstance(audio, tuple) else audio
        target = full[emitted_frames.start * SAMPLES_PER_FRAME : emitted_frames.stop * SAMPLES_PER_FRAME]
        emitted_seconds = len(audio) / SAMPLE_RATE
        rows.append(
            {
                "scheme": name,
                "frames_emitted": f"{len(emitted_frames)}/{count}",
                "first_audio_tokens": first_tokens,
                "decode_ms_per_audio_s": 1000 * snac.decode_seconds / emitted_seconds,
                "wall_s": time.perf_counter() - started,
                "max_abs_error": float(np.abs(audio - target).max()),
                "relative_error": float(np.linalg.norm(audio - target) / np.linalg.norm(target)),
            }
        )

    measure("reference (28-token window, keep [2048:4096])", lambda: reference(snac, frames), range(1, count - 2), 28)
    for hop in (1, 2, 4, 8):
        first = ours(snac, frames[:4], max_hop=hop)[1]
        measure(f"ours (context 2, hop ≤{hop})", lambda: ours(snac, frames, max_hop=hop), range(count), first)
    default = next(r for r in rows if r["scheme"] == "ours (context 2, hop ≤4)")
    for row in rows:
        row["compute_vs_ours"] = row["decode_ms_per_audio_s"] / default["decode_ms_per_audio_s"]
    return rows


async def batcher_throughput(snac: SnacDecoder, streams: int, frames_per_stream: int) -> dict:
    """`streams` utterances decoded at once through the shared batcher, frames arriving interleaved."""
    snac.batcher.stats.batch_sizes.clear()
    batches_before, items_before = snac.batcher.stats.batches, snac.batcher.stats.items
    waits: list[float] = []

    async def one(seed: int) -> int:
        planner, samples = SnacWindowPlanner(), 0
        for frame in random_frames(frames_per_stream, seed):
            planner.push(frame)
            for final in (False, True) if len(planner.frames) == frames_per_stream else (False,):
                while (window := planner.next_window(final=final)) is not None:
                    asked = time.perf_counter()
                    samples += len(await snac.decode(window))
                    waits.append(time.perf_counter() - asked)
            await asyncio.sleep(0)
        return samples

    started = time.perf_counter()
    samples = await asyncio.gather(*(one(seed) for seed in range(streams)))
    wall = time.perf_counter() - started
    batches = snac.batcher.stats.batches - batches_before
    audio_seconds = sum(samples) / SAMPLE_RATE
    return {
        "streams": streams,
        "audio_s": audio_seconds,
        "wall_s": wall,
        "x_realtime": audio_seconds / wall,
        "windows": snac.batcher.stats.items - items_before,
        "mean_batch": (snac.batcher.stats.items - items_before) / max(1, batches),
        "window_wait_p50_ms": 1000 * percentile(waits, 50),
        "window_wait_p95_ms": 1000 * percentile(waits, 95),
    }


def build_lm(spec: str, device: str):
    """(model, tokenizer) for `--lm`: the tiny test model, a random real-size Orpheus, or a checkpoint."""
    if spec == "tiny":
        return build_tiny_orpheus_lm().to(device), build_tiny_tokenizer()
    if spec == "random-3b":  # canopylabs/orpheus-3b-0.1-ft's architecture, random weights
        dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
        return build_random_orpheus_3b(device, dtype), build_tiny_tokenizer()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(spec, dtype="auto").to(device).eval()
    return model, AutoTokenizer.from_pretrained(spec)


async def orpheus_streams(engine: OrpheusEngine, streams: int) -> dict:
    """`streams` utterances at once: time to first audio and whether each keeps up with real time."""
    results = []

    async def one():
        started, first, samples = time.perf_counter(), None, 0
        async for pcm in engine.stream(TEXT):
            first = first or time.perf_counter() - started
            samples += len(pcm) // 2
        return first, samples / SAMPLE_RATE, time.perf_counter() - started

    results = await asyncio.gather(*(one() for _ in range(streams)))
    ttfb = [r[0] for r in results]
    # Audio after the first chunk, over the time it took: ≥ 1 means the stream never starves a player.
    speed = [(audio - SAMPLES_PER_FRAME / SAMPLE_RATE) / (total - first) for first, audio, total in results]
    return {
        "streams": streams,
        "ttfb_p50_ms": 1000 * percentile(ttfb, 50),
        "ttfb_p95_ms": 1000 * percentile(ttfb, 95),
        "x_realtime_min": min(speed),
        "x_realtime_p50": percentile(speed, 50),
        "tokens_per_s_p50": percentile(speed, 50) * TOKENS_PER_SECOND,
        "realtime_streams": sum(s >= 1.0 for s in speed),
    }


def table(rows: list[dict], columns: list[str]) -> None:
    def cell(value):
        return f"{value:.4g}" if isinstance(value, float) else str(value)

    widths = [max(len(c), *(len(cell(r[c])) for r in rows)) for c in columns]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    for row in rows:
        print("  ".join(cell(row[c]).ljust(w) for c, w in zip(columns, widths)))
    print()


async def main(args) -> None:
    snac = SnacDecoder(
        SNAC.from_pretrained(args.snac) if args.snac else build_random_snac(), device=args.device, max_batch=64,
        max_wait_ms=2.0, compile=args.compile,
    )  # fmt: skip
    decode_window(snac, random_frames(8, 0), 0)  # warm-up

    print(f"SNAC windowing on {args.device}: {args.seconds:.0f} s of identical codes, errors vs one full decode\n")
    windows = windowing(snac, args.seconds)
    table(windows, ["scheme", "frames_emitted", "first_audio_tokens", "decode_ms_per_audio_s", "compute_vs_ours", "max_abs_error", "relative_error"])

    batching = [
        await batcher_throughput(snac, int(n), args.batcher_frames) for n in args.batcher_streams.split(",")
    ]
    print(f"Batched SNAC decoding, {args.batcher_frames} frames per stream\n")
    table(batching, ["streams", "audio_s", "wall_s", "x_realtime", "mean_batch", "window_wait_p50_ms", "window_wait_p95_ms"])

    model, tokenizer = build_lm(args.lm, args.device)
    defaults = Settings(_env_file=None, tts_engine="orpheus")
    engine = OrpheusEngine(
        model, tokenizer, snac, voice=defaults.tts_voice, temperature=defaults.tts_temperature,
        top_p=defaults.tts_top_p, max_streams=128, kv_cache_tokens=1 << 17, max_batch_tokens=4096,
    )  # fmt: skip
    await engine.synthesize("Warm up.")
    streams = [await orpheus_streams(engine, int(n)) for n in args.streams.split(",")]
    print(f"Orpheus streams (LM: {args.lm}), text: {TEXT!r}\n")
    table(streams, ["streams", "ttfb_p50_ms", "ttfb_p95_ms", "x_realtime_min", "x_realtime_p50", "tokens_per_s_p50", "realtime_streams"])
    engine.generator.close()
    snac.close()

    out = args.out or Path("bench/results") / f"orpheus-{args.device.split(':')[0]}.json"
    write_json(
        out,
        {
            "command": command_line("bench.orpheus"),
            "snac": args.snac or "random real-size SNAC 24 kHz",
            "lm": args.lm,
            "windowing": windows,
            "batcher": batching,
            "streams": streams,
            "machine": machine_info(os.getloadavg()[0], device=args.device),
        },
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    asyncio.run(main(parser.parse_args()))
