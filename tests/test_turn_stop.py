"""When a turn ends: which of its speech segments still owe a transcript, how long the user has been quiet, and the shared models that tell (frames/turn_taking/)."""

from pipecat.audio.vad.vad_analyzer import VADParams, VADState

import agent.engines
from frames.turn_taking import turn_models
from frames.turn_taking.turn_models import SharedSileroVADAnalyzer
from frames.turn_taking.turn_stop import TRANSCRIPT_WAIT_SECS, TranscriptsOwed, asks_a_question
from services.audio import rms


def test_each_transcript_settles_the_oldest_segment():
    owed = TranscriptsOwed()
    owed.segment_stopped(0.0)
    owed.segment_stopped(0.5)
    owed.transcript_arrived()
    assert owed.awaiting(0.6), "the second segment's transcript is still to come"
    owed.transcript_arrived()
    assert not owed.awaiting(0.7)


def test_a_segment_with_no_words_is_waited_for_only_so_long():
    owed = TranscriptsOwed()
    owed.segment_stopped(0.0)
    assert owed.awaiting(TRANSCRIPT_WAIT_SECS - 0.1)
    assert not owed.awaiting(TRANSCRIPT_WAIT_SECS)


def test_a_question_is_told_by_its_mark_or_by_its_first_word_when_whisper_left_the_mark_off():
    assert asks_a_question("What do bees make?")
    assert asks_a_question("Which ocean is the biggest.")  # tiny.en over LiveKit
    assert asks_a_question("I was wondering. How far is the moon.")
    assert asks_a_question("¿Dónde está la estación?")
    assert not asks_a_question("My number is five five five.")
    assert not asks_a_question("Can you tell me? Um.")  # a trailing "um" is a sentence of its own
    assert not asks_a_question("What I mean is...")
    assert not asks_a_question("What I mean is")
    assert not asks_a_question("")


def test_a_late_transcript_is_not_taken_for_the_next_segments():
    # Seen under load over LiveKit: "Stop." took 2.8 s to transcribe, past the wait; "What is two
    # plus two?" had stopped meanwhile. Taking "Stop." for the second segment's transcript ended
    # the turn at "Stop.", and the question became a turn of its own.
    owed = TranscriptsOwed()
    owed.segment_stopped(0.0)  # "Stop."
    assert not owed.awaiting(TRANSCRIPT_WAIT_SECS + 0.5)  # given up on
    owed.segment_stopped(TRANSCRIPT_WAIT_SECS + 0.6)  # "What is two plus two?"
    owed.transcript_arrived()  # "Stop.", late
    assert owed.awaiting(TRANSCRIPT_WAIT_SECS + 0.7), "the question's transcript is still owed"
    owed.transcript_arrived()  # the question
    assert not owed.awaiting(TRANSCRIPT_WAIT_SECS + 0.8)


async def test_the_vad_counts_the_quiet_it_heard_and_a_voice_resets_it_before_it_is_called_speech(say):
    # The complete-turn hold is timed by this count: audio, not the clock, so a busy machine's
    # late audio cannot release a reply before the VAD has heard whether the user went on.
    vad = SharedSileroVADAnalyzer(params=VADParams(start_secs=0.2, stop_secs=0.2))
    vad.set_sample_rate(16000)

    async def hear(pcm: bytes) -> list[tuple[VADState, float]]:
        """The VAD's state and quiet count after each 20 ms frame of `pcm`."""
        heard = []
        for at in range(0, len(pcm) - 639, 640):
            state = await vad.analyze_audio(pcm[at : at + 640])
            heard.append((state, vad.quiet_audio_secs))
        return heard

    speech = await say("What is the capital of France?")
    await hear(speech)
    quiet = await hear(bytes(2 * 16000))  # a second of silence
    assert quiet[-1][0] is VADState.QUIET
    # All of it, and the speech's own quiet tail (Piper ends a sentence with up to 0.25 s of quiet).
    assert 0.98 <= quiet[-1][1] <= 1.25, quiet[-1]
    again = await hear(speech[: 2 * 8000])  # the user goes on
    voiced = [i for i, (state, _) in enumerate(again) if state is not VADState.QUIET]
    speaking = [i for i, (state, _) in enumerate(again) if state is VADState.SPEAKING]
    assert voiced and speaking and voiced[0] < speaking[0], again
    assert again[voiced[0]][1] == 0.0, "a voice the VAD has not yet called speech already ends the quiet"
    await vad.cleanup()


async def test_the_vad_hears_a_turn_end_when_the_voice_goes_not_when_silero_forgets_it(say):
    # Silero alone calls the 0.1-0.24 s after these questions' last loud frame speech (its
    # recurrent state), and the 0.2 s stop counted from there: every reply started that much later.
    questions = ("How many legs does a spider have?", "What is the tallest mountain in the world?", "Which ocean is the biggest?")
    for question in questions:
        vad = SharedSileroVADAnalyzer(params=VADParams(start_secs=0.1, stop_secs=0.2))
        vad.set_sample_rate(16000)
        pcm = await say(question) + bytes(2 * 16000)
        frames = [pcm[at : at + 640] for at in range(0, len(pcm) - 639, 640)]
        loud = [i for i, frame in enumerate(frames) if rms(frame) > 300]
        states = [await vad.analyze_audio(frame) for frame in frames]
        await vad.cleanup()
        spoken = [i for i, state in enumerate(states) if state is VADState.SPEAKING]
        stopped = next(i for i in range(spoken[0], len(states)) if states[i] is VADState.QUIET)
        assert stopped > loud[-1], f"{question!r}: the VAD stopped inside the question"
        # 20 ms frames: the stop's 0.2 s is 10 of them; Silero's own window is 32 ms.
        quiet_before_the_stop = (stopped - loud[-1]) * 0.02
        assert quiet_before_the_stop <= 0.2 + 0.08, f"{question!r}: stopped {quiet_before_the_stop:.2f}s after the voice"


def test_loading_the_engines_opens_the_shared_vad_and_turn_models(monkeypatch, settings):
    # Opened by the first conversation instead, they held its event loop for 0.5-1.5 s while
    # other rooms joined. The three engines are stand-ins here: they are not what is tested.
    monkeypatch.setattr(turn_models, "_sessions", {})
    for loader in ("load_stt", "load_llm", "load_tts"):
        monkeypatch.setattr(agent.engines, loader, lambda settings: object())
    agent.engines.load_engines(settings)
    assert set(turn_models._sessions) == {turn_models.SILERO_VAD_MODEL, turn_models.SMART_TURN_MODEL}
