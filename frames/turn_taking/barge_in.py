"""When the user's sound starts a turn: at once while the bot is quiet; while it talks, only for real words."""

import asyncio
import difflib
import re
from dataclasses import dataclass

from loguru import logger
from pipecat.frames.frames import (
    BotStartedSpeakingFrame,
    BotStoppedSpeakingFrame,
    Frame,
    InterimTranscriptionFrame,
    TranscriptionFrame,
    VADUserStartedSpeakingFrame,
    VADUserStoppedSpeakingFrame,
)
from pipecat.turns.types import ProcessFrameResult
from pipecat.turns.user_start.base_user_turn_start_strategy import BaseUserTurnStartStrategy

from frames.turn_taking.playback import PlaybackGate
from services.echo import EchoCanceller

# Sounds a listener makes without taking the turn. Whisper also writes "you" and "thank you" for
# breath, clicks and echo residue it cannot place, so those are not a barge-in either.
BACKCHANNEL_WORDS = frozenset(
    "mhm mm mmm hmm hm uh huh um umm ah oh yeah yes yep yup okay ok right sure alright cool "
    "nice wow i see got it you thank thanks".split()
)


@dataclass
class BargeInPolicy:
    min_words: int = 1  # words beyond backchannels that make a sound a barge-in
    min_speech_secs: float = 1.2  # speech this long is a barge-in before any transcript exists
    false_interruption_secs: float = 1.5  # no real words by then: the bot resumes where it paused


# A sound of which the echo canceller kept less than this is the bot's own echo, whatever Whisper
# makes of it ("We'll see you next time."): measured in tests/test_echo.py's call, echo alone
# keeps -24 to -35 dB, a user 9 dB quieter than the echo still -13 dB.
ECHO_KEPT_DB = -18.0
# A sound whose loudness follows the bot's playback this closely is its echo too, even when the
# canceller has lost it (EchoCanceller.echo_likeness). Measured: echo alone 0.95-0.99, the canceller
# having lost it or not; a user talking over the echo 0.59-0.79 at its level or up to 9 dB under
# it, 0.86-0.90 12 dB under it (such a user still takes the turn by the canceller's measure).
ECHO_LIKENESS = 0.93
# Over a speakerphone, words Whisper itself doubts were speech are echo residue too. While the
# canceller converges (a reply's first seconds) or re-adapts (a busy machine), it keeps much of
# the echo, and Whisper makes short phrases of it. Measured in the suite's scenarios: residue that
# took the turn had no-speech probabilities of 0.48-0.76 ("Be careful.", "This tool.", "That's
# bad."); the users' cut-ins over the echo, 0.02-0.44 ("Stop." 0.31-0.44). A cut-in doubted this
# much still takes the turn by its length (BargeInPolicy.min_speech_secs).
ECHO_NO_SPEECH_PROB = 0.45
SOUND_LEAD_FRAMES = 50  # 10 ms frames: VAD reports speech ~0.2 s in, and the transport queues some


HUMS = re.compile(r"^(?:[mhn]+|u+h+m*|u+m+)$")  # "mmm", "mhm", "hmmm", "uhm": Whisper spells hums many ways


def real_words(text: str) -> list[str]:
    words = re.sub(r"[^a-z' ]+", " ", text.lower().replace("-", " ")).split()
    return [w for w in words if w not in BACKCHANNEL_WORDS and not HUMS.match(w)]


def echoed(word: str, bot_words) -> bool:
    """The bot said this word lately, as Whisper may spell it from a faint echo ("hope" for "hoped")."""
    return bool(difflib.get_close_matches(word, set(bot_words), n=1, cutoff=0.8))


