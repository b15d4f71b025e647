"""Echo cancellation with real speech: the agent's voice leaking into the microphone goes, the user's stays."""

import time

import numpy as np
import pytest
import soxr
from loguru import logger
from pipecat.audio.vad.vad_analyzer import VADParams, VADState
from pipecat.frames.frames import FilterEnableFrame

from frames.turn_taking.echo import EchoCancellingFilter
from frames.turn_taking.turn_models import SharedSileroVADAnalyzer
from services.audio import AudioFormatError
from services.echo import EchoCanceller
from harness.speech import wer

MIC_RATE = 16000
PLAYBACK_RATE = 24000  # the pipeline's output rate; Piper's 22050 Hz is resampled to it
STEP_S = 0.02  # one transport chunk
ECHO_DELAY_S = 0.06
ECHO_GAIN = 0.5  # -6 dB
NOISE_RMS = 30.0  # room noise at about -60 dBFS
CONVERGED_S = 1.0  # the canceller is judged from here on
USER_STARTS_S = 1.5
MIN_ERLE_DB = 20.0  # measured ~31 dB, limited by the noise floor
MAX_USER_WER = 0.35  # measured 0.0-0.18 after cancellation, 0.27-0.82 on the raw microphone
MAX_COST_PER_10MS_S = 0.001  # measured ~0.08 ms for both directions

REPLY = (
    "Sure, I can help with that. The weather tomorrow looks sunny with a light breeze, "
    "and temperatures around twenty degrees."
)
USER = "Wait, stop, I wanted to ask about my train ticket instead."


@pytest.fixture(scope="module")
async def reply_24k(engines) -> np.ndarray:
    """The agent's reply as the output transport plays it: Piper speech at 24 kHz."""
    pcm = await engines.tts.synthesize(REPLY)
    audio = np.frombuffer(pcm, dtype=np.int16).astype(np.float32)
    return soxr.resample(audio, engines.tts.sample_rate, PLAYBACK_RATE).astype(np.int16)


@pytest.fixture(scope="module")
async def user_16k(say) -> np.ndarray:
    return np.frombuffer(await say(USER), dtype=np.int16)


