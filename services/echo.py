"""Acoustic echo cancellation: removes the agent's own voice from the microphone signal (WebRTC AEC3)."""

import numpy as np
import soxr
from livekit import rtc
from loguru import logger

from services.audio import MAX_SAMPLE_RATE, MIN_SAMPLE_RATE, AudioFormatError

# The APM takes exactly 10 ms per call. A wrong size is not an exception: the native library
# panics and aborts the whole process, so only whole frames built here ever reach it.
FRAMES_PER_SECOND = 100
MAX_DELAY_HINT_MS = 500  # the APM rejects stream delays outside 0..500 ms
HISTORY_FRAMES = 10 * FRAMES_PER_SECOND  # how far back `kept_db` and `echo_likeness` can look
QUIET_RMS = 100.0  # below this (about -50 dBFS) there is too little sound to say what the canceller did
MIN_LIKENESS_FRAMES = 30  # 0.3 s: a shorter sound's loudness says too little about where it came from


class EchoCanceller:
    """One conversation's echo canceller: the agent's playback in, the microphone's echo out.

    `playback()` gets what the agent plays, at the moment it is played; `cancel()` gets the
    microphone and returns it with that audio's echo removed. WebRTC's AEC3 (the audio
    processing module shipped in `livekit`) finds the echo path and its delay by itself: in
    tests/test_echo.py's simulation it removes ~30 dB of a 60 ms, -6 dB echo of Piper speech
    within 0.25 s of the first reply, and echo delays from 15 to 500 ms work (the longest take
    ~1 s to converge). A reference that reaches `playback()` less than ~15 ms before its echo
    reaches `cancel()` is not cancelled at all, so feed it before the audio leaves the process.
    `delay_ms_hint` only seeds the delay search: a hint above the real delay slows the first
    second down, one below it costs nothing.

    Both methods must be called from one thread (the conversation's event loop). Each costs
    ~0.05-0.1 ms of CPU per 10 ms of audio (measured in tests/test_echo.py), so they run inline.

    `cancel()` returns exactly as many bytes as it is given. The APM works on 10 ms frames, so
    a chunk that ends mid-frame leaves its tail for the next call; the output then lags by the
    largest such tail seen so far (silence is inserted whenever that grows). Callers sending whole
    10 ms frames, like Pipecat's 20 ms transport chunks, get no added latency; others at most
    10 ms.

    If the APM cannot be created or fails, it logs once and from then on passes the microphone
    through unchanged: an echo is better than a dropped conversation. Malformed input (odd byte
    counts, impossible rates) raises AudioFormatError instead, since that is the caller's bug.
    """

    def __init__(self, sample_rate: int = 16000, delay_ms_hint: int = 60):
        if not MIN_SAMPLE_RATE <= sample_rate <= MAX_SAMPLE_RATE or sample_rate % FRAMES_PER_SECOND:
            raise AudioFormatError(
                f"echo cancellation needs a microphone rate that is a whole number of samples per "
                f"10 ms within {MIN_SAMPLE_RATE}..{MAX_SAMPLE_RATE} Hz, got {sample_rate} Hz"
            )
        if not 0 <= delay_ms_hint <= MAX_DELAY_HINT_MS:
            raise ValueError(f"delay_ms_hint must be within 0..{MAX_DELAY_HINT_MS} ms, got {delay_ms_hint}")
        self.sample_rate = sample_rate
        self._frame_bytes = 2 * sample_rate // FRAMES_PER_SECOND
        self._playback_rate: int | None = None
        self._playback_resampler: soxr.ResampleStream | None = None
        self._playback_tail = b""  # less than one frame of playback, at the microphone rate
        self._mic_tail = b""  # less than one frame of microphone audio, waiting for the rest
        self._cancelled = b""  # processed microphone audio not yet returned
        # AEC3 expects one playback frame per microphone frame. The agent is silent most of the
        # time and then plays in bursts, so silence stands in for playback that never came;
        # without it the render buffer underruns and AEC3 loses the echo's delay.
        self._rendered = 0  # playback frames given to the APM, silence included
        self._captured = 0  # microphone frames given to the APM
        # Energy of each recent microphone frame before and after cancellation, for `kept_db`.
        self._heard_energy = np.zeros(HISTORY_FRAMES)
        self._kept_energy = np.zeros(HISTORY_FRAMES)
        # Energy of the latest playback frame when each microphone frame came, for `echo_likeness`.
        self._played_energy = np.zeros(HISTORY_FRAMES)
        self._last_played_energy = 0.0
        self._apm: rtc.AudioProcessingModule | None = None
        try:
            # The high-pass filter keeps DC and rumble out of the echo estimate (AEC3 runs it anyway).
            self._apm = rtc.AudioProcessingModule(echo_cancellation=True, high_pass_filter=True)
            self._apm.set_stream_delay_ms(delay_ms_hint)
        except Exception:
            self._disable("could not be started")

    @property
    def active(self) -> bool:
        """False once the APM is unavailable or has failed and audio passes through unchanged."""
        return self._apm is not None

    def playback(self, pcm: bytes, sample_rate: int) -> None:
        """Tell the canceller the agent is playing `pcm` (mono PCM16 at `sample_rate`) now."""
        _check_pcm16(pcm, sample_rate)
        if self._apm is None:
            return
        if sample_rate != self.sample_rate:
            if sample_rate != self._playback_rate:
                # A stream keeps its state across chunks. "QQ" holds back no audio; "HQ" holds
                # back 15-30 ms, which made a reference arriving 20 ms before its echo useless.
                self._playback_resampler = soxr.ResampleStream(
                    sample_rate, self.sample_rate, 1, dtype="int16", quality="QQ"
                )
                self._playback_rate = sample_rate
            pcm = self._playback_resampler.resample_chunk(np.frombuffer(pcm, dtype=np.int16)).tobytes()
        frames, self._playback_tail = _whole_frames(self._playback_tail + pcm, self._frame_bytes)
        for frame in frames:
            if self._apm is not None:
                self._last_played_energy = _energy(frame)
                self._run(self._apm.process_reverse_stream, frame, "playback")
                self._rendered += 1

    def cancel(self, pcm: bytes) -> bytes:
        """Microphone audio (mono PCM16 at `sample_rate`) → the same length with the echo removed."""
        _check_pcm16(pcm, self.sample_rate)
        frames, self._mic_tail = _whole_frames(self._mic_tail + pcm, self._frame_bytes)
        for frame in frames:
            if self._apm is not None:
                while self._rendered <= self._captured and self._apm is not None:
                    self._last_played_energy = 0.0
                    self._run(self._apm.process_reverse_stream, bytes(self._frame_bytes), "playback")
                    self._rendered += 1
                heard = frame
                frame = self._run(self._apm.process_stream, frame, "microphone") if self._apm else frame
                slot = self._captured % HISTORY_FRAMES
                self._heard_energy[slot], self._kept_energy[slot] = _energy(heard), _energy(frame)
                self._played_energy[slot] = self._last_played_energy
                self._captured += 1
            self._cancelled += frame
        if len(self._cancelled) < len(pcm):
            self._cancelled = bytes(len(pcm) - len(self._cancelled)) + self._cancelled
        out, self._cancelled = self._cancelled[: len(pcm)], self._cancelled[len(pcm) :]
        return out

    @property
    def frames(self) -> int:
        """Microphone frames (10 ms each) cancelled so far: the clock `kept_db` is read against."""
        return self._captured

    def kept_db(self, since: int, until: int | None = None) -> float | None:
        """How much of the microphone's energy in frames [since, until) the canceller kept, in dB.

        About 0 dB when it removed nothing (the user talking, or nothing playing), -20 to -30 dB
        when what the microphone heard was the agent's own echo. A user talking over an echo as
        loud as their voice keeps about -3 dB, one 10 dB quieter than the echo about -10 dB.
        None when the canceller is off or the stretch is too quiet (or too old) to tell.
        """
        until = self._captured if until is None else min(until, self._captured)
        since = max(since, self._captured - HISTORY_FRAMES, 0)
        if self._apm is None or since >= until:
            return None
        slots = np.arange(since, until) % HISTORY_FRAMES
        heard, kept = self._heard_energy[slots].sum(), self._kept_energy[slots].sum()
        if heard < QUIET_RMS**2 * len(slots):
            return None
        return float(10 * np.log10(max(kept, 1.0) / heard))

    def echo_likeness(self, since: int, until: int | None = None) -> float | None:
        """How closely the microphone's loudness in frames [since, until) follows the agent's playback.

        The correlation of the two loudness envelopes (RMS per 10 ms, 30 ms smoothed) at the best
        delay up to MAX_DELAY_HINT_MS, taken on the microphone before cancellation, so it holds
        whatever state the canceller is in. AEC3 loses the echo for up to a second when the echo's
        delay jumps, as it does when a busy machine stalls the call, and `kept_db` then reads -1 to
        -10 dB of pure echo. Near 1 for echo alone at one delay; lower when someone talks over it,
        since their syllables do not follow the agent's, and lower too when the echo's delay jumps
        inside the stretch. A small double-talk detector written here because livekit's APM
        binding exposes none of AEC3's own echo statistics. None when the stretch is too short or
        too quiet, or the agent played too little of it to tell.
        """
        until = self._captured if until is None else min(until, self._captured)
        since = max(since, self._captured - HISTORY_FRAMES, 0)
        if self._apm is None or until - since < MIN_LIKENESS_FRAMES:
            return None
        lags = MAX_DELAY_HINT_MS * FRAMES_PER_SECOND // 1000
        heard = _envelope(self._heard_energy[np.arange(since, until) % HISTORY_FRAMES])
        first = max(since - lags, 0, self._captured - HISTORY_FRAMES)
        played = _envelope(self._played_energy[np.arange(first, until) % HISTORY_FRAMES])
        if heard.max() < QUIET_RMS or heard.std() < 1.0:  # silence, or one steady hum
            return None
        best = None
        for lag in range(0, min(lags, since - first) + 1):
            window = played[since - first - lag : until - first - lag]
            if window.std() < 1.0:  # the agent was silent (or one steady sound) then: nothing to follow
                continue
            likeness = float(np.corrcoef(heard, window)[0, 1])
            best = likeness if best is None else max(best, likeness)
        return best

    def _run(self, process, frame: bytes, side: str) -> bytes:
        audio = rtc.AudioFrame(bytearray(frame), self.sample_rate, 1, len(frame) // 2)
        try:
            process(audio)
        except Exception:
            self._disable(f"failed on {side} audio")
            return frame
        return audio.data.tobytes()

    def _disable(self, what: str) -> None:
        self._apm = None
        logger.exception(
            f"echo cancellation {what}; the microphone passes through unchanged for this conversation"
        )


def _check_pcm16(pcm: bytes, sample_rate: int) -> None:
    if len(pcm) % 2:
        raise AudioFormatError(f"PCM16 audio must have an even byte count, got {len(pcm)} bytes")
    if not MIN_SAMPLE_RATE <= sample_rate <= MAX_SAMPLE_RATE:
        raise AudioFormatError(f"sample rate {sample_rate} Hz is outside {MIN_SAMPLE_RATE}..{MAX_SAMPLE_RATE} Hz")


def _energy(frame: bytes) -> float:
    """Mean square of a PCM16 frame."""
    samples = np.frombuffer(frame, dtype=np.int16).astype(np.float64)
    return float(np.dot(samples, samples)) / max(1, samples.size)


def _envelope(energy: np.ndarray) -> np.ndarray:
    """Frame energies as a loudness envelope: RMS, smoothed over 30 ms against the network's jitter.
    RMS rather than dB: in dB the quiet gaps between words weigh as much as the words, and two
    voices' gaps line up by chance (a user over the echo then scored up to 0.8)."""
    rms = np.sqrt(energy)
    return np.convolve(rms, np.ones(3) / 3, mode="same")


def _whole_frames(pcm: bytes, frame_bytes: int) -> tuple[list[bytes], bytes]:
    """`pcm` cut into whole frames, and what is left over."""
    whole = len(pcm) - len(pcm) % frame_bytes
    return [pcm[start : start + frame_bytes] for start in range(0, whole, frame_bytes)], pcm[whole:]
