"""aiortc's audio receiver, made to hand each packet on at once: the one reach into aiortc, apart
so that a caller process (harness.caller) can use it without importing the agent."""

from aiortc import RTCRtpReceiver
from aiortc.jitterbuffer import JitterBuffer

# Packets aiortc's audio jitter buffer holds before it releases the oldest: its default (4) is
# for a listener's smooth playback and delays every frame 60 ms more than this, to the VAD, which
# only needs them in order (over loopback the P2P input came 0.12 s behind /ws's). Order and
# loss are handled as before: a gap still waits until the buffer is full.
AUDIO_JITTER_PREFETCH = 1


def release_audio_packets_at_once(receiver: RTCRtpReceiver) -> None:
    """Give an audio receiver a jitter buffer that releases each frame as soon as the next arrives.

    A reach into aiortc's private internals (checked against aiortc 1.16.0; the test
    `test_aiortc_still_keeps_its_audio_jitter_buffer_where_we_replace_it` fails if it moves):
    aiortc has no option for it. Pipecat replaces the video receiver's buffer the same way.
    """
    capacity = receiver._RTCRtpReceiver__jitter_buffer.capacity
    receiver._RTCRtpReceiver__jitter_buffer = JitterBuffer(capacity=capacity, prefetch=AUDIO_JITTER_PREFETCH)
