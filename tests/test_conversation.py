"""Spoken conversations through the whole offline pipeline: VAD → turn → STT → LLM → TTS."""

import asyncio
import gc

import numpy as np
import pytest
import torch

from pipecat.processors.aggregators.llm_context import LLMContext

from frames.llm import TransformersLLMService
from frames.turn_taking import turn_models
from frames.turn_taking.turn_models import SharedSileroVADAnalyzer
from harness.local_session import LocalSession
from services.quantized_linear import Int8Linear
from services.llm import TransformersLLMEngine, load_model
from services.audio import without_leading_quiet
from services.stt import WhisperEngine
from services.tts_piper import PiperEngine
from harness.speech import heard_as, normalize, wer

BOT_RATE = 24000  # the pipeline's output rate


async def wait_for_reply(session: LocalSession, *, after: float, quiet: float = 1.5, timeout: float = 60.0):
    """Wait until the bot has spoken after `after` and then been quiet for `quiet` seconds."""
    await wait_for_speech(session, after=after)
    deadline = session.now() + timeout
    while session.now() < deadline:
        chunks = [c for c in session.played if c.started_at >= after]
        if session.now() - (chunks[-1].started_at + chunks[-1].seconds) > quiet:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"the bot's reply did not end within {timeout}s")


async def wait_for_speech(session: LocalSession, *, after: float, timeout: float = 20.0):
    """Wait until the bot starts speaking after `after`."""
    deadline = session.now() + timeout
    while not [c for c in session.played if c.started_at >= after]:
        assert session.now() < deadline, f"the bot did not start speaking within {timeout}s"
        await asyncio.sleep(0.05)


async def user_turn(session: LocalSession, say, text: str) -> tuple[float, bytes]:
    """Speak `text`, wait for the reply; returns (when the user stopped, bot audio of the reply)."""
    await session.speak(await say(text))
    ended = session.now()
    await wait_for_reply(session, after=ended)
    return ended, session.played_audio(start=ended)


def user_messages(session: LocalSession) -> list[str]:
    return [m["content"] for m in session.conversation.context.get_messages() if m["role"] == "user"]


async def check_two_turns(session: LocalSession, engines, say, turns: list[str]):
    llm = engines.llm.of(session.conversation)
    await session.silence(0.5)
    answered: list[tuple[list[dict], str]] = []  # each turn's prompt and reply (not withdrawn speculation)
    for i, text in enumerate(turns):
        _, bot_audio = await user_turn(session, say, text)
        # The user was understood.
        heard = user_messages(session)
        assert len(heard) == i + 1, heard
        assert wer(text, heard[i]) <= 0.25, (text, heard[i])
        # The LLM was asked with the transcript, and the bot spoke its reply.
        prompt = llm.prompts[-1]
        assert prompt[-1] == {"role": "user", "content": heard[i]}
        assert bot_audio, f"no bot audio for turn {i + 1}"
        spoken = await engines.stt.transcribe(bot_audio, BOT_RATE)
        assert heard_as(llm.replies[-1], spoken.text), (llm.replies[-1], spoken.text)
        answered.append((prompt, llm.replies[-1]))
    # The second turn's request carried the first exchange (a turn's last request is the one that
    # was answered: a withdrawn speculation comes before it).
    (_, first_reply), (second_prompt, _) = answered[:2]
    assert {"role": "user", "content": user_messages(session)[0]} in second_prompt
    # Compared word for word: the context joins the spoken sentences with single spaces.
    assert {"role": "assistant", "content": " ".join(first_reply.split())} in [
        {"role": m["role"], "content": " ".join(m["content"].split())} for m in second_prompt
    ]


async def test_two_turn_conversation(engines, settings, say):
    async with LocalSession(engines, settings) as session:
        await check_two_turns(
            session, engines, say, ["What is the capital of France?", "And what is the capital of Germany?"]
        )
    turns = session.turn_log.turns
    assert len(turns) == 2 and all(t.voice_to_voice and t.voice_to_voice > 0 for t in turns)


