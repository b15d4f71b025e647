"""The user's end of a scripted call: their voice, noises, and the agent's own voice leaking back, 20 ms at a time."""

import asyncio
import time

import numpy as np
import soxr
from pipecat.frames.frames import InputAudioRawFrame

from harness.local_session import LocalSession

RATE = 16000
STEP = RATE // 50  # 20 ms, like a browser's microphone
BOT_RATE = 24000
# A play() that starts this late was a deliberate break (the test stopped feeding the call): the
# microphone restarts there. Anything less late, the loop was busy: the frames catch up, as a
# network's buffered frames do, and stay contiguous with the ones before.
MAX_LATE = 0.5


def pcm(audio: np.ndarray) -> bytes:
    return np.clip(audio, -32768, 32767).astype(np.int16).tobytes()


def samples(speech: bytes) -> np.ndarray:
    return np.frombuffer(speech, dtype=np.int16).astype(np.float32)


def without_quiet_ends(audio: np.ndarray, threshold: float = 300.0, keep: float = 0.03) -> np.ndarray:
    """`audio` without the near-silence Piper leaves before and after its words (up to 0.36 s at
    the end), but for `keep` seconds of it: a gap put between two clips is then the gap heard."""
    frames = audio[: audio.size // 160 * 160].reshape(-1, 160)
    loud = np.nonzero(np.sqrt((frames**2).mean(axis=1)) > threshold)[0]
    margin = int(keep * RATE)
    return audio[max(0, loud[0] * 160 - margin) : (loud[-1] + 1) * 160 + margin]


def noise_burst(seconds: float, rms: float = 3000.0, seed: int = 0) -> np.ndarray:
    """A cough-like burst: noise shaped to speech frequencies, with a sharp attack and a fast decay."""
    rng = np.random.default_rng(seed)
    n = int(seconds * RATE)
    spectrum = np.fft.rfft(rng.standard_normal(n))
    freqs = np.fft.rfftfreq(n, 1 / RATE)
    spectrum[(freqs < 200) | (freqs > 4000)] = 0
    burst = np.fft.irfft(spectrum, n) * np.exp(-np.linspace(0, 5, n))
    return burst / np.sqrt(np.mean(burst**2)) * rms


class Microphone:
    """Feeds a LocalSession's input in real time; with `echo_db`, the agent's played audio comes back too.

    The echo is what a speakerphone does: the bot's output, `echo_delay` seconds late and
    `echo_db` quieter, added to whatever the user says (or to silence).
    """

    def __init__(self, session: LocalSession, *, echo_db: float | None = None, echo_delay: float = 0.06):
        self.session = session
        self.echo_gain = None if echo_db is None else 10 ** (echo_db / 20)
        self.echo_delay = echo_delay
        self._speaker = np.zeros(0, dtype=np.float32)  # the bot's output at 16 kHz, indexed by pipeline time
        self._placed = 0  # chunks of session.played already on the timeline
        # One resampler over the whole output: resampling each 20 ms chunk on its own adds clicks at
        # every boundary, a distortion no echo canceller (or loudspeaker) would produce.
        self._resampler = soxr.ResampleStream(BOT_RATE, RATE, 1, dtype="float32", quality="QQ")
        self._write_at = 0
        self._read_at: int | None = None  # where on the speaker timeline the microphone hears next
        # One clock across play() calls, as a sound card has: frames a caller sends back to back stay
        # contiguous in time, so the echo canceller sees the same steady stream a real call gives it.
        self._due: float | None = None  # monotonic time the next frame is due

    async def play(self, audio: np.ndarray | bytes) -> tuple[float, float]:
        """Plays `audio` (16 kHz) into the call; returns its (start, end) on the pipeline clock."""
        audio = samples(audio) if isinstance(audio, bytes) else audio
        start = self.session.now()
        if self._due is None or time.monotonic() - self._due > MAX_LATE:
            self._due = time.monotonic()
            self._read_at = None
        for offset in range(0, audio.size, STEP):
            frame = np.zeros(STEP, dtype=np.float32)
            piece = audio[offset : offset + STEP]
            frame[: piece.size] = piece
            if self.echo_gain is not None:
                frame += self.echo_gain * self._echo(self.session.now() - self.echo_delay)
            await self.session.send(InputAudioRawFrame(audio=pcm(frame), sample_rate=RATE, num_channels=1))
            self._due += STEP / RATE
            await asyncio.sleep(max(0.0, self._due - time.monotonic()))
        return start, self.session.now()

    async def silence(self, seconds: float) -> None:
        await self.play(np.zeros(int(seconds * RATE), dtype=np.float32))

    def _echo(self, at: float) -> np.ndarray:
        played = self.session.played
        for chunk in played[self._placed :]:
            audio = self._resampler.resample_chunk(samples(chunk.audio))
            begin = int(chunk.started_at * RATE)
            if abs(begin - self._write_at) > RATE // 100:  # after a pause: the next chunk starts later
                self._write_at = begin
            begin, self._write_at = self._write_at, self._write_at + audio.size
            if begin + audio.size > self._speaker.size:
                self._speaker = np.pad(self._speaker, (0, begin + audio.size - self._speaker.size + RATE))
            self._speaker[begin : begin + audio.size] = audio
        self._placed = len(played)
        # A microphone samples on its own steady clock: consecutive frames hear consecutive audio,
        # even when this loop wakes late and sends a few frames at once.
        if self._read_at is None:
            self._read_at = int(at * RATE)
        begin, self._read_at = self._read_at, self._read_at + STEP
        window = self._speaker[max(begin, 0) : begin + STEP]
        return np.pad(window, (0, STEP - window.size))
