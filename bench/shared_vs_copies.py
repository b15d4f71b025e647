"""Shared engines vs one model copy per session (CPU profile): memory per session and aggregate LLM tokens/s."""

import argparse
import asyncio
import datetime
import gc
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import AsyncExitStack
from pathlib import Path

import torch
from faster_whisper import WhisperModel
from loguru import logger
from transformers import AutoModelForCausalLM

from agent.config import Settings
from agent.engines import load_engines_warm
from harness.local_session import LocalSession
from bench.report import command_line, machine_info, process_memory_mb, write_json
from bench.waterfall import QUESTIONS as ASKED

QUESTIONS = [question for question, _ in ASKED]
from services.audio import pcm16_to_float
from services.stt import WHISPER_SAMPLE_RATE

MEMORY_FIELDS = ["rss", "pss", "anon", "file"]

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument(
    "--sessions", type=int, default=8, help="conversations, model copies and concurrent LLM requests (default 8)"
)
parser.add_argument(
    "--max-new-tokens", type=int, default=64, help="tokens each LLM request generates at most (default 64)"
)
parser.add_argument(
    "--out", type=Path, default=None, help="JSON results (default bench/results/shared-vs-copies-cpu.json)"
)


def memory_growth(before: dict, after: dict, per: int = 1) -> dict:
    return {k: (after[k] - before[k]) / per for k in MEMORY_FIELDS}


async def shared_session_memory(engines, settings, sessions: int) -> dict:
    """Memory growth per running conversation on the shared engines: Pipecat processors, VAD, smart-turn, context."""
    async with LocalSession(engines, settings) as first:  # one-time costs (imports, caches) are no session's
        await first.silence(1.0)
    gc.collect()
    before = process_memory_mb()
    async with AsyncExitStack() as stack:
        running = [await stack.enter_async_context(LocalSession(engines, settings)) for _ in range(sessions)]
        await asyncio.gather(*(session.silence(1.0) for session in running))  # VAD and smart-turn have run
        gc.collect()
        after = process_memory_mb()
    return memory_growth(before, after, sessions)


def whisper_copy_memory(settings: Settings, audio) -> dict:
    """Memory growth of one more faster-whisper model, used once (stock Pipecat WhisperSTTService: one per session)."""
    gc.collect()
    before = process_memory_mb()
    model = WhisperModel(settings.stt_model, device="cpu", compute_type=settings.stt_compute_type)
    segments, _ = model.transcribe(audio, language=settings.stt_language, beam_size=1)
    list(segments)  # transcription runs as the segments are read
    return memory_growth(before, process_memory_mb())


def load_llm_copies(path: str, dtype: torch.dtype, count: int, warm_ids: list[int], pad_token_id: int):
    """`count` separate copies of the LLM, each used once; returns them and the memory growth of each."""
    models, growth = [], []
    for _ in range(count):
        gc.collect()
        before = process_memory_mb()
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
        generate(model, warm_ids, 2, pad_token_id)
        growth.append(memory_growth(before, process_memory_mb()))
        models.append(model)
    return models, growth


def generate(model, prompt_ids: list[int], max_new_tokens: int, pad_token_id: int) -> list[int]:
    """Greedy generate() of one sequence, as a per-session transformers LLM would; returns the new ids."""
    ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        output = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=pad_token_id,
        )
    return output[0, ids.shape[1] :].tolist()


def copies_generation(models, prompts: list[list[int]], max_new_tokens: int, pad_token_id: int):
    """Every copy generates its session's reply at the same time, one thread each; returns (ids, seconds)."""
    start = threading.Barrier(len(models) + 1)

    def session(model, prompt_ids):
        start.wait()
        return generate(model, prompt_ids, max_new_tokens, pad_token_id)

    with ThreadPoolExecutor(max_workers=len(models)) as pool:
        futures = [pool.submit(session, model, prompt_ids) for model, prompt_ids in zip(models, prompts)]
        start.wait()
        started = time.perf_counter()
        outputs = [future.result() for future in futures]
        return outputs, time.perf_counter() - started


