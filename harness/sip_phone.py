"""A real SIP phone for tests: Debian's baresip in its own process, its microphone a WAV file and its speaker recorded."""

import asyncio
import json
import shutil
import subprocess
import time
import wave
from pathlib import Path

import numpy as np

from agent.livekit_dev_server import free_port

PHONE_RATE = 8000  # a narrowband line (PCMU/PCMA); G.722 phones run at 16 kHz
CODECS = {"g711": ("g711.so", 8000), "g722": ("g722.so", 16000)}
# baresip hangs up when its microphone file ends: everything said is followed by this much silence.
TRAILING_SILENCE_SECS = 300
MODULES = ["account.so", "aufile.so", "aubridge.so", "sndfile.so", "ctrl_tcp.so", "menu.so"]


def write_microphone(path: Path, pcm: bytes, rate: int) -> None:
    """A WAV file for baresip's microphone: `pcm`, then silence for the rest of the call."""
    with wave.open(str(path), "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(rate)
        f.writeframes(pcm + b"\x00\x00" * (TRAILING_SILENCE_SECS * rate))


def read_wav(path: Path) -> tuple[bytes, int]:
    with wave.open(str(path), "rb") as f:
        return f.readframes(f.getnframes()), f.getframerate()


def utterance_onsets(audio: np.ndarray, rate: int, gap_secs: float = 1.0, frame_secs: float = 0.02) -> list[float]:
    """Where each utterance in `audio` starts (s): sound after at least `gap_secs` of digital
    silence. The phone's microphone is a WAV of speech padded with exact zeros, so any sound is speech."""
    frame = int(rate * frame_secs)
    loud = np.abs(audio[: len(audio) // frame * frame].reshape(-1, frame)).max(axis=1) > 0
    onsets, quiet = [], gap_secs / frame_secs
    for i, sound in enumerate(loud):
        if sound and quiet >= gap_secs / frame_secs:
            onsets.append(i * frame_secs)
        quiet = 0 if sound else quiet + 1
    return onsets


class BaresipPhone:
    """baresip configured in a directory of its own (`baresip -f DIR`), driven over ctrl_tcp.

    Its microphone is `aufile` (a WAV file, switched during the call with `ausrc`); `sndfile`
    writes what it hears to `DIR/dump-*-dec.wav` and what it says to `DIR/dump-*-enc.wav`. Every event baresip reports is kept in
    `events` (`{"type": "CALL_ESTABLISHED", "param": ...}`), in order.
    """

    def __init__(
        self,
        directory: Path,
        *,
        address: str = "127.0.0.1",
        username: str | None = None,
        password: str | None = None,
        codec: str = "g711",
        answer: str = "manual",
    ):
        if shutil.which("baresip") is None:
            raise FileNotFoundError("baresip is not installed: run scripts/install-sip.sh")
        self.directory = directory
        self.address = address
        codec_module, self.rate = CODECS[codec]
        self._codec_module = codec_module
        self._auth = f";auth_user={username};auth_pass={password}" if username else ""
        self._answer_mode = answer  # "auto": calls to the phone are answered at once
        self.sip_port = self.ctrl_port = 0  # chosen at start
        self.events: list[dict] = []
        self._responses: asyncio.Queue = asyncio.Queue()
        self._process: subprocess.Popen | None = None
        self._reader_task: asyncio.Task | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._silence = directory / "silence.wav"
        write_microphone(self._silence, b"", self.rate)

    def _configure(self) -> None:
        """Free ports, and baresip's configuration with them. baresip also binds TLS on the SIP
        port + 1, which nothing reserves: another process may hold it (start retries)."""
        self.sip_port, self.ctrl_port = free_port(), free_port()
        address, directory = self.address, self.directory
        (directory / "accounts").write_text(f"<sip:phone@{address}:{self.sip_port}>;regint=0{self._auth};answermode={self._answer_mode}\n")
        (directory / "contacts").write_text("")
        (directory / "config").write_text(
            "\n".join(
                [
                    f"sip_listen {address}:{self.sip_port}",
                    "module_path /usr/lib/baresip/modules",
                    f"module {self._codec_module}",
                    *[f"module {m}" for m in MODULES],
                    f"audio_source aufile,{self._silence}",
                    # A speaker that plays nowhere: the call's audio is decoded (and dumped by sndfile).
                    "audio_player aubridge,speaker",
                    "audio_alert aubridge,alert",
                    f"audio_srate {self.rate}",
                    "audio_channels 1",
                    f"snd_path {directory}",
                    f"ctrl_tcp_listen 127.0.0.1:{self.ctrl_port}",
                    "rtp_stats no",
                    "jitter_buffer_delay 1-10",
                    "",
                ]
            )
        )

    async def start(self, attempts: int = 5) -> None:
        for attempt in range(attempts):
            self._configure()
            with open(self.directory / "baresip.log", "wb") as log:  # baresip keeps its own copy
                self._process = subprocess.Popen(
                    ["baresip", "-f", str(self.directory)], stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT
                )
            deadline = time.monotonic() + 30
            while True:
                try:
                    reader, self._writer = await asyncio.open_connection("127.0.0.1", self.ctrl_port)
                    self._reader_task = asyncio.create_task(self._read(reader))
                    return
                except OSError:
                    if self._process.poll() is not None or time.monotonic() > deadline:
                        break
                    await asyncio.sleep(0.1)
            if self._process.poll() is None:
                self._process.kill()
            if "Address already in use" not in self.log() or attempt == attempts - 1:
                raise RuntimeError(f"baresip did not start: {self.log()[-2000:]}")

    def log(self) -> str:
        return (self.directory / "baresip.log").read_text(errors="replace")

    async def _read(self, reader: asyncio.StreamReader) -> None:
        """ctrl_tcp speaks netstrings ("LEN:JSON,") both ways."""
        while True:
            length = await reader.readuntil(b":")
            body = await reader.readexactly(int(length[:-1]))
            await reader.readexactly(1)
            message = json.loads(body)
            if message.get("event"):
                self.events.append(message)
            elif message.get("response"):
                await self._responses.put(message)

    async def command(self, command: str, params: str = "") -> dict:
        body = json.dumps({"command": command, "params": params, "token": command}).encode()
        self._writer.write(f"{len(body)}:".encode() + body + b",")
        await self._writer.drain()
        return await asyncio.wait_for(self._responses.get(), 30)

    @property
    def uri(self) -> str:
        """Where the phone can be called."""
        return f"sip:phone@{self.address}:{self.sip_port}"

    async def dial(self, uri: str) -> None:
        await self.command("dial", uri)

    async def hang_up(self) -> None:
        await self.command("hangup")

    async def send_digits(self, digits: str) -> None:
        """RFC 2833 telephone events, one key at a time."""
        for digit in digits:
            await self.command("sndcode", digit)
            await asyncio.sleep(0.3)

    async def speak(self, pcm: bytes) -> float:
        """Say `pcm` (mono PCM16 at the phone's `rate`) into the call now: the microphone switches
        to it, and to silence after it. Returns its length in seconds."""
        rate = self.rate
        path = self.directory / f"say-{len(self.events)}-{time.monotonic_ns()}.wav"
        write_microphone(path, pcm, rate)
        await self.command("ausrc", f"aufile,{path}")
        return len(pcm) / 2 / rate

    async def wait_for_event(self, kind: str, timeout: float, since: int = 0) -> dict:
        """The first `kind` event from `events[since]` on (`since=len(phone.events)` before a
        dial: that call's), once baresip reports it."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for event in self.events[since:]:
                if event.get("type") == kind:
                    return event
            await asyncio.sleep(0.05)
        raise AssertionError(f"baresip never reported {kind}; events: {[e.get('type') for e in self.events]}")

    def heard(self) -> tuple[np.ndarray, int]:
        """Everything the phone has heard on its last call (sndfile's decoded-audio dump)."""
        return self._dump("dec")

    def said(self) -> tuple[np.ndarray, int]:
        """Everything the phone has said on its last call (sndfile's dump of what it encoded)."""
        return self._dump("enc")

    def said_at(self) -> list[float]:
        """When each thing the phone said began, in seconds on the timeline of `heard()`.

        Both dumps start with the call's audio and run on baresip's audio clocks, so a moment in
        one is the same moment in the other (to a frame or two). The test's own clock is not: on a
        busy machine the CALL_ESTABLISHED event reached a test 2 s after the dumps had started.
        """
        audio, rate = self.said()
        return utterance_onsets(audio, rate)

    def _dump(self, direction: str) -> tuple[np.ndarray, int]:
        dumps = sorted(self.directory.glob(f"dump-*-{direction}.wav"))
        if not dumps:
            return np.zeros(0, dtype=np.int16), self.rate
        pcm, rate = read_wav(dumps[-1])
        return np.frombuffer(pcm, dtype=np.int16), rate

    async def stop(self) -> None:
        if self._reader_task is not None:
            self._reader_task.cancel()
        if self._writer is not None:
            self._writer.close()
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            try:
                await asyncio.to_thread(self._process.wait, 10)
            except subprocess.TimeoutExpired:
                self._process.kill()
