"""Orpheus TTS: exact token parsing, streamed SNAC equal to a full decode, cross-stream batching, cancellation, loading."""

import asyncio
import threading
from contextlib import aclosing

import numpy as np
import pytest
import torch

from agent.config import Settings
from agent.engines import Engines, load_tts
from harness.local_session import LocalSession
from services.batcher import DynamicBatcher
from services.orpheus.by_language import OrpheusByLanguage
from services.orpheus.engine import OrpheusEngine
from services.orpheus.text import max_new_tokens_for, normalize_text, prompt_ids, split_for_speech
from services.orpheus.tokens import AUDIO_BASE, END_OF_HUMAN, END_OF_SPEECH, END_OF_TEXT, START_OF_AI, START_OF_HUMAN, START_OF_SPEECH, OrpheusCodeMask, OrpheusTokenParser, audio_token
from services.orpheus.snac import SAMPLES_PER_FRAME, SnacDecoder, SnacWindowPlanner
from harness.orpheus_models import build_random_snac, build_tiny_orpheus_lm, build_tiny_tokenizer, save_tiny_orpheus
from tests.test_conversation import wait_for_speech


@pytest.fixture(scope="module")
def snac() -> SnacDecoder:
    decoder = SnacDecoder(build_random_snac(seed=0), device="cpu", max_batch=16, max_wait_ms=5)
    yield decoder
    decoder.close()


@pytest.fixture(scope="module")
def orpheus(snac) -> OrpheusEngine:
    defaults = Settings(_env_file=None, tts_engine="orpheus")
    engine = OrpheusEngine(
        build_tiny_orpheus_lm(),
        build_tiny_tokenizer(),
        snac,
        voice=defaults.tts_voice,
        temperature=defaults.tts_temperature,
        top_p=defaults.tts_top_p,
        max_streams=defaults.tts_max_streams,
        kv_cache_tokens=8192,
        max_batch_tokens=512,
    )
    yield engine
    engine.generator.close()


def random_frames(count: int, seed: int) -> list[tuple[int, ...]]:
    rng = np.random.default_rng(seed)
    frames = [tuple(int(c) for c in rng.integers(0, 4096, 7)) for _ in range(count)]
    frames[0] = (0,) * 7  # code 0 everywhere in frame 0: the reference decoder would drop it
    return frames


def frame_tokens(frames) -> list[int]:
    return [audio_token(p, code) for frame in frames for p, code in enumerate(frame)]


# --- Token parser ----------------------------------------------------------------------------


def test_parser_keeps_code_zero_and_reads_every_token_of_a_step():
    frames = random_frames(3, seed=1)
    parser = OrpheusTokenParser()
    tokens = frame_tokens(frames)
    # One step brings 10 tokens, the next 11 (a fast engine step or a network chunk).
    assert parser.feed(tokens[:10]) == frames[:1]
    assert parser.feed(tokens[10:]) == frames[1:]
    assert (parser.misplaced, parser.skipped, parser.rejected) == (0, 0, 0)


def test_parser_drops_the_broken_frame_and_resyncs_at_the_next_frame_start():
    frames = random_frames(3, seed=2)
    tokens = frame_tokens(frames)
    # Frame 1 loses its position-3 token: positions 4, 5, 6 arrive where 3, 4, 5 belong.
    broken = tokens[:7] + tokens[7:10] + tokens[11:14] + tokens[14:]
    parser = OrpheusTokenParser()
    assert parser.feed(broken) == [frames[0], frames[2]]
    assert parser.misplaced == 1
    assert parser.skipped == 3 + 3  # the partial frame 1, then its tokens at positions 4, 5 and 6


def test_parser_rejects_ids_outside_the_audio_range_and_stops_at_end_of_speech():
    frames = random_frames(2, seed=3)
    tokens = frame_tokens(frames)
    parser = OrpheusTokenParser()
    out = parser.feed([128000, *tokens[:7], AUDIO_BASE + 7 * 4096, 42, *tokens[7:], END_OF_SPEECH, *tokens[:7]])
    assert out == frames
    assert parser.rejected == 3 and parser.finished
    assert parser.feed(tokens[:7]) == []  # nothing after the end


def test_code_mask_allows_only_the_next_position_and_ends_only_at_a_frame_boundary():
    mask = OrpheusCodeMask()
    last = torch.tensor([START_OF_SPEECH, audio_token(0, 5), audio_token(6, 0), audio_token(3, 4095)])
    scores = mask(last, torch.zeros(4, 156940))
    allowed = [torch.nonzero(row > float("-inf")).flatten() for row in scores]
    expected_positions = [0, 1, 0, 4]
    for row, position in zip(allowed, expected_positions):
        codes = row[row != END_OF_SPEECH] - AUDIO_BASE
        assert codes.min() == 4096 * position and codes.max() == 4096 * position + 4095 and len(codes) == 4096
    assert [END_OF_SPEECH in row for row in allowed] == [False, False, True, False]


