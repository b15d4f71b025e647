"""Who speaks when: barge-in, end of turn, the playback gate, shared VAD/smart-turn models and the echo filter."""