async def test_two_conversations_share_one_copy_of_each_model(engines, settings, say):
    started = engines.llm.stats.started
    loads = (WhisperEngine.loads, TransformersLLMEngine.loads, PiperEngine.loads)
    async with LocalSession(engines, settings) as a, LocalSession(engines, settings) as b:
        await asyncio.gather(
            check_two_turns(a, engines, say, ["How many legs does a spider have?", "And how many does a dog have?"]),
            check_two_turns(b, engines, say, ["Can you name a fruit that is yellow?", "What is the weather like in Paris today?"]),
        )
    # No conversation loads a model of its own. (The suite loads one other LLM, once: the
    # tool-calling model of tests/test_tools.py.)
    assert (WhisperEngine.loads, TransformersLLMEngine.loads, PiperEngine.loads) == loads
    for session in (a, b):
        assert session.conversation.stt._engine is engines.stt
        assert session.conversation.llm._engine is engines.llm
        assert session.conversation.tts._engine is engines.tts
    # Every request went to the one shared engine: at least one per turn, more when a pause
    # was answered speculatively and the speculation was withdrawn.
    requests = len(engines.llm.of(a.conversation).prompts) + len(engines.llm.of(b.conversation).prompts)
    assert requests >= 4
    assert engines.llm.stats.started - started == requests
    assert user_messages(a) != user_messages(b)


def trimmed(pcm: bytes) -> bytes:
    """Speech without the voice's leading and trailing silence."""
    samples = np.frombuffer(pcm, dtype=np.int16)
    loud = np.flatnonzero(np.abs(samples) > 300)
    return samples[loud[0] : loud[-1] + 1].tobytes()


async def test_a_turn_is_transcribed_in_the_users_pause_before_the_vad_stop(engines, settings, say):
    async with LocalSession(engines, settings) as session:
        stt = session.conversation.stt
        await session.silence(0.5)
        await session.speak(await say("What is the capital of France?"))
        ended = session.now()
        await session.silence(0.6)  # a microphone goes on sending: the quiet the VAD stops on
        await wait_for_reply(session, after=ended)
        # The transcription started in the pause was the turn's: none ran after the VAD stop.
        assert (stt.early_transcripts_used, stt.early_transcripts_dropped) == (1, 0)
        assert wer("What is the capital of France?", user_messages(session)[0]) <= 0.25, user_messages(session)


async def test_words_after_a_short_pause_are_not_lost_to_the_early_transcript(engines, settings, say):
    # A pause long enough to start a transcription, well short of the VAD's stop (0.4 s here, so
    # that how Silero's confidence falls and rises around the gap cannot turn it into a stop).
    slower_stop = settings.model_copy(update={"vad_stop_secs": 0.4})
    async with LocalSession(engines, slower_stop) as session:
        stt = session.conversation.stt
        await session.silence(0.5)
        await session.speak(trimmed(await say("How many legs")))
        await session.silence(0.2)
        await session.speak(trimmed(await say("does a spider have?")))
        ended = session.now()
        await session.silence(0.5)
        await wait_for_reply(session, after=ended)
        assert stt.early_transcripts_dropped >= 1  # the one from the pause: speech came after it
        assert stt.early_transcripts_used == 1  # the one from the end of the question
        heard = user_messages(session)
        assert len(heard) == 1 and wer("How many legs does a spider have?", heard[0]) <= 0.25, heard


def test_the_bundled_llm_decodes_on_the_int8_kernel(engines, settings):
    # The bundled GGUF is Q4_1: every layer but the output (tied to the 8-bit embeddings) is exactly
    # 4-bit after transformers de-quantizes it; all of them run on the int8 kernel. If that
    # changes, decoding takes about twice as long (services/quantized_linear.py).
    assert settings.llm_dtype == "auto" and settings.llm_device == "cpu"
    # The engine's model lives in its generation process: load it here the way that process does.
    model = load_model(engines.llm.source, device="cpu", dtype="auto", cpu_threads=settings.llm_cpu_threads)
    assert not any(type(m) is torch.nn.Linear for m in model.modules()), "layers left in fp32"
    assert sum(type(m) is Int8Linear for m in model.modules()) > 100
    assert type(model.lm_head) is Int8Linear
    assert model.get_input_embeddings().weight.dtype == torch.float32  # the lookup keeps its own copy