# --- Text ------------------------------------------------------------------------------------


def test_text_normalisation_and_prompt_layout():
    assert normalize_text("I have 3 apples!!! Really?!") == "I have three apples! Really?"
    assert normalize_text("**Bold** 1,250 people, 50% of them <laugh> ok") == (
        "Bold one thousand, two hundred and fifty people, fifty percent of them <laugh> ok."
    )
    assert normalize_text("Well... <sigh>") == "Well. <sigh>"
    assert normalize_text("<b>hi</b> there") == "hi there."
    tokenizer = build_tiny_tokenizer()
    ids = prompt_ids(tokenizer, "leah", "Hi.")
    assert ids[0] == START_OF_HUMAN and ids[-4:] == [END_OF_TEXT, END_OF_HUMAN, START_OF_AI, START_OF_SPEECH]
    assert tokenizer.decode(ids[1:-4], skip_special_tokens=True) == "leah: Hi."


def test_long_text_is_chunked_at_sentences_with_a_length_derived_budget():
    sentence = "This sentence has exactly eight words in it. "
    chunks = split_for_speech((sentence * 20).strip(), max_chars=100)
    assert all(len(c) <= 100 and c.endswith(".") for c in chunks)
    assert " ".join(chunks) == (sentence * 20).strip()
    run_on = "word, " * 60
    assert all(len(c) <= 100 for c in split_for_speech(run_on.strip(), max_chars=100))
    short, long = max_new_tokens_for("Hi."), max_new_tokens_for(sentence * 4)
    assert short % 7 == 0 and long % 7 == 0
    # Enough for slow speech (2 words/s), nowhere near a runaway minute.
    assert 32 / 2 * 82 < long < 60 * 82 and short < long


# --- SNAC streaming ----------------------------------------------------------------------------


def stream_alone(snac: SnacDecoder, frames) -> tuple[np.ndarray, list[int]]:
    """Decode as tokens arrive, one window at a time without the batcher; also report when audio came out."""
    planner = SnacWindowPlanner()
    audio, tokens_at_output = [], []
    for i, frame in enumerate(frames):
        planner.push(frame)
        while (window := planner.next_window()) is not None:
            out = snac.decode_frames(torch.tensor([window.frames]), torch.tensor([window.first_frame]))
            audio.append(window.kept(out[0].numpy()))
            tokens_at_output.append(7 * (i + 1))
    while (window := planner.next_window(final=True)) is not None:
        out = snac.decode_frames(torch.tensor([window.frames]), torch.tensor([window.first_frame]))
        audio.append(window.kept(out[0].numpy()))
    return np.concatenate(audio), tokens_at_output