def speakerphone(
    reply_24k: np.ndarray, user_16k: np.ndarray | None = None, *, stall: tuple[float, float] | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """A speakerphone call: what the agent plays (24 kHz) and what the microphone hears (16 kHz):
    the reply 60 ms late at -6 dB, the user from USER_STARTS_S if given, and some room noise.

    With `stall` (at_s, by_s), the echo goes quiet for by_s from at_s and then comes that much
    later: what a stalled machine does to a call (the speaker runs dry, then plays on)."""
    heard = soxr.resample(reply_24k.astype(np.float32), PLAYBACK_RATE, MIC_RATE)
    steps = (len(heard) + MIC_RATE // 2) // int(STEP_S * MIC_RATE)
    mic = np.random.default_rng(0).normal(0.0, NOISE_RMS, steps * int(STEP_S * MIC_RATE))
    echo = np.zeros(len(mic), dtype=np.float32)
    delay = int(ECHO_DELAY_S * MIC_RATE)
    echo[delay : delay + len(heard)] = ECHO_GAIN * heard[: len(mic) - delay]
    if stall is not None:
        at, by = int(stall[0] * MIC_RATE), int(stall[1] * MIC_RATE)
        echo[at + by :], echo[at : at + by] = echo[at : len(echo) - by].copy(), 0.0
    mic += echo
    if user_16k is not None:
        start = int(USER_STARTS_S * MIC_RATE)
        mic[start : start + len(user_16k)] += user_16k
    played = np.zeros(steps * int(STEP_S * PLAYBACK_RATE), dtype=np.int16)
    played[: len(reply_24k)] = reply_24k
    return played, np.clip(mic, -32768, 32767).astype(np.int16)


def run_call(canceller: EchoCanceller, played: np.ndarray, mic: np.ndarray, from_s: float = 0.0, to_s: float | None = None):
    """The call from `from_s` to `to_s` in 20 ms steps, in a live call's order: the step's reply
    audio goes to `playback`, then the step's microphone audio through `cancel`.

    Returns the cancelled signal and the wall time of each step per 10 ms of audio (both
    directions together)."""
    mic_step, play_step = int(STEP_S * MIC_RATE), int(STEP_S * PLAYBACK_RATE)
    steps = len(mic) // mic_step if to_s is None else round(to_s / STEP_S)
    cancelled, costs = [], []
    for n in range(round(from_s / STEP_S), steps):
        started = time.perf_counter()
        canceller.playback(played[n * play_step : (n + 1) * play_step].tobytes(), PLAYBACK_RATE)
        cancelled.append(canceller.cancel(mic[n * mic_step : (n + 1) * mic_step].tobytes()))
        costs.append((time.perf_counter() - started) * 0.01 / STEP_S)
    return np.frombuffer(b"".join(cancelled), dtype=np.int16), costs


def simulate_call(reply_24k: np.ndarray, user_16k: np.ndarray | None = None):
    """The whole call through a fresh canceller: the microphone signal, the cancelled signal and
    the cost of each step (see `run_call`)."""
    played, mic = speakerphone(reply_24k, user_16k)
    canceller = EchoCanceller(MIC_RATE, delay_ms_hint=60)
    cancelled, costs = run_call(canceller, played, mic)
    assert canceller.active
    return mic, cancelled, costs


async def vad_states(settings, audio: np.ndarray) -> list[VADState]:
    """Silero's state after each 20 ms step, with the pipeline's VAD parameters."""
    vad = SharedSileroVADAnalyzer(
        params=VADParams(
            start_secs=settings.vad_start_secs,
            stop_secs=settings.vad_stop_secs,
            min_volume=settings.vad_min_volume,
        )
    )
    vad.set_sample_rate(MIC_RATE)
    step = int(STEP_S * MIC_RATE)
    try:
        return [await vad.analyze_audio(audio[i : i + step].tobytes()) for i in range(0, len(audio), step)]
    finally:
        await vad.cleanup()


def speaking_seconds(states: list[VADState], start_s: float = 0.0, end_s: float = float("inf")) -> float:
    return STEP_S * sum(
        state == VADState.SPEAKING for n, state in enumerate(states) if start_s <= n * STEP_S < end_s
    )


def energy(audio: np.ndarray) -> float:
    return float(np.mean(audio.astype(np.float64) ** 2))


async def test_echo_alone_is_removed_and_does_not_trigger_vad(settings, reply_24k):
    mic, cancelled, costs = simulate_call(reply_24k)
    assert len(cancelled) == len(mic)

    # ERLE over the echo after convergence: microphone energy over what is left of it.
    echo_ends = int(ECHO_DELAY_S * MIC_RATE) + len(reply_24k) * MIC_RATE // PLAYBACK_RATE
    judged = slice(int(CONVERGED_S * MIC_RATE), echo_ends)
    erle_db = 10 * np.log10(energy(mic[judged]) / energy(cancelled[judged]))
    first_second = slice(0, int(CONVERGED_S * MIC_RATE))
    first_erle_db = 10 * np.log10(energy(mic[first_second]) / energy(cancelled[first_second]))
    cost = float(np.median(costs))
    logger.info(
        f"echo only: ERLE {erle_db:.1f} dB after {CONVERGED_S} s ({first_erle_db:.1f} dB in the first "
        f"second); {cost * 1e3:.3f} ms per 10 ms of audio (median), {max(costs) * 1e3:.3f} ms worst"
    )
    assert erle_db >= MIN_ERLE_DB
    assert cost < MAX_COST_PER_10MS_S

    raw_speech = speaking_seconds(await vad_states(settings, mic))
    cancelled_states = await vad_states(settings, cancelled)
    logger.info(
        f"echo only: VAD speech {raw_speech:.2f} s on the microphone, "
        f"{speaking_seconds(cancelled_states):.2f} s after cancellation"
    )
    assert raw_speech > 1.0, "the raw echo must look like speech, or this test proves nothing"
    assert speaking_seconds(cancelled_states, start_s=CONVERGED_S) == 0.0


async def test_user_talking_over_the_reply_survives(settings, engines, reply_24k, user_16k):
    mic, cancelled, _ = simulate_call(reply_24k, user_16k)
    user_start = int(USER_STARTS_S * MIC_RATE)
    user_end = user_start + len(user_16k)
    assert user_end < int(ECHO_DELAY_S * MIC_RATE) + len(reply_24k) * MIC_RATE // PLAYBACK_RATE, (
        "the user must talk over the reply"
    )
    user_stretch = slice(user_start, user_end + MIC_RATE // 5)

    heard = (await engines.stt.transcribe(cancelled[user_stretch].tobytes(), MIC_RATE)).text
    heard_raw = (await engines.stt.transcribe(mic[user_stretch].tobytes(), MIC_RATE)).text
    states = await vad_states(settings, cancelled)
    user_speech = speaking_seconds(states, USER_STARTS_S, user_end / MIC_RATE)
    logger.info(
        f"double talk: WER {wer(USER, heard):.2f} cancelled ({heard!r}), {wer(USER, heard_raw):.2f} raw "
        f"({heard_raw!r}); VAD speech {user_speech:.2f} s of the user's {len(user_16k) / MIC_RATE:.2f} s"
    )
    assert wer(USER, heard) <= MAX_USER_WER, heard
    assert user_speech > 1.0


async def test_chunks_of_any_length_come_back_the_same_length():
    canceller = EchoCanceller(MIC_RATE)
    noise = np.random.default_rng(1).normal(0, 1000, MIC_RATE).astype(np.int16).tobytes()
    sizes = [640, 0, 14, 320, 222, 2, 3000, 160, 640]  # bytes; whole 10 ms frames are 320
    position = 0
    for size in sizes:
        assert len(canceller.cancel(noise[position : position + size])) == size
        position += size
    # Playback at rates that are not whole samples per 10 ms (Piper's own) is resampled, in any chunk size.
    canceller.playback(noise[:882], 22050)
    canceller.playback(noise[:14], 22050)
    assert canceller.active


async def test_malformed_audio_is_refused_with_a_reason():
    canceller = EchoCanceller(MIC_RATE)
    with pytest.raises(AudioFormatError, match="even byte count"):
        canceller.cancel(b"\x00" * 321)
    with pytest.raises(AudioFormatError, match="even byte count"):
        canceller.playback(b"\x00" * 479, PLAYBACK_RATE)
    with pytest.raises(AudioFormatError, match="outside"):
        canceller.playback(b"\x00" * 480, 1000)
    with pytest.raises(AudioFormatError, match="10 ms"):
        EchoCanceller(22050)
    with pytest.raises(ValueError, match="delay_ms_hint"):
        EchoCanceller(MIC_RATE, delay_ms_hint=600)
    # A refused chunk leaves no trace: the stream carries on aligned.
    assert len(canceller.cancel(b"\x00" * 320)) == 320
    assert canceller.active


async def test_a_failing_apm_passes_the_microphone_through_and_logs_once():
    canceller = EchoCanceller(MIC_RATE)
    # A real failure of the native module: its handle is gone, as after the FFI is torn down.
    canceller._apm._ffi_handle.dispose()
    errors: list[str] = []
    sink = logger.add(lambda message: errors.append(message), level="ERROR")
    try:
        audio = np.random.default_rng(2).normal(0, 1000, 3200).astype(np.int16).tobytes()
        canceller.playback(audio[:960], PLAYBACK_RATE)
        first = canceller.cancel(audio[:640])
        rest = canceller.cancel(audio[640:])
    finally:
        logger.remove(sink)
    assert not canceller.active
    assert first + rest == audio
    assert len(errors) == 1 and "passes through unchanged" in errors[0]


async def test_filter_checks_the_rate_and_never_raises_into_the_transport():
    canceller = EchoCanceller(MIC_RATE)
    audio_filter = EchoCancellingFilter(canceller)
    with pytest.raises(ValueError, match="EchoCanceller\\(sample_rate=24000\\)"):
        await audio_filter.start(24000)
    await audio_filter.start(MIC_RATE)
    chunk = np.random.default_rng(3).normal(0, 1000, 320).astype(np.int16).tobytes()
    assert len(await audio_filter.filter(chunk)) == len(chunk)
    misaligned = chunk[:-1]
    assert await audio_filter.filter(misaligned) == misaligned  # left for InputAudioGuard to drop
    await audio_filter.process_frame(FilterEnableFrame(enable=False))
    assert await audio_filter.filter(chunk) == chunk
    await audio_filter.stop()
