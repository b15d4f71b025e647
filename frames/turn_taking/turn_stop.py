"""Smart-turn end of turn that waits for every segment's transcript and answers pauses speculatively."""

import asyncio
import re
import time

from loguru import logger
from pipecat.frames.frames import (
    Frame,
    TranscriptionFrame,
    VADUserStartedSpeakingFrame,
    VADUserStoppedSpeakingFrame,
)
from pipecat.metrics.metrics import MetricsData, TurnMetricsData
from pipecat.turns.types import ProcessFrameResult, UserTurnSpeculation
from pipecat.turns.user_stop import NormalizedMatch, TurnAnalyzerUserTurnStopStrategy
from pipecat.utils.string import TextPartForConcatenation, concatenate_aggregated_text

from frames.pipecat_internals import turn_stop_state
from frames.turn_taking.turn_models import SharedSileroVADAnalyzer

# Longest wait for one speech segment's transcript (Whisper's p99 is ~0.9 s on 2 busy cores).
# A segment Whisper hears no words in never gets one; after this the turn goes on without it.
TRANSCRIPT_WAIT_SECS = 2.0
# How long after the VAD's stop a complete turn's reply is held back, generating, before it is
# released: quiet audio heard after the stop (see SharedSileroVADAnalyzer.quiet_audio_secs). A user
# who breathes after a complete-sounding sentence (0.35 s in the monologue scenario) and goes on
# has a voice again ~0.15 s after the stop, which the VAD hears within a window or two: that keeps
# the reply held until the VAD calls it speech (the speculation is then withdrawn) or not. A reply
# playing by then would talk over them. Pauses of 0.6 s or more after a complete sentence are
# answered: at 0.3 s the hold released replies inside such pauses too. The reply's first words take
# about this long to generate anyway.
COMPLETE_TURN_HOLD_SECS = 0.4
# The hold after a question (see asks_a_question): a question asks for an answer, and the monologue
# that must not be answered mid-breath is a run of statements. A reply released inside a pause the
# user then goes on after is stopped by the barge-in as usual.
QUESTION_HOLD_SECS = 0.2
# Smart-turn hears only the audio, and it doubts some plain questions: v3.2 scores Piper's "Do you
# know what bees make?" 0.32 and "What do bees make?" 0.55 (below 0.5 it waits out its 3 s silence
# timeout). Whisper hears the words and ends a question with "?". A trailing "um" it writes as a
# sentence of its own ("Can you tell me? Um."), which smart-turn scores under 0.07. So a turn whose
# transcript ends in a question mark, and that smart-turn gives at least this probability, is
# answered after the complete-turn hold instead of the silence timeout.
QUESTION_MIN_PROBABILITY = 0.1
QUESTION_MARKS = ("?", "？", "؟")
# Whisper leaves the "?" off some spoken questions: tiny.en wrote "Which ocean is the biggest." over
# LiveKit, smart-turn doubted it, and the turn waited out the 3 s timeout (the benchmark's slowest
# turn). A last sentence that opens with one of these words and ends in a full stop is taken for a
# question too. English only: in other languages the question mark alone decides.
QUESTION_WORDS = frozenset(
    "what which who whom whose where when why how is are was were do does did can could will would "
    "should shall may have has".split()
)
# A client that sends nothing while the user is quiet (Opus DTX, silence suppression) gives the
# VAD no quiet to count: once no audio has come for this long, the hold is timed by the clock.
NO_AUDIO_SECS = 0.3


def asks_a_question(transcript: str) -> bool:
    """Whether a transcript ends in a question: a question mark, or (see QUESTION_WORDS) an English
    last sentence that opens with a question word and ends in one full stop ("Can you tell me? Um."
    ends in "Um.", and "What I mean is..." trails off)."""
    text = transcript.rstrip()
    if text.endswith(QUESTION_MARKS):
        return True
    if not text.endswith(".") or text.endswith(".."):
        return False
    last_sentence = re.split(r"(?<=[.!?])\s+", text)[-1]
    first_word = last_sentence.split(maxsplit=1)[0].strip(",").lower()
    return first_word in QUESTION_WORDS


class TranscriptsOwed:
    """Which of a turn's speech segments still owe a transcript, in segment order.

    A segment Whisper hears no words in never gets a transcript, so one is waited for at most
    TRANSCRIPT_WAIT_SECS. A transcript given up on can still come, late (a full-window encoding
    on a loaded machine took 2.8 s): it belongs to the oldest segment given up on, not to the next
    one, which would otherwise be taken as transcribed and the turn end without its words.
    """

    def __init__(self):
        self._stopped_at: list[float] = []  # VAD-stop times of segments whose transcript is awaited
        self._given_up = 0  # segments waited for in vain: the next transcripts are theirs

    def segment_stopped(self, now: float) -> None:
        self._stopped_at.append(now)

    def transcript_arrived(self) -> None:
        if self._given_up:
            self._given_up -= 1
        else:
            self._stopped_at = self._stopped_at[1:]

    def awaiting(self, now: float) -> bool:
        expired = [t for t in self._stopped_at if now - t >= TRANSCRIPT_WAIT_SECS]
        self._given_up += len(expired)
        self._stopped_at = self._stopped_at[len(expired) :]
        return bool(self._stopped_at)


