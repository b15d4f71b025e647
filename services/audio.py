"""Audio rates of the pipeline, and PCM16 validation and conversion shared by the engines."""

import numpy as np
import soxr

# The pipeline's input rate: what Silero VAD, smart-turn and Whisper all take. Transports and the
# input guard bring every microphone to it.
INPUT_SAMPLE_RATE = 16000
# The pipeline's output rate: Orpheus' native rate (Piper's 22.05 kHz is resampled to it);
# transports resample to their codec's rate.
OUTPUT_SAMPLE_RATE = 24000


def rms(pcm: bytes) -> float:
    """Root-mean-square level of PCM16 audio, on the int16 scale (0 for no samples)."""
    samples = np.frombuffer(pcm, dtype=np.int16).astype(np.float32)
    return float(np.sqrt(np.mean(samples * samples))) if samples.size else 0.0


class AudioFormatError(ValueError):
    """Audio that cannot be interpreted as mono 16-bit PCM at a sane rate."""


MIN_SAMPLE_RATE = 8000
MAX_SAMPLE_RATE = 192000


def pcm16_to_float(pcm: bytes, sample_rate: int, target_rate: int) -> np.ndarray:
    """Mono PCM16 bytes at `sample_rate` → float32 in [-1, 1] at `target_rate`.

    Raises AudioFormatError with a reason a person can act on, instead of letting a model
    fail deep inside with a shape error.
    """
    if len(pcm) % 2:
        raise AudioFormatError(f"PCM16 audio must have an even byte count, got {len(pcm)} bytes")
    if not MIN_SAMPLE_RATE <= sample_rate <= MAX_SAMPLE_RATE:
        raise AudioFormatError(
            f"sample rate {sample_rate} Hz is outside {MIN_SAMPLE_RATE}..{MAX_SAMPLE_RATE} Hz"
        )
    audio = np.frombuffer(pcm, dtype=np.int16).astype(np.float32) / 32768.0
    if sample_rate != target_rate and audio.size:
        audio = soxr.resample(audio, sample_rate, target_rate, quality="HQ").astype(np.float32)
    return audio


def float_to_pcm16(audio: np.ndarray) -> bytes:
    """float audio in [-1, 1] → PCM16 bytes, clipped so loud peaks cannot wrap around."""
    return (np.clip(audio, -1.0, 1.0) * 32767.0).astype(np.int16).tobytes()


def without_leading_quiet(
    audio: np.ndarray, sample_rate: int, *, keep_secs: float, quiet: float, window_secs: float = 0.01
) -> np.ndarray:
    """Float `audio` from `keep_secs` before its first window (of `window_secs`) whose RMS is above
    `quiet` times its loudest window's."""
    window = max(1, int(window_secs * sample_rate))
    frames = audio[: audio.size // window * window].reshape(-1, window)
    if frames.size == 0:
        return audio
    loudness = np.sqrt(np.mean(frames**2, axis=1))
    first = int(np.argmax(loudness > quiet * loudness.max()))
    return audio[max(0, first * window - int(keep_secs * sample_rate)) :]
