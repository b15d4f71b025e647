"""Turn-taking scenarios on the offline pipeline, real models and Piper speech: when the agent speaks, stops and goes on."""

import asyncio

import numpy as np
import pytest

from harness.local_session import LocalSession
from tests.scenarios.microphone import RATE, Microphone, noise_burst, samples, without_quiet_ends
from harness.speech import normalize, wer

LONG_QUESTION = "Tell me a long story about a dragon and a brave knight."
STOP_WITHIN = 0.3  # seconds from the user's first sound to the end of the agent's audio
FIGURES: dict[str, dict] = {}  # per-scenario figures, printed at the end of the module


@pytest.fixture(scope="module", autouse=True)
def report():
    yield
    print("\nturn-taking scenarios:")
    for name, figures in FIGURES.items():
        print(f"  {name}: " + ", ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in figures.items()))


@pytest.fixture
def long_replies(settings):
    return settings.model_copy(update={"llm_max_new_tokens": 160})


@pytest.fixture
def speakerphone(long_replies):
    """A user on a speakerphone: the agent cancels its own echo."""
    return long_replies.model_copy(update={"echo_cancellation": True})


def spans(session: LocalSession, after: float = 0.0, gap: float = 0.15) -> list[tuple[float, float]]:
    """Stretches of agent audio (start, end) on the pipeline clock, pauses shorter than `gap` joined."""
    joined: list[list[float]] = []
    for chunk in session.played:
        if chunk.started_at < after:
            continue
        end = chunk.started_at + chunk.seconds
        if joined and chunk.started_at - joined[-1][1] < gap:
            joined[-1][1] = max(joined[-1][1], end)
        else:
            joined.append([chunk.started_at, end])
    return [(a, b) for a, b in joined]


async def until(condition, timeout: float, what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        assert loop.time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def wait_until_talking(session: LocalSession, after: float, timeout: float = 40.0) -> float:
    await until(lambda: spans(session, after), timeout, "the agent to speak")
    return spans(session, after)[0][0]


async def wait_until_quiet(session: LocalSession, after: float, quiet: float = 2.5, timeout: float = 90.0) -> None:
    """Until the agent has spoken after `after` and then said nothing for `quiet` seconds."""
    await wait_until_talking(session, after, timeout)
    await until(lambda: session.now() - spans(session, after)[-1][1] > quiet, timeout, "the agent to finish")


def onset(audio: np.ndarray, start: float, threshold: float = 500.0) -> float:
    """Pipeline time of the first 10 ms of `audio` (played from `start`) louder than `threshold` RMS."""
    frames = audio[: audio.size // 160 * 160].reshape(-1, 160)
    loud = np.nonzero(np.sqrt((frames**2).mean(axis=1)) > threshold)[0]
    return start + float(loud[0]) * 0.01


def stop_delay(session: LocalSession, at: float) -> float:
    """Seconds from `at` until the agent's audio that was playing at `at` ended."""
    for start, end in spans(session, gap=0.05):
        if end >= at:
            return max(0.0, end - at) if start <= at else 0.0
    return 0.0


def assistant_messages(session: LocalSession) -> list[str]:
    return [m["content"] for m in session.conversation.context.get_messages() if m["role"] == "assistant"]


def user_messages(session: LocalSession) -> list[str]:
    return [m["content"] for m in session.conversation.context.get_messages() if m["role"] == "user"]


async def start_long_reply(mic: Microphone, say) -> float:
    """Ask for a story; returns when the agent started telling it, after it has talked for a second."""
    await mic.silence(0.3)
    _, asked = await mic.play(await say(LONG_QUESTION))
    started = await wait_until_talking(mic.session, asked)
    await mic.silence(1.0)
    return started


async def check_reply_goes_on(session: LocalSession, engines, say, sound: np.ndarray, name: str):
    """Play `sound` over the agent's story: the story must go on to its end, whole, in the context."""
    mic = Microphone(session)
    started = await start_long_reply(mic, say)
    # Counted from here: smart-turn sometimes finds the question unfinished, and the stop watchdog
    # then withdraws the speculative reply (a cancellation that has nothing to do with the sound).
    cancelled = engines.llm.stats.cancelled
    sound_at, _ = await mic.play(sound)
    await mic.silence(2.0)
    resumed = [s for s in spans(session, sound_at) if s[0] > sound_at]
    await wait_until_quiet(session, started)
    conversation = session.conversation
    gap = max((b[0] - a[1] for a, b in zip(spans(session, started), spans(session, started)[1:])), default=0.0)
    FIGURES[name] = {"pauses": conversation.playback.pauses, "longest_gap_s": gap}
    heard = [t.text for t in session.turn_log.transcripts]  # what the STT made of each segment
    assert engines.llm.stats.cancelled == cancelled, f"the reply was cancelled; heard {heard}"
    assert len(user_messages(session)) == 1, (user_messages(session), heard)
    # The whole story was played and is in the context, and the agent did not go quiet on the way.
    assert normalize(assistant_messages(session)[-1]) == normalize(engines.llm.of(conversation).replies[-1])
    assert gap < 2.0, f"the agent went quiet for {gap:.2f}s"
    return sound_at, resumed


async def test_1_a_normal_turn_gets_a_reply(engines, settings, say):
    async with LocalSession(engines, settings) as session:
        mic = Microphone(session)
        await mic.silence(0.3)
        question = "What is the capital of France?"
        _, ended = await mic.play(await say(question))
        first_audio = await wait_until_talking(session, ended)
        await wait_until_quiet(session, ended)
    FIGURES["1 normal turn"] = {"voice_to_voice_s": first_audio - ended}
    assert wer(question, user_messages(session)[0]) <= 0.25
    assert "paris" in normalize(assistant_messages(session)[0])


async def test_2_a_pause_mid_number_gets_no_reply_before_the_end(engines, settings, say):
    async with LocalSession(engines, settings) as session:
        mic = Microphone(session)
        await mic.silence(0.3)
        _, paused_at = await mic.play(await say("My phone number is five five five,"))
        await mic.silence(0.6)
        _, ended = await mic.play(await say("one two three four."))
        await wait_until_quiet(session, ended)
        early = spans(session, paused_at)[0][0] < ended
    FIGURES["2 pause mid-number"] = {"replies": len(assistant_messages(session))}
    assert not early, "the agent answered during the pause"
    # One answer, to the whole number (Whisper may cut the number into two user messages).
    assert len(assistant_messages(session)) == 1, session.conversation.context.get_messages()
    assert digits(" ".join(user_messages(session))) == "5551234", user_messages(session)


def digits(text: str) -> str:
    names = {"one": "1", "two": "2", "three": "3", "four": "4", "five": "5"}
    return "".join(names.get(w, w) for w in normalize(text).split() if w in names or w.isdigit())


async def test_3_mhm_while_the_agent_speaks_does_not_stop_it(engines, long_replies, say):
    async with LocalSession(engines, long_replies) as session:
        await check_reply_goes_on(session, engines, say, samples(await say("Mhm.")), "3 mhm")


async def test_4_a_cough_while_the_agent_speaks_does_not_stop_it(engines, long_replies, say):
    async with LocalSession(engines, long_replies) as session:
        await check_reply_goes_on(session, engines, say, noise_burst(0.35), "4 cough")


async def test_5_stop_and_a_new_question_stops_the_agent_fast(engines, long_replies, say):
    async with LocalSession(engines, long_replies) as session:
        mic = Microphone(session)
        await start_long_reply(mic, say)
        cut_in = samples(await say("Stop, wait, I have another question. What is the capital of Germany?"))
        start, ended = await mic.play(cut_in)
        user_onset = onset(cut_in, start)
        await wait_until_quiet(session, ended)
    stopped = stop_delay(session, user_onset)
    FIGURES["5 stop"] = {"stopped_after_s": stopped}
    assert stopped <= STOP_WITHIN, f"agent audio went on {stopped:.2f}s after the user cut in"
    assert "germany" in normalize(user_messages(session)[-1])
    assert "berlin" in normalize(assistant_messages(session)[-1])


async def test_6_its_own_echo_does_not_interrupt_the_agent(engines, speakerphone, say):
    async with LocalSession(engines, speakerphone) as session:
        mic = Microphone(session, echo_db=-6.0, echo_delay=0.06)
        cancelled = engines.llm.stats.cancelled
        await mic.silence(0.3)
        _, asked = await mic.play(await say(LONG_QUESTION))
        await wait_until_talking(session, asked)
        while session.now() - spans(session, asked)[-1][1] < 2.5:  # the whole reply, echoing back
            await mic.silence(0.5)
    playback = session.conversation.playback
    FIGURES["6 echo"] = {"pauses": playback.pauses, "reply_s": spans(session, asked)[-1][1] - spans(session, asked)[0][0]}
    assert engines.llm.stats.cancelled == cancelled and len(user_messages(session)) == 1, user_messages(session)
    # The echo may pause the agent for a moment (under load the canceller's reference and the
    # echo drift apart by a few ms), but never stops it: the whole reply played, without a long gap.
    gap = max((b[0] - a[1] for a, b in zip(spans(session, asked), spans(session, asked)[1:])), default=0.0)
    assert gap < 2.0, f"the agent went quiet for {gap:.2f}s"
    assert normalize(assistant_messages(session)[-1]) == normalize(engines.llm.of(session.conversation).replies[-1])


async def test_7_a_real_interruption_over_the_echo_still_stops_it(engines, speakerphone, say):
    async with LocalSession(engines, speakerphone) as session:
        mic = Microphone(session, echo_db=-6.0, echo_delay=0.06)
        await start_long_reply(mic, say)
        cut_in = samples(await say("Stop. What is the capital of Italy?"))
        start, ended = await mic.play(cut_in)
        user_onset = onset(cut_in, start)
        while not [m for m in assistant_messages(session)[1:]]:
            await mic.silence(0.5)
            assert session.now() - ended < 40, "no answer to the new question"
        await wait_until_quiet(session, ended)
    stopped = stop_delay(session, user_onset)
    FIGURES["7 echo + stop"] = {"stopped_after_s": stopped}
    # AEC3 mutes the first ~0.5 s of double talk: when it lets "Stop" through, the agent stops
    # within STOP_WITHIN as on a clean line (test 5); when it does not, at the question's first
    # words (0.76 s in one CI rehearsal). Either way it stops while the user is still talking.
    assert user_onset + stopped < ended, f"agent audio went on {stopped:.2f}s, past the end of the cut-in"
    # The question was heard (AEC3 mutes the first ~0.5 s of double talk, so "Stop" may be lost).
    # Not checked: that no other turn follows. Under double talk AEC3 re-adapts, and its residue
    # has been heard as a word ("Okay.", "the top.") in one CI rehearsal out of three.
    assert any("italy" in normalize(m) for m in user_messages(session)[1:]), user_messages(session)


async def test_8_after_a_false_interruption_the_agent_resumes(engines, long_replies, say):
    async with LocalSession(engines, long_replies) as session:
        # A sound the VAD takes for speech but that holds no words: a short, wordless hum. Short:
        # the VAD cuts a long hum ("Hmmmm.") in two on a busy machine, and tiny.en hears words
        # in half a hum ("Hm in and in.").
        hum = samples(await say("Mhm."))
        sound_at, resumed = await check_reply_goes_on(session, engines, say, hum, "8 false interruption")
    assert session.conversation.playback.pauses >= 1, "the sound did not pause the agent: this scenario tested nothing"
    assert resumed, "the agent did not resume"
    FIGURES["8 false interruption"]["resumed_after_s"] = resumed[0][0] - sound_at
    assert resumed[0][0] - sound_at <= 2.0, f"the agent resumed {resumed[0][0] - sound_at:.2f}s after the sound"


async def test_9_talking_over_the_greeting_stops_it(engines, settings, say):
    greeting = "Hello and welcome! I am your voice assistant, and I can answer questions about many topics."
    async with LocalSession(engines, settings.model_copy(update={"greeting": greeting})) as session:
        mic = Microphone(session)
        greeted = await wait_until_talking(session, 0.0)
        await mic.silence(1.0)
        cut_in = samples(await say("Sorry, what is the capital of Spain?"))
        start, ended = await mic.play(cut_in)
        user_onset = onset(cut_in, start)
        await wait_until_quiet(session, ended)
    stopped = stop_delay(session, user_onset)
    FIGURES["9 over the greeting"] = {"stopped_after_s": stopped, "greeted_at_s": greeted}
    assert stopped <= STOP_WITHIN, f"the greeting went on {stopped:.2f}s after the user cut in"
    heard_greeting = assistant_messages(session)[0]
    assert 0 < len(heard_greeting) < len(greeting) and normalize(greeting).startswith(normalize(heard_greeting))
    assert "madrid" in normalize(assistant_messages(session)[-1])


MONOLOGUE = [
    "So let me tell you about my weekend, because it was a long one,",
    "on Saturday morning I got up early and walked down to the farmers market by the river,",
    "and I bought apples, fresh bread, a big bunch of carrots and some goat cheese,",
    "and then in the afternoon my sister came over with her two kids,",
    "and we baked an apple pie together while the kids played in the garden,",
    "and on Sunday we all drove to the lake and went swimming even though the water was cold,",
    "and after that we had a picnic on the grass and watched the boats go by for a while,",
    "and my nephew caught a tiny fish with his hands and then let it go again,",
    "and my niece found a little green frog under a big flat stone near the water,",
    "and when we got home everyone was so tired that we fell asleep on the sofa,",
    "and this morning I woke up hungry and found nothing in the fridge but milk,",
    "so now I want to ask you, what should I cook for dinner tonight?",
]


async def test_10_a_45_second_monologue_is_heard_whole_and_answered_once(engines, settings, say):
    pieces = [without_quiet_ends(samples(await say(text))) for text in MONOLOGUE]
    gap = np.zeros(int(0.35 * RATE), dtype=np.float32)  # breaths between clauses
    monologue = np.concatenate([np.concatenate([p, gap]) for p in pieces])
    assert monologue.size >= 45 * RATE, f"the monologue is only {monologue.size / RATE:.1f}s"
    async with LocalSession(engines, settings) as session:
        mic = Microphone(session)
        await mic.silence(0.3)
        _, ended = await mic.play(monologue)
        await wait_until_quiet(session, ended, timeout=120)
        early = spans(session)[0][0] < ended
    heard = " ".join(user_messages(session))
    FIGURES["10 monologue"] = {"seconds": monologue.size / RATE, "user_messages": len(user_messages(session))}
    assert not early, "the agent spoke during the monologue"
    assert len(assistant_messages(session)) == 1, assistant_messages(session)
    assert wer(" ".join(MONOLOGUE), heard) <= 0.25, heard