async def shared_generation(llm, prompts: list[list[int]], max_new_tokens: int):
    """Every session's request goes to the one engine's continuous batch at the same time; returns (ids, seconds)."""

    async def session(prompt_ids):
        ids = []
        async for new in llm.generator.stream(prompt_ids, max_new_tokens=max_new_tokens):
            ids += new
        return ids

    started = time.perf_counter()
    outputs = await asyncio.gather(*(session(prompt_ids) for prompt_ids in prompts))
    return outputs, time.perf_counter() - started


def print_comparison(rows: list[tuple]) -> None:
    """Rows of (what, shared, copies, advantage of sharing)."""
    fmt = lambda v, spec: format(v, spec) if v is not None else "-"  # noqa: E731
    print(f"{'':<34} {'shared engines':>15} {'copy per session':>17} {'sharing wins by':>16}")
    for what, shared, copies, advantage in rows:
        wins = fmt(advantage, "15.1f") + "x" if advantage else ""
        print(f"{what:<34} {fmt(shared, '15.1f'):>15} {fmt(copies, '17.1f'):>17} {wins:>16}")


async def main(args):
    # Greedy, so both sides should generate the same text.
    # The LLM in this process, as the copies are: the memory compared is this process'.
    settings = Settings(profile="cpu", device="cpu", llm_temperature=0.0, greeting="", llm_own_process=False)
    out = args.out or Path(__file__).parent / "results" / "shared-vs-copies-cpu.json"
    started = time.perf_counter()
    baseline = process_memory_mb()
    print("loading the shared engines (cpu profile) ...", flush=True)
    engines = await load_engines_warm(settings)
    engines_memory = memory_growth(baseline, process_memory_mb())
    print(f"engines loaded and warm: RSS +{engines_memory['rss']:.0f} MB", flush=True)
    llm = engines.llm
    try:
        questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(args.sessions)]
        prompts = [llm.encode_chat([{"role": "user", "content": q}]) for q in questions]
        tokenizer = llm.tokenizer
        pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        pcm = await engines.tts.synthesize(QUESTIONS[0])
        speech = pcm16_to_float(pcm, engines.tts.sample_rate, WHISPER_SAMPLE_RATE)

        print(f"{args.sessions} conversations on the shared engines ...", flush=True)
        session_memory = await shared_session_memory(engines, settings, args.sessions)
        print(f"{args.sessions} requests through the one LLM engine (continuous batching) ...", flush=True)
        shared_ids, shared_seconds = await shared_generation(llm, prompts, args.max_new_tokens)

        print("one more faster-whisper model ...", flush=True)
        whisper_memory = whisper_copy_memory(settings, speech)
        # The directory the engine loaded (the GGUF converted once under CACHE_DIR), so the copies are the same model.
        llm_path = llm.source
        print(f"{args.sessions} copies of the LLM from {llm_path} ...", flush=True)
        models, llm_memory = load_llm_copies(llm_path, torch.float32, args.sessions, prompts[0], pad_token_id)
        print(f"{args.sessions} generate() calls at once, one thread and one copy each ...", flush=True)
        copies_ids, copies_seconds = copies_generation(models, prompts, args.max_new_tokens, pad_token_id)
    finally:
        engines.close()
    run_seconds = time.perf_counter() - started

    llm_copy_memory = {k: sum(g[k] for g in llm_memory) / len(llm_memory) for k in MEMORY_FIELDS}
    copy_session_memory = {k: whisper_memory[k] + llm_copy_memory[k] + session_memory[k] for k in MEMORY_FIELDS}
    shared_tokens, copies_tokens = sum(map(len, shared_ids)), sum(map(len, copies_ids))
    shared_rate, copies_rate = shared_tokens / shared_seconds, copies_tokens / copies_seconds
    memory_ratio = {
        k: copy_session_memory[k] / session_memory[k] if session_memory[k] > 0 else None for k in ("rss", "pss")
    }
    same_text = sum(a == b for a, b in zip(shared_ids, copies_ids))

    load = os.getloadavg()[0]
    print(f"\n{args.sessions} sessions, {args.max_new_tokens} new tokens at most per request, "
          f"{torch.get_num_threads()} torch threads, load average {load:.2f}")
    print_comparison(
        [
            ("memory per session, MB RSS", session_memory["rss"], copy_session_memory["rss"], memory_ratio["rss"]),
            ("  STT model copy", None, whisper_memory["rss"], None),
            ("  LLM model copy", None, llm_copy_memory["rss"], None),
            ("  conversation (pipeline) state", session_memory["rss"], session_memory["rss"], None),
            ("memory per session, MB PSS", session_memory["pss"], copy_session_memory["pss"], memory_ratio["pss"]),
            ("  STT model copy", None, whisper_memory["pss"], None),
            ("  LLM model copy", None, llm_copy_memory["pss"], None),
            ("  conversation (pipeline) state", session_memory["pss"], session_memory["pss"], None),
            (f"LLM tokens/s, {args.sessions} at once", shared_rate, copies_rate, shared_rate / copies_rate),
            ("  tokens generated", shared_tokens, copies_tokens, None),
            ("  wall seconds", shared_seconds, copies_seconds, None),
        ]
    )
    print(f"identical greedy outputs: {same_text}/{args.sessions}")
    print(f"LLM copy RSS: {llm_copy_memory['anon']:.0f} MB anonymous + {llm_copy_memory['file']:.0f} MB file-backed; "
          "weights mapped from the same checkpoint file are one copy in RAM, which PSS shows and RSS does not")

    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command_line("bench.shared_vs_copies"),
        "machine": machine_info(load),
        "models": {"stt": settings.stt_model, "llm": settings.llm_model, "llm_checkpoint": llm_path},
        "settings": settings.model_dump(mode="json"),  # secrets dump as "**********"
        "run": {"sessions": args.sessions, "max_new_tokens": args.max_new_tokens, "seconds": run_seconds},
        "memory_mb": {
            "shared_engines_loaded": engines_memory,
            "shared_per_session": session_memory,
            "whisper_copy": whisper_memory,
            "llm_copy_mean": llm_copy_memory,
            "llm_copies": llm_memory,
            "copies_per_session": copy_session_memory,
            "copies_over_shared_per_session": memory_ratio,  # rss and pss
        },
        "llm_throughput": {
            "shared_tokens": shared_tokens,
            "shared_seconds": shared_seconds,
            "shared_tokens_per_second": shared_rate,
            "copies_tokens": copies_tokens,
            "copies_seconds": copies_seconds,
            "copies_tokens_per_second": copies_rate,
            "shared_over_copies": shared_rate / copies_rate,
            "identical_outputs": same_text,
        },
        "definitions": {
            "shared_per_session": "memory growth per running LocalSession on the shared engines (after a first, "
            "uncounted session), each having heard 1 s of silence",
            "copies_per_session": "whisper_copy + llm_copy_mean + shared_per_session: a session with its own "
            "models still has its own pipeline; the TTS voice is shared on both sides",
            "rss_pss": "RSS counts every mapping of a file page; PSS splits a page mapped k times into k shares, "
            "so it is the physical memory added (see process_memory_mb)",
            "whisper_copy": "memory growth of WhisperModel(stt_model) plus one transcription",
            "llm_copy_mean": "memory growth of AutoModelForCausalLM.from_pretrained(converted checkpoint) "
            "plus one generate(), mean over the copies",
            "tokens_per_second": "generated ids of all requests / wall time from the start of all to the end of "
            "the last; shared: the engine's continuous batch; copies: model.generate() in one thread per copy",
        },
    }
    write_json(out, result)
    print(f"\nwrote {out}", flush=True)


if __name__ == "__main__":
    logger.remove()
    logger.add(sys.stderr, level="WARNING")  # pipecat logs every frame at DEBUG
    asyncio.run(main(parser.parse_args()))