def relative_error(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("count", [1, 2, 5, 23])
def test_streamed_decode_equals_full_decode(snac, count):
    frames = random_frames(count, seed=count)
    streamed, tokens_at_output = stream_alone(snac, frames)
    full = snac.decode_utterance(frames)
    assert len(streamed) == len(full) == count * SAMPLES_PER_FRAME  # frame 0 and the tail included
    assert relative_error(streamed, full) <= 1e-3
    if count >= 3:
        assert tokens_at_output[0] == 21  # frame 0 is out after 3 frames of tokens


async def test_concurrent_streams_through_the_batcher_equal_each_stream_alone(snac):
    streams = [random_frames(n, seed=100 + n) for n in (9, 14, 17, 22)]
    batches_before = snac.batcher.stats.batches

    async def stream_batched(frames):
        planner, audio = SnacWindowPlanner(), []
        for frame in frames:
            planner.push(frame)
            while (window := planner.next_window()) is not None:
                audio.append(await snac.decode(window))
            await asyncio.sleep(0)  # tokens of all streams arrive interleaved
        while (window := planner.next_window(final=True)) is not None:
            audio.append(await snac.decode(window))
        return np.concatenate(audio)

    batched = await asyncio.gather(*(stream_batched(frames) for frames in streams))
    sizes = snac.batcher.stats.batch_sizes
    assert max(sizes) > 1 and snac.batcher.stats.batches > batches_before
    for frames, audio in zip(streams, batched):
        alone, _ = stream_alone(snac, frames)
        assert len(audio) == len(alone)
        np.testing.assert_allclose(audio, alone, rtol=0, atol=1e-5)


async def test_batcher_drops_the_queued_items_of_a_caller_that_stops_waiting():
    gate, seen = threading.Event(), []

    def run(items):
        gate.wait(5)
        seen.extend(items)
        return items

    batcher = DynamicBatcher(run, max_batch=1, max_wait_ms=0)
    first = asyncio.create_task(batcher.submit("running"))
    await asyncio.sleep(0.05)  # the worker is now blocked inside run(["running"])
    doomed = asyncio.create_task(batcher.submit("cut off"))
    kept = asyncio.create_task(batcher.submit("other stream"))
    await asyncio.sleep(0.05)
    doomed.cancel()
    await asyncio.sleep(0.05)
    gate.set()
    assert await first == "running" and await kept == "other stream"
    assert seen == ["running", "other stream"] and batcher.stats.dropped == 1
    batcher.close()


# --- The engine ------------------------------------------------------------------------------


async def test_engine_streams_exact_frames_from_generated_tokens(orpheus):
    before = orpheus.stats.frames
    pcm = await orpheus.synthesize("Hello there.")
    frames = orpheus.stats.frames - before
    assert frames > 3 and len(pcm) == frames * SAMPLES_PER_FRAME * 2  # every frame, as PCM16
    # The code mask keeps a sampled stream on the frame grid.
    assert (orpheus.stats.misplaced_tokens, orpheus.stats.rejected_tokens) == (0, 0)
    assert orpheus.in_flight == 0


async def test_cancelling_streams_stops_their_generation_and_leaves_others_whole(orpheus):
    """One stream's task is cancelled (what Pipecat does on barge-in), one is cancelled by id."""
    cancelled_before = orpheus.generator.stats.cancelled
    started = {"task": asyncio.Event(), "by id": asyncio.Event()}
    chunks_after_cancel = []

    async def cut_off(how: str):
        cancelled_at = None
        async for _ in orpheus.stream("This one is cut off after its first audio arrives.", request_id=how):
            started[how].set()
            if cancelled_at is None and how == "by id":
                orpheus.cancel(how)
                cancelled_at = len(chunks_after_cancel)
            elif cancelled_at is not None:
                chunks_after_cancel.append(how)

    victims = [asyncio.create_task(cut_off(how)) for how in started]
    survivor = asyncio.create_task(orpheus.synthesize("This one plays to the end."))
    await asyncio.wait_for(asyncio.gather(*(event.wait() for event in started.values())), timeout=60)
    victims[0].cancel()
    with pytest.raises(asyncio.CancelledError):
        await victims[0]
    await asyncio.wait_for(victims[1], timeout=10)  # ended by itself, at once
    # At most the window already being decoded comes out after cancel(); no generation continues.
    assert len(chunks_after_cancel) <= 1
    assert orpheus.generator.stats.cancelled == cancelled_before + 2
    assert orpheus.in_flight == 1  # only the survivor is still generating
    pcm = await asyncio.wait_for(survivor, timeout=120)
    assert len(pcm) % (SAMPLES_PER_FRAME * 2) == 0 and len(pcm) > 0
    assert orpheus.in_flight == 0 and orpheus.stats.misplaced_tokens == 0


async def test_barge_in_cancels_orpheus_in_a_conversation(engines, settings, say, orpheus):
    """A conversation speaking through Orpheus: the user cuts in, its TTS request leaves the batch."""
    with_orpheus = Engines(stt=engines.stt, llm=engines.llm, tts=orpheus, ready=True)
    long_reply = settings.model_copy(update={"llm_max_new_tokens": 200})
    cancelled_before = orpheus.generator.stats.cancelled
    async with LocalSession(with_orpheus, long_reply) as session:
        await session.silence(0.5)
        await session.speak(await say("Tell me a very long story about a dragon and a brave knight."))
        await wait_for_speech(session, after=session.now(), timeout=60)
        await session.speak(await say("Wait, stop. Tell me about cats instead."))
        for _ in range(100):
            if orpheus.generator.stats.cancelled > cancelled_before:
                break
            await asyncio.sleep(0.05)
        assert orpheus.generator.stats.cancelled > cancelled_before


# --- Loading ---------------------------------------------------------------------------------


async def test_real_weight_loading_path(tmp_path):
    """Save a checkpoint laid out like the hub repos, load it with the call used for hub ids."""
    lm_dir, snac_dir = save_tiny_orpheus(tmp_path)
    settings = Settings(
        _env_file=None, tts_engine="orpheus", orpheus_model=str(lm_dir), snac_model=str(snac_dir), tts_voice="zoe"
    )
    engine = load_tts(settings)
    try:
        assert isinstance(engine, OrpheusEngine) and engine.voice == "zoe"
        # The weights are the saved ones: same decode as the in-memory model (weight norm folded).
        reference = SnacDecoder(build_random_snac(seed=0), device="cpu", max_batch=1, max_wait_ms=0)
        frames = random_frames(4, seed=9)
        np.testing.assert_allclose(
            engine.snac.decode_utterance(frames), reference.decode_utterance(frames), atol=1e-5
        )
        reference.close()
        original = build_tiny_orpheus_lm().model.embed_tokens.weight
        assert torch.equal(engine.model.model.embed_tokens.weight, original)
        pcm = await engine.synthesize("Hi.")
        assert len(pcm) > 0 and len(pcm) % (SAMPLES_PER_FRAME * 2) == 0
    finally:
        engine.close()


async def test_a_model_per_language_loaded_by_path_on_one_snac(tmp_path):
    """ORPHEUS_MODELS: two saved checkpoints (en, fr) through load_tts; each voice runs on its language's model."""
    en_dir, snac_dir = save_tiny_orpheus(tmp_path)
    fr_dir = tmp_path / "orpheus-fr"
    build_tiny_orpheus_lm(seed=1).save_pretrained(fr_dir)
    build_tiny_tokenizer().save_pretrained(fr_dir)
    settings = Settings(
        _env_file=None, tts_engine="orpheus", device="cpu", orpheus_model=str(en_dir), orpheus_models=f"fr={fr_dir}",
        snac_model=str(snac_dir), tts_voices="en=tara,fr=pierre", tts_kv_cache_tokens=4096,
    )  # fmt: skip
    assert settings.orpheus_model_by_language == {"fr": str(fr_dir)}
    snac_loads, lm_loads = SnacDecoder.loads, OrpheusEngine.loads
    engine = load_tts(settings)
    try:
        assert isinstance(engine, OrpheusByLanguage)
        en, fr = engine.default, engine.by_language["fr"]
        assert (SnacDecoder.loads - snac_loads, OrpheusEngine.loads - lm_loads) == (1, 2)
        assert en.snac is fr.snac is engine.snac
        assert Engines(stt=None, llm=None, tts=engine).batchers() == {"snac": engine.snac.batcher}
        # Each model is the one saved in its own directory.
        assert en.model.name_or_path == str(en_dir) and fr.model.name_or_path == str(fr_dir)
        assert torch.equal(en.model.model.embed_tokens.weight, build_tiny_orpheus_lm(seed=0).model.embed_tokens.weight)
        assert torch.equal(fr.model.model.embed_tokens.weight, build_tiny_orpheus_lm(seed=1).model.embed_tokens.weight)
        assert (en.voice, fr.voice, fr.lang) == ("tara", "pierre", "fr") and engine.voice == "tara"
        assert "/" not in engine.name  # /health shows voices, never paths

        # "pierre" streams on the French model, "tara" (and a voice TTS_VOICES does not name) on the English one.
        for voice, runs_on, idle in (("pierre", fr, en), ("tara", en, fr), ("zoe", en, fr)):
            started, idle_started = runs_on.generator.stats.started, idle.generator.stats.started
            async with aclosing(engine.stream("Hi.", voice=voice)) as audio:
                async for _ in audio:
                    assert (runs_on.in_flight, idle.in_flight, engine.in_flight) == (1, 0, 1)
                    break
            assert runs_on.generator.stats.started == started + 1 and idle.generator.stats.started == idle_started
            assert engine.in_flight == 0  # closing the stream cancelled its request

        # Cancelling the French stream by id stops it and leaves the English one whole.
        cancelled = fr.generator.stats.cancelled
        first_audio, chunks = asyncio.Event(), []

        async def french():
            text = "Bonjour, ceci est coupé après le premier son."
            async for pcm in engine.stream(text, voice="pierre", request_id="fr-1"):
                chunks.append(pcm)
                first_audio.set()

        cut = asyncio.create_task(french())
        english = asyncio.create_task(engine.synthesize("Hello there, this one plays to the very end.", voice="tara"))
        await asyncio.wait_for(first_audio.wait(), timeout=60)
        assert (fr.in_flight, en.in_flight) == (1, 1)
        engine.cancel("fr-1")
        cancelled_at = len(chunks)
        assert fr.in_flight == 0 and en.in_flight == 1
        await asyncio.wait_for(cut, timeout=10)  # ended by itself, at once
        assert len(chunks) - cancelled_at <= 1  # at most the window already being decoded
        assert fr.generator.stats.cancelled == cancelled + 1
        pcm = await asyncio.wait_for(english, timeout=120)
        assert len(pcm) > 0 and len(pcm) % (SAMPLES_PER_FRAME * 2) == 0
        assert engine.in_flight == 0 and en.stats.misplaced_tokens == fr.stats.misplaced_tokens == 0
    finally:
        engine.close()
    # A language with a model but no voice could never be reached: refused before anything loads.
    with pytest.raises(ValueError, match="no voice"):
        load_tts(settings.model_copy(update={"orpheus_models": f"de={fr_dir}"}))
