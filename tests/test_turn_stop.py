"""Which speech segments of a turn still owe a transcript (frames/turn_taking/turn_stop.py)."""

from frames.turn_taking.turn_stop import TRANSCRIPT_WAIT_SECS, TranscriptsOwed


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
