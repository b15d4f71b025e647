"""A local livekit-server process in dev mode (keys devkey/secret), for development, tests and benchmarks."""

import os
import shutil
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

CONFIG = Path(__file__).resolve().parent.parent / "deploy" / "livekit.yaml"  # shared with Docker
DEV_API_KEY, DEV_API_SECRET = "devkey", "secret"  # what `livekit-server --dev` accepts
START_ATTEMPTS = 3


def free_port(kind: int = socket.SOCK_STREAM) -> int:
    with socket.socket(socket.AF_INET, kind) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def find_livekit_server() -> str | None:
    """`livekit-server` or Go's `server` binary on PATH, or in $GOPATH/bin."""
    found = shutil.which("livekit-server") or shutil.which("server")
    gopath_bin = Path(os.environ.get("GOPATH", Path.home() / "go")) / "bin" / "server"
    return found or (str(gopath_bin) if gopath_bin.is_file() else None)


class LiveKitServerProcess:
    """`with LiveKitServerProcess() as lk: lk.url` — on loopback, on ports of its own."""

    def __init__(self, port: int | None = None, log_path: Path | None = None, redis_host: str | None = None):
        self.binary = find_livekit_server()
        if self.binary is None:
            raise FileNotFoundError(
                "livekit-server is not installed: go install github.com/livekit/livekit-server/cmd/server@v1.13.5"
            )
        self._port_given = port is not None
        self.port = port or free_port()
        self.log_path = log_path
        self.redis_host = redis_host  # "127.0.0.1:6379": needed by the SIP API (trunks, dispatch rules)
        self._process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        """The running server's process id (the benchmarks count its CPU time); None when stopped."""
        return self._process.pid if self._process is not None else None

    def start(self, timeout: float = 30.0) -> "LiveKitServerProcess":
        # A port free_port() found free can be taken before the server binds it: the kernel hands
        # the same ephemeral ports to outgoing connections (a CI run lost one in 200 tests:
        # "listen tcp :55081: bind: address already in use"). A server that exits at once is
        # started again on other ports.
        for attempt in range(START_ATTEMPTS):
            if attempt and not self._port_given:
                self.port = free_port()
            if self._start_once(timeout):
                return self
        raise RuntimeError(f"livekit-server did not start (log: {self.log_path})")

    def _start_once(self, timeout: float) -> bool:
        """Whether the server answers within `timeout`; False (and stopped) if it exits or does not."""
        log = self.log_path.open("w") if self.log_path else subprocess.DEVNULL
        self._process = subprocess.Popen(
            [
                self.binary, "--config", str(CONFIG), "--dev", "--bind", "127.0.0.1",
                "--node-ip", "127.0.0.1", "--port", str(self.port), "--rtc.tcp_port", str(free_port()),
                # All media on one free UDP port: no range to collide with another server's.
                "--udp-port", str(free_port(socket.SOCK_DGRAM)),
                *(["--redis-host", self.redis_host] if self.redis_host else []),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        if self.log_path:
            log.close()  # the server writes to its own copy; a restart opens it anew
        deadline = time.monotonic() + timeout
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}", timeout=1)
                return True
            except OSError:
                if self._process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    return False
                time.sleep(0.2)

    def stop(self) -> None:
        if self._process is None:
            return
        self._process.terminate()
        try:
            self._process.wait(10)
        except subprocess.TimeoutExpired:
            self._process.kill()
        self._process = None

    def __enter__(self) -> "LiveKitServerProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