class SpeculativeTurnStopStrategy(TurnAnalyzerUserTurnStopStrategy):
    """Pipecat's smart-turn stop strategy, answering a turn speculatively while smart-turn waits.

    When smart-turn finds the turn incomplete at the VAD stop, Pipecat waits for more speech or
    for smart-turn's silence timeout (3 s) before the LLM runs. Here, as soon as the transcript
    of the speech so far is in hand, the LLM starts on it speculatively: the user aggregator runs
    it on a provisional context and the LLM service's SpeculationGate holds the reply. If the
    user speaks again, or the turn ends some other way, the speculation is withdrawn (the LLM
    service cancels the request); if the turn then completes with the same text, finalizing
    with `confirms_speculation` releases the held reply instead of starting a new one.

    The segmented STT transcribes each VAD segment after its stop, so when the user pauses
    briefly the first segment's transcript can arrive after the second segment has begun.
    Pipecat's strategy then ends the turn at its STT timeout with that earlier transcript in
    hand, and the last words start a turn of their own (two replies, the first to half the
    question). Here the turn, and a speculation, wait for every segment's transcript.

    Smart-turn counts its silence in the audio it is given, and a client may stop sending
    audio when the user stops talking (Opus DTX, a phone's silence suppression, a /ws client
    that sends only speech). Then no silence adds up, and Pipecat's 5 s stop watchdog would end
    the turn, throwing the speculation away to answer the same words again. So a speculation
    also confirms itself after smart-turn's silence timeout, counted in wall-clock time.

    A turn smart-turn finds complete is answered speculatively too, until the VAD has heard
    COMPLETE_TURN_HOLD_SECS of quiet after its stop: the LLM starts at once, and the reply is
    released if the user has not spoken again by then. So is a turn smart-turn doubts whose
    transcript is a question (see QUESTION_MIN_PROBABILITY).
    """

    def __init__(self, *, speculate: bool = True, vad: SharedSileroVADAnalyzer | None = None, **kwargs):
        super().__init__(**kwargs)
        self._speculate = speculate
        self._vad = vad  # the conversation's VAD, whose quiet audio times the complete-turn hold
        self._match = NormalizedMatch()
        # This turn's transcripts, joined as the user aggregator joins them into the user message
        # (the base class keeps only the latest one).
        self._parts: list[TextPartForConcatenation] = []
        self._owed = TranscriptsOwed()
        self._stop_held = False  # the turn was complete but a transcript was still on its way
        self._speculation: UserTurnSpeculation | None = None
        self._silence_secs = kwargs["turn_analyzer"].params.stop_secs
        self._silence_timer: asyncio.Task | None = None
        self._vad_stopped_at = 0.0  # time.monotonic() of the turn's latest VAD stop
        self._probability = 0.0  # smart-turn's probability that the turn is complete, at the latest VAD stop
        # Pipecat hands stop strategies every frame, in a turn or not: a hum over the bot's reply
        # that the barge-in policy let go is no turn, and must not start a speculative reply.
        self._in_turn = False

    async def process_frame(self, frame: Frame) -> ProcessFrameResult:
        if isinstance(frame, VADUserStartedSpeakingFrame):
            # Before the base class reacts: the reply answers less than the user is saying.
            await self._withdraw("the user spoke again")
        elif isinstance(frame, VADUserStoppedSpeakingFrame):
            self._vad_stopped_at = time.monotonic()
            self._owed.segment_stopped(self._vad_stopped_at)
        elif isinstance(frame, TranscriptionFrame) and frame.text.strip():
            self._parts.append(TextPartForConcatenation(frame.text, frame.includes_inter_frame_spaces))
            self._owed.transcript_arrived()
        result = await super().process_frame(frame)
        if self._stop_held and not self._awaiting_transcript():  # it never came
            await self._maybe_trigger_user_turn_stopped()
        turn = turn_stop_state(self)
        if (
            self._speculate
            and self._in_turn
            and self._speculation is None
            and turn["vad_stopped"]
            and not turn["user_speaking"]
            and not turn["turn_complete"]  # a complete turn runs the LLM at once, as before
            and turn["transcript_finalized"]
            and self._parts
            and not self._awaiting_transcript()
        ):
            if self._asks_a_question():
                await self._hold_complete_turn(max(0.0, self._hold_left()), "a question smart-turn doubts")
            else:
                await self._speculate_then_confirm(self._silence_secs, "turn incomplete")
        return result

    def _asks_a_question(self) -> bool:
        return asks_a_question(concatenate_aggregated_text(self._parts)) and self._probability >= QUESTION_MIN_PROBABILITY

    # Overrides a protected hook (see frames/pipecat_internals.py): the only place smart-turn's
    # probability reaches the strategy.
    async def _handle_prediction_result(self, result: MetricsData | None):
        if isinstance(result, TurnMetricsData):
            self._probability = result.probability
        await super()._handle_prediction_result(result)

    async def _speculate_then_confirm(self, seconds: float, why: str):
        """Answer the turn's text speculatively (if not already) and confirm it after `seconds` more of quiet."""
        await self._stop_silence_timer()
        if self._speculation is None:
            self._speculation = UserTurnSpeculation(text=concatenate_aggregated_text(self._parts))
            logger.debug(f"{self}: {why}, answering [{self._speculation.text}] speculatively for {seconds:.2f}s")
            await self.trigger_user_turn_inference_triggered(speculation=self._speculation)
        self._silence_timer = self.create_task(self._end_turn_after_silence(seconds), "speculation_silence")

    async def _end_turn_after_silence(self, seconds: float):
        await asyncio.sleep(seconds)
        self._silence_timer = None  # the stop below must not cancel the task running it
        if self._speculation is not None and not turn_stop_state(self)["user_speaking"]:
            logger.debug(f"{self}: {seconds:.1f}s more of silence, the speculative reply stands")
            await self.trigger_user_turn_stopped()

    async def _hold_complete_turn(self, hold_secs: float, why: str = "turn complete"):
        """Answer the complete turn speculatively; release the reply after `hold_secs` more of quiet."""
        text = concatenate_aggregated_text(self._parts)
        if self._speculation is not None and not self._match.matches(self._speculation.text, text):
            await self._withdraw("the turn's text changed")
        await self._speculate_then_confirm(hold_secs, why)

    async def handle_user_turn_started(self):
        await super().handle_user_turn_started()
        self._in_turn = True

    async def handle_user_turn_stopped(self):
        self._in_turn = False
        await super().handle_user_turn_stopped()

    # Overrides a protected hook (see frames/pipecat_internals.py): the last moment to hold the stop.
    async def _maybe_trigger_user_turn_stopped(self):
        self._stop_held = turn_stop_state(self)["turn_complete"] and self._awaiting_transcript()
        if not self._stop_held:
            await super()._maybe_trigger_user_turn_stopped()

    async def trigger_user_turn_stopped(self, *, enable_user_speaking_frames: bool | None = None):
        hold = self._hold_left()
        if self._speculate and self._parts and hold > 0.01 and not turn_stop_state(self)["user_speaking"]:
            await self._hold_complete_turn(hold)
            return
        speculation, self._speculation = self._speculation, None
        await self._stop_silence_timer()
        if speculation and self._match.matches(speculation.text, concatenate_aggregated_text(self._parts)):
            # The reply to this text is generated (or generating) already: release it, don't rerun.
            await self.trigger_user_turn_finalized(
                enable_user_speaking_frames=enable_user_speaking_frames, confirms_speculation=True
            )
            return
        if speculation:
            logger.debug(f"{self}: the turn's text changed since the speculation, answering it anew")
            await self.trigger_user_turn_speculation_cancelled()
        await super().trigger_user_turn_stopped(enable_user_speaking_frames=enable_user_speaking_frames)

    # Overrides a protected hook (see frames/pipecat_internals.py).
    async def _reset(self):
        # Runs at both turn boundaries; a speculation still open here (stop watchdog,
        # interruption, session end) would otherwise be held by the gate for good.
        await self._withdraw("the turn ended unresolved")
        self._parts, self._owed, self._stop_held, self._probability = [], TranscriptsOwed(), False, 0.0
        await super()._reset()

    def _hold_left(self) -> float:
        """Seconds of the complete-turn hold still to run. While audio lags behind the clock, the
        hold waits for it: a reply is released only once the VAD has heard the quiet itself."""
        now = time.monotonic()
        hold = QUESTION_HOLD_SECS if asks_a_question(concatenate_aggregated_text(self._parts)) else COMPLETE_TURN_HOLD_SECS
        if self._vad is None or now - self._vad.audio_at >= NO_AUDIO_SECS:
            return hold - (now - self._vad_stopped_at)
        return hold - (self._vad.quiet_audio_secs - self._vad.params.stop_secs)

    def _awaiting_transcript(self) -> bool:
        return self._owed.awaiting(time.monotonic())

    async def cleanup(self):
        await self._stop_silence_timer()
        await super().cleanup()

    async def _stop_silence_timer(self):
        if self._silence_timer is not None:
            task, self._silence_timer = self._silence_timer, None
            await self.task_manager.cancel_task(task)

    async def _withdraw(self, reason: str):
        await self._stop_silence_timer()
        if self._speculation is not None:
            logger.debug(f"{self}: withdrawing the speculative reply ({reason})")
            self._speculation = None
            await self.trigger_user_turn_speculation_cancelled()
