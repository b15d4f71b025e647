"""The barge-in policy on its own: which transcripts of a sound over the bot take the turn."""

from types import SimpleNamespace

from pipecat.frames.frames import (
    BotStartedSpeakingFrame,
    TranscriptionFrame,
    VADUserStartedSpeakingFrame,
    VADUserStoppedSpeakingFrame,
)
from pipecat.utils.asyncio.task_manager import TaskManager

from frames.turn_taking.barge_in import BargeInPolicy, BargeInTurnStartStrategy
from frames.turn_taking.playback import PlaybackGate, PlaybackState


async def sound_over_the_bot(transcript: str, *, bot_said: str, ignore_echoed_words: bool) -> tuple[bool, PlaybackGate]:
    """A short sound while the bot talks, then its transcript: did it take the turn?"""
    gate = PlaybackGate()
    gate.recent_words.extend(bot_said.lower().split())
    strategy = BargeInTurnStartStrategy(gate, BargeInPolicy(ignore_echoed_words=ignore_echoed_words))
    await strategy.setup(SimpleNamespace(task_manager=TaskManager()))
    started = []

    @strategy.event_handler("on_user_turn_started")
    async def on_started(strategy, params):
        started.append(params)

    @strategy.event_handler("on_reset_aggregation")
    async def on_reset(strategy):
        pass

    for frame in (BotStartedSpeakingFrame(), VADUserStartedSpeakingFrame(), VADUserStoppedSpeakingFrame()):
        await strategy.process_frame(frame)
    assert gate.paused, "a sound over the bot pauses it at once"
    await strategy.process_frame(TranscriptionFrame(transcript, "user", "now"))
    await strategy.cleanup()
    return bool(started), gate


BOT = "the dragon hoped the village would stop fearing him"


async def test_the_bots_own_words_in_its_echo_are_no_barge_in():
    took_turn, gate = await sound_over_the_bot("Hope.", bot_said=BOT, ignore_echoed_words=True)
    assert not took_turn and gate.state is PlaybackState.PLAYING


async def test_new_words_over_the_echo_still_take_the_turn():
    took_turn, _ = await sound_over_the_bot("Stop, what about Rome?", bot_said=BOT, ignore_echoed_words=True)
    assert took_turn


async def test_without_echo_cancellation_any_real_word_takes_the_turn():
    took_turn, _ = await sound_over_the_bot("Hope.", bot_said=BOT, ignore_echoed_words=False)
    assert took_turn
    took_turn, _ = await sound_over_the_bot("Mhm.", bot_said=BOT, ignore_echoed_words=False)
    assert not took_turn