def test_the_voice_and_turn_models_let_their_threads_sleep(engines):
    # onnxruntime's threads spin-wait between operators by default: beside the LLM decoding on
    # the other core, Piper's first chunk took half as long again (services/onnx_sessions.py).
    SharedSileroVADAnalyzer()  # opens the process' Silero session, if no conversation has yet
    voice_and_turn_models = [engines.tts._voice.session, *turn_models._sessions.values()]  # noqa: SLF001
    assert len(voice_and_turn_models) >= 2
    for session in voice_and_turn_models:
        assert session.get_session_options().get_session_config_entry("session.intra_op.allow_spinning") == "0"


async def test_interruption_stops_audio_cancels_llm_and_cuts_context(engines, settings, say):
    # A long reply, so the LLM is still generating when the user cuts in.
    # With the short STT encoding on, to show which segments it is used for.
    long_reply = settings.model_copy(update={"llm_max_new_tokens": 400, "stt_short_encode": True})
    tried_short_before = engines.stt.short_encodes + engines.stt.fallbacks
    async with LocalSession(engines, long_reply) as session:
        await session.silence(0.5)
        await session.speak(await say("Tell me a very long story about a dragon and a brave knight."))
        asked = session.now()
        await wait_for_speech(session, after=asked)
        await asyncio.sleep(1.5)  # let it speak a little
        cancelled_before, finished_before = engines.llm.stats.cancelled, engines.llm.stats.finished
        generating = session.conversation.llm.generating
        # SmolLM2 sometimes loops, and the reply then ends itself early (SpokenReply): nothing is
        # left to cancel. How many requests had ended on their own when the user's turn began:
        turns_before = len(session.turn_log.user_turn_started_at)
        finished_at_cut_in = []

        async def note_the_cut_in():
            while len(session.turn_log.user_turn_started_at) == turns_before:
                await asyncio.sleep(0.005)
            finished_at_cut_in.append(engines.llm.stats.finished)

        watcher = asyncio.create_task(note_the_cut_in())
        full_window_before = engines.stt.full_window_encodes
        await session.speak(await say("Wait, stop. Tell me about cats instead."))
        await wait_for_speech(session, after=session.now())
    # The question, asked while the bot was silent, was encoded at its own length; the cut-in, heard
    # over the bot, on Whisper's full window (a short encoding writes words for a hum).
    assert engines.stt.short_encodes + engines.stt.fallbacks > tried_short_before
    assert engines.stt.full_window_encodes > full_window_before

    conversation = session.conversation
    cut_in = session.turn_log.user_turn_started_at[-1]
    # Audio that started after the cut-in, before any answer to it could exist.
    late = [c.started_at - cut_in for c in session.played if cut_in < c.started_at < cut_in + 1.0]
    assert not late or max(late) <= 0.3, f"bot audio went on {max(late):.2f}s after the user cut in"

    # The engine cancelled the unfinished request.
    if generating and finished_at_cut_in[0] == finished_before:  # the story was being generated still
        assert engines.llm.stats.cancelled > cancelled_before
    full_story = engines.llm.of(conversation).replies[0]
    assistant = [m["content"] for m in conversation.context.get_messages() if m["role"] == "assistant"]
    heard_story = assistant[0]
    assert 0 < len(heard_story) < len(full_story), (heard_story, full_story)
    # The context keeps the start of the reply, word for word ...
    assert normalize(full_story).startswith(normalize(heard_story)), (heard_story, full_story)
    # ... and as many words as were actually played (word timings are estimated: ±3 words).
    played = session.played_audio(start=asked, end=cut_in + 0.3)
    spoken = await engines.stt.transcribe(played, BOT_RATE)
    assert abs(len(spoken.text.split()) - len(heard_story.split())) <= 3, (heard_story, spoken.text)
    # And the conversation went on: the new question was heard and the bot answered it aloud.
    assert "cats" in user_messages(session)[-1].lower()
    assert "cats" in engines.llm.of(conversation).prompts[-1][-1]["content"].lower()


