"""The barge-in policy on its own: which sounds over the bot take the turn."""

from types import SimpleNamespace

from pipecat.frames.frames import (
    BotStartedSpeakingFrame,
    TranscriptionFrame,
    VADUserStartedSpeakingFrame,
    VADUserStoppedSpeakingFrame,
)
from pipecat.utils.asyncio.task_manager import TaskManager

from frames.turn_taking.barge_in import ECHO_KEPT_DB, SOUND_LEAD_FRAMES, BargeInTurnStartStrategy
from frames.turn_taking.playback import PlaybackGate, PlaybackState
from services.echo import EchoCanceller
from services.stt import Transcript, TranscriptSegment
from tests.test_echo import MIC_RATE, USER_STARTS_S, reply_24k, run_call, speakerphone, user_16k  # noqa: F401 (fixtures)

BOT = "the dragon hoped the village would stop fearing him"


async def sound_over_the_bot(
    transcript: str, *, bot_said: str, canceller: EchoCanceller | None, call=None, result: Transcript | None = None
) -> tuple[bool, PlaybackGate]:
    """A sound while the bot talks, then its transcript: did it take the turn?

    With `call` (played, microphone), the call runs through `canceller` and the sound is its
    stretch from USER_STARTS_S on; without it the canceller has heard nothing. `result`: the
    STT's transcript behind the text, with Whisper's doubts."""
    gate = PlaybackGate()
    gate.recent_words.extend(bot_said.lower().split())
    strategy = BargeInTurnStartStrategy(gate, canceller=canceller)
    await strategy.setup(SimpleNamespace(task_manager=TaskManager()))
    started = []

    @strategy.event_handler("on_user_turn_started")
    async def on_started(strategy, params):
        started.append(params)

    @strategy.event_handler("on_reset_aggregation")
    async def on_reset(strategy):
        pass

    if call is not None:
        run_call(canceller, *call, to_s=USER_STARTS_S + 0.2)  # VAD reports speech 0.2 s in
    await strategy.process_frame(BotStartedSpeakingFrame())
    await strategy.process_frame(VADUserStartedSpeakingFrame())
    if call is not None:
        run_call(canceller, *call, from_s=USER_STARTS_S + 0.2, to_s=USER_STARTS_S + 1.0)
    await strategy.process_frame(VADUserStoppedSpeakingFrame())
    assert gate.paused, "a sound over the bot pauses it at once"
    await strategy.process_frame(TranscriptionFrame(transcript, "user", "now", result=result))
    await strategy.cleanup()
    return bool(started), gate


async def test_the_bots_own_words_in_its_echo_are_no_barge_in():
    took_turn, gate = await sound_over_the_bot("Hope.", bot_said=BOT, canceller=EchoCanceller(MIC_RATE))
    assert not took_turn and gate.state is PlaybackState.PLAYING


async def test_new_words_over_the_echo_still_take_the_turn():
    took_turn, _ = await sound_over_the_bot("Stop, what about Rome?", bot_said=BOT, canceller=EchoCanceller(MIC_RATE))
    assert took_turn


async def test_words_heard_in_what_the_canceller_removed_are_no_barge_in(reply_24k, user_16k):
    # Whisper invents words from faint echo residue ("We'll see you next time."): the sound is
    # judged by how much of it the canceller removed, not by what was made of it.
    echo_only = speakerphone(reply_24k)
    took_turn, gate = await sound_over_the_bot(
        "We'll see you next time.", bot_said=BOT, canceller=EchoCanceller(MIC_RATE), call=echo_only
    )
    assert not took_turn and gate.state is PlaybackState.PLAYING
    # The same words from a user talking over the same echo take the turn.
    user_over_echo = speakerphone(reply_24k, user_16k)
    took_turn, _ = await sound_over_the_bot(
        "We'll see you next time.", bot_said=BOT, canceller=EchoCanceller(MIC_RATE), call=user_over_echo
    )
    assert took_turn


async def test_an_echo_the_canceller_lost_is_no_barge_in(reply_24k, user_16k):
    # A stall moves the echo 0.2 s later just before the sound: the canceller keeps most of it,
    # and Whisper writes words of it. Its loudness still follows the bot's playback.
    echo_only = speakerphone(reply_24k, stall=(USER_STARTS_S - 0.3, 0.2))
    canceller = EchoCanceller(MIC_RATE)
    took_turn, gate = await sound_over_the_bot("And for as.", bot_said=BOT, canceller=canceller, call=echo_only)
    sound_starts = round((USER_STARTS_S + 0.2) * 100) - SOUND_LEAD_FRAMES
    assert canceller.kept_db(sound_starts, canceller.frames) > ECHO_KEPT_DB, "the canceller must have lost the echo"
    assert not took_turn and gate.state is PlaybackState.PLAYING
    # A user talking over the same lost echo takes the turn.
    user_over_echo = speakerphone(reply_24k, user_16k, stall=(USER_STARTS_S - 0.3, 0.2))
    took_turn, _ = await sound_over_the_bot("And for as.", bot_said=BOT, canceller=EchoCanceller(MIC_RATE), call=user_over_echo)
    assert took_turn


async def test_without_echo_cancellation_any_real_word_takes_the_turn():
    took_turn, _ = await sound_over_the_bot("Hope.", bot_said=BOT, canceller=None)
    assert took_turn
    took_turn, _ = await sound_over_the_bot("Mhm.", bot_said=BOT, canceller=None)
    assert not took_turn


def heard(text: str, no_speech_prob: float) -> Transcript:
    return Transcript(text, "en", 1.0, 1.0, 0.4, [TranscriptSegment(0.0, 1.0, text, -0.9, no_speech_prob)])


async def test_words_whisper_doubts_were_speech_are_echo_over_a_speakerphone():
    # Recorded in the echo scenario on a busy machine: the canceller kept much of the echo, and
    # Whisper made "Be careful." of it (no speech 0.49). Users' cut-ins over the echo: up to 0.44.
    doubted = heard("Be careful.", 0.49)
    took_turn, gate = await sound_over_the_bot(doubted.text, bot_said=BOT, canceller=EchoCanceller(MIC_RATE), result=doubted)
    assert not took_turn and gate.state is PlaybackState.PLAYING
    sorry = heard("Sorry.", 0.44)
    took_turn, _ = await sound_over_the_bot(sorry.text, bot_said=BOT, canceller=EchoCanceller(MIC_RATE), result=sorry)
    assert took_turn
    # Without a canceller nothing is echo: the same doubted words take the turn.
    took_turn, _ = await sound_over_the_bot(doubted.text, bot_said=BOT, canceller=None, result=doubted)
    assert took_turn