class BargeInTurnStartStrategy(BaseUserTurnStartStrategy):
    """Replaces Pipecat's VAD + transcription start strategies.

    While the bot is quiet, voice activity starts the turn at once, as Pipecat's VAD strategy
    does. While it talks, voice activity only pauses it (within one audio chunk, so "stop"
    is obeyed in well under 300 ms) and the sound is judged:
    - a transcript with `min_words` real words, or speech lasting `min_speech_secs`, starts
      the turn: Pipecat interrupts the reply and the held audio is dropped;
    - a backchannel ("mhm", "okay"), a cough, or silence for `false_interruption_secs`
      resumes the reply from the exact sample where it paused, and the sound's transcript
      is dropped from the user's aggregation.
    Pausing rather than stopping is what lets one policy stop fast and never lose a reply
    to noise; Pipecat's MinWords strategy must wait for Whisper before the bot stops.

    Over a speakerphone (`canceller` given) the echo canceller leaves some of the bot's voice,
    and Whisper writes it down as the bot's words or invents some. Two rules keep that from
    taking the turn: a sound the canceller removed nearly all of, or one Whisper doubts held
    speech at all, is echo; and words the bot has just said (or near spellings of them, "hope"
    for "hoped") are not counted.
    """

    def __init__(
        self,
        gate: PlaybackGate,
        policy: BargeInPolicy | None = None,
        canceller: EchoCanceller | None = None,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self._gate = gate
        self._policy = policy or BargeInPolicy()
        self._canceller = canceller
        self._sound_frames = (0, None)  # the canceller's frames of the latest sound: [start, end)
        self._bot_speaking = False
        self._user_speaking = False
        self._judging: asyncio.Task | None = None
        # A sound that paused the bot is owed a judgement by its words, however late its transcript:
        # on a busy machine it can come after the time judgement let the bot go on, in a gap
        # between two sentences, where it would otherwise start a turn of its own.
        self._sound_over_bot = False
        self.false_interruptions = 0  # sounds that paused the bot and were let go

    async def handle_user_turn_started(self):
        self._bot_speaking = False
        self._sound_over_bot = False
        await self._stop_judging()

    async def cleanup(self):
        await self._stop_judging()
        await super().cleanup()

    async def process_frame(self, frame: Frame) -> ProcessFrameResult:
        if isinstance(frame, BotStartedSpeakingFrame):
            self._bot_speaking = True
            if self._user_speaking:
                # A reply to an earlier pause, starting while the user is talking again: the same
                # judgement as a sound over the bot, so it never talks over the user.
                self._listen()
        elif isinstance(frame, BotStoppedSpeakingFrame):
            self._bot_speaking = False
        elif isinstance(frame, VADUserStartedSpeakingFrame):
            self._user_speaking = True
            if self._canceller is not None:
                self._sound_frames = (self._canceller.frames - SOUND_LEAD_FRAMES, None)
            if not self._bot_speaking:
                await self.trigger_user_turn_started()
                return ProcessFrameResult.STOP
            self._listen()
        elif isinstance(frame, VADUserStoppedSpeakingFrame):
            self._user_speaking = False
            if self._canceller is not None:
                self._sound_frames = (self._sound_frames[0], self._canceller.frames)
        elif isinstance(frame, (TranscriptionFrame, InterimTranscriptionFrame)):
            return await self._judge_transcript(frame.text, getattr(frame.result, "no_speech_prob", 0.0))
        return ProcessFrameResult.CONTINUE

    def _listen(self):
        """Pause the bot and judge the user's sound."""
        self._gate.pause()
        self._sound_over_bot = True
        if self._judging is None:
            self._judging = self.create_task(self._judge_by_time(), "judge_barge_in")

    async def _judge_transcript(self, text: str, no_speech_prob: float) -> ProcessFrameResult:
        # A sound that paused the bot is judged by its words even if the bot's audio stopped in the
        # meantime (a reply's next sentence still being synthesized on a busy machine): "mhm"
        # must not become a turn because its transcript came during a gap.
        if not self._bot_speaking and not self._sound_over_bot:
            # Words without a VAD turn (very soft speech): Pipecat's transcription strategy does the same.
            await self.trigger_user_turn_started()
            return ProcessFrameResult.STOP
        self._sound_over_bot = False
        words = real_words(text)
        if self._canceller is not None:
            if self._sound_is_echo() or no_speech_prob >= ECHO_NO_SPEECH_PROB:
                words = []
            else:
                words = [w for w in words if not echoed(w, self._gate.recent_words)]
        if len(words) >= self._policy.min_words:
            logger.debug(f"{self}: barge-in on [{text}]")
            await self._barge_in()
            return ProcessFrameResult.STOP
        logger.debug(f"{self}: [{text}] is not a barge-in; the bot goes on")
        await self.trigger_reset_aggregation()
        if not self._user_speaking:
            await self._let_go()
        return ProcessFrameResult.CONTINUE

    async def _judge_by_time(self):
        """Long speech is a barge-in; a pause that brings no words by the deadline is let go."""
        policy = self._policy
        await asyncio.sleep(policy.min_speech_secs)
        if self._user_speaking and not self._sound_is_echo():
            self._judging = None  # _barge_in must not cancel the task running it
            await self._barge_in()
            return
        await asyncio.sleep(max(0.0, policy.false_interruption_secs - policy.min_speech_secs))
        self._judging = None
        if self._gate.paused and not self._user_speaking:
            await self._let_go()

    def _sound_is_echo(self) -> bool:
        if self._canceller is None:
            return False
        since, until = self._sound_frames
        kept = self._canceller.kept_db(since, until)
        # From the VAD's start on: the lead before it is echo alone even when a user then talks. But
        # at least the sound's last half second: on a stalled machine the VAD's start and stop
        # arrive together.
        end = self._canceller.frames if until is None else until
        likeness = self._canceller.echo_likeness(min(since + SOUND_LEAD_FRAMES, end - SOUND_LEAD_FRAMES), end)
        echo = (kept is not None and kept < ECHO_KEPT_DB) or (likeness is not None and likeness >= ECHO_LIKENESS)
        logger.debug(
            f"{self}: the sound {'is' if echo else 'is not'} the bot's echo: the canceller kept "
            f"{'-' if kept is None else f'{kept:.0f}'} dB of it, its loudness follows the bot's "
            f"{'-' if likeness is None else f'{likeness:.2f}'}"
        )
        return echo

    async def _barge_in(self):
        await self._stop_judging()
        await self.trigger_user_turn_started()

    async def _let_go(self):
        await self._stop_judging()
        if self._gate.paused:
            self.false_interruptions += 1
            self._gate.resume()

    async def _stop_judging(self):
        if self._judging is not None:
            task, self._judging = self._judging, None
            await self.task_manager.cancel_task(task)
