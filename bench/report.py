"""What every benchmark shares: percentiles and tables, the machine a result was measured on, and writing the JSON."""

import datetime
import json
import os
import platform
import resource
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import numpy as np
import torch

RESULTS = Path(__file__).parent / "results"


def now_iso() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def percentile(values, q):
    """q-th percentile (0..100, linear interpolation) of the non-missing values; None if there are none."""
    values = np.asarray([v for v in values if v is not None], dtype=np.float64)
    return float(np.percentile(values, q)) if values.size else None


def summary(values):
    values = [v for v in values if v is not None]
    mean = float(np.mean(values)) if values else None
    return {"n": len(values), "mean": mean, "p50": percentile(values, 50), "p95": percentile(values, 95)}


def print_table(stats, names=None):
    """`stats` maps a metric name to summary(): one row each (n, mean, p50, p95), in seconds."""
    print(f"{'metric (seconds)':<18} {'n':>4} {'mean':>7} {'p50':>7} {'p95':>7}")
    fmt = lambda v: f"{v:7.3f}" if v is not None else f"{'-':>7}"  # noqa: E731
    for m in names or stats:
        print(f"{m:<18} {stats[m]['n']:>4} {fmt(stats[m]['mean'])} {fmt(stats[m]['p50'])} {fmt(stats[m]['p95'])}")


def machine_info(load_average_1m, **extra):
    """The machine and library versions a result was measured with (call at the end of the run)."""
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = None
    return {
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "pipecat": version("pipecat-ai"),
        "transformers": version("transformers"),
        "faster_whisper": version("faster-whisper"),
        **extra,
        "cuda_available": torch.cuda.is_available(),
        "load_average_1m": load_average_1m,  # at the end of the run: other work on the machine skews every number
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
        "git_commit": commit,
    }


def cpu_seconds(pid: int | str | None = "self") -> float | None:
    """CPU time (user + system) a process has used so far, seconds; None for no process. Its
    children's are not counted until it has waited for them (`children_cpu_seconds`)."""
    if pid is None:
        return None
    # /proc/PID/stat: the 14th and 15th fields; the 2nd, the name, is in parentheses and may hold spaces.
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children_cpu_seconds() -> float:
    """CPU time (user + system) of this process' children that have ended and been waited for."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def process_memory_mb(pid: int | str = "self") -> dict[str, float]:
    """A process' resident memory (this one's by default), MB: rss = anon (heap, tensors) + file (mapped files) + shmem.

    `pss` counts a page mapped k times as 1/k each time: a file mapped twice (a safetensors
    checkpoint loaded twice) is in `rss` twice but in `pss` about once. `peak` is the highest RSS
    since the start, or since "5" was written to /proc/self/clear_refs.
    """
    fields = {"VmRSS": "rss", "RssAnon": "anon", "RssFile": "file", "VmHWM": "peak", "Pss": "pss"}
    memory = {}
    for status in (f"/proc/{pid}/status", f"/proc/{pid}/smaps_rollup"):
        for line in Path(status).read_text().splitlines():
            name, _, value = line.partition(":")
            if name in fields:
                memory[fields[name]] = int(value.split()[0]) / 1024  # kB
    return memory


def command_line(module):
    return " ".join([Path(sys.executable).name, "-m", module, *sys.argv[1:]])


def write_json(out, result):
    """Write `result` to `out` atomically (via a temporary file next to it)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=2, default=str) + "\n")
    tmp.replace(out)