if __name__ == "__main__":
    pytest.main([__file__, "-x", "-q"])


async def test_a_reply_cancelled_while_it_pushes_text_leaves_the_batch_at_once(engines):
    # A barge-in cancels the reply wherever it is: also while it hands text downstream, not only
    # while it waits for the next token. Its request must leave the shared batch then, not whenever
    # the garbage collector gets to the abandoned stream (it kept generating, and the cancellation
    # was missing from the engine's count, in a CI run of the barge-in test above).
    pushing = asyncio.Event()

    class SlowDownstream(TransformersLLMService):
        async def _push_llm_text(self, text: str):
            pushing.set()
            await asyncio.Event().wait()  # a downstream that does not take the text

    llm = SlowDownstream(engines.llm, system_prompt=None, max_tokens=200)
    cancelled, in_flight = engines.llm.stats.cancelled, engines.llm.in_flight
    gc.disable()  # the cancellation must not depend on a collection
    try:
        reply = asyncio.create_task(llm._reply([{"role": "user", "content": "Tell me a story about a dragon."}], None))
        await asyncio.wait_for(pushing.wait(), 120)
        reply.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reply
        assert engines.llm.stats.cancelled == cancelled + 1
        assert engines.llm.in_flight == in_flight
    finally:
        gc.enable()


async def test_a_turn_split_at_a_pause_reaches_the_model_as_one_message(engines):
    # Smart-turn may end a turn at a pause ("Thank you." ... "That's all. Goodbye."); the withdrawn
    # reply leaves two user messages in the context, which the model is shown as the one they were.
    llm = TransformersLLMService(engines.llm, system_prompt=None)
    context = LLMContext(messages=[{"role": "user", "content": "Thank you."}, {"role": "user", "content": "That's all. Goodbye."}])
    messages, _ = await llm.chat_messages(context)
    assert [m for m in messages if m["role"] == "user"] == [{"role": "user", "content": "Thank you. That's all. Goodbye."}]


async def test_the_test_users_voice_says_a_line_the_same_way_every_time_and_the_agents_varies(engines):
    # The suite's user speaks without Piper's sampling noise, so that what Whisper makes of a line
    # does not change from run to run (a hum it read as "M-H-N." in one run was "and make sure"
    # in another); the agent keeps Piper's natural variation.
    repeatable = [await engines.tts.synthesize("Mhm.", repeatable=True) for _ in range(2)]
    varied = [await engines.tts.synthesize("Mhm.") for _ in range(2)]
    assert repeatable[0] == repeatable[1]
    assert varied[0] != varied[1]


async def test_the_voice_starts_at_its_first_sound_and_keeps_its_words(engines):
    # Piper opens a sentence with 20-60 ms of near-silence that a listener would wait through.
    text = "The largest planet is Jupiter."
    pcm = np.frombuffer(await engines.tts.synthesize(text, repeatable=True), np.int16).astype(np.float32)
    window = engines.tts.sample_rate // 100
    loudness = np.sqrt((pcm[: pcm.size // window * window].reshape(-1, window) ** 2).mean(axis=1))
    first_sound = int(np.argmax(loudness > 0.005 * loudness.max()))
    assert first_sound <= 2, f"{first_sound * 10} ms before the first sound"
    transcript = await engines.stt.transcribe(pcm.astype(np.int16).tobytes(), engines.tts.sample_rate)
    assert heard_as(text, transcript.text), transcript.text


def test_leading_quiet_is_cut_to_what_is_asked_for():
    rate = 16000
    sound = np.sin(np.arange(rate // 10) / 5).astype(np.float32)
    audio = np.concatenate([np.zeros(rate // 20, np.float32), sound])  # 50 ms of quiet, then sound
    assert without_leading_quiet(audio, rate, keep_secs=0.01, quiet=0.005).size == sound.size + rate // 100
    assert without_leading_quiet(sound, rate, keep_secs=0.01, quiet=0.005).size == sound.size
