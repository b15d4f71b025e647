"""Prometheus metrics of one agent process: turn latencies, errors, sessions and engine load, served at /metrics."""

from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from agent.engines import Engines
from agent.server.sessions import SessionRegistry
from agent.turn_metrics import TurnLatency

LATENCY_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 8.0, 13.0)
RTF_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 4.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)

__all__ = ["AgentMetrics", "CONTENT_TYPE_LATEST"]


class AgentMetrics:
    """Everything /metrics reports. One per process (tests make one per app: separate registries).

    Per-turn figures are pushed by each conversation (it is their `ConversationMetrics`);
    engine and session state is read when scraped, so idle engines cost nothing.
    """

    def __init__(self, sessions: SessionRegistry, engines_of: Callable[[], Engines | None] = lambda: None):
        self.registry = CollectorRegistry()
        stage = dict(registry=self.registry, buckets=LATENCY_BUCKETS)
        self.stt_seconds = Histogram("voice_agent_stt_seconds", "End of speech to final transcript.", **stage)
        self.llm_first_token_seconds = Histogram(
            "voice_agent_llm_first_token_seconds", "LLM request to first token.", **stage
        )
        self.tts_first_audio_seconds = Histogram(
            "voice_agent_tts_first_audio_seconds", "Text into the TTS to its first audio.", **stage
        )
        self.voice_to_voice_seconds = Histogram(
            "voice_agent_voice_to_voice_seconds", "End of user speech to first agent audio played.", **stage
        )
        self.tts_realtime_factor = Histogram(
            "voice_agent_tts_realtime_factor",
            "Synthesis time over audio duration, per sentence (below 1 keeps up).",
            registry=self.registry,
            buckets=RTF_BUCKETS,
        )
        self.audio_underruns = Counter(
            "voice_agent_audio_underruns_total",
            "Agent audio that ran dry mid-reply (it stopped and restarted with no user turn between).",
            registry=self.registry,
        )
        self.errors = Counter(
            "voice_agent_errors_total", "Errors by kind (stt, llm, tts, audio_input, ...).", ["kind"],
            registry=self.registry,
        )  # fmt: skip
        self.sessions_refused = Counter(
            "voice_agent_sessions_refused_total", "Sessions refused because the process was full.", ["transport"],
            registry=self.registry,
        )  # fmt: skip
        self.sessions_started = Counter(
            "voice_agent_sessions_started_total", "Conversations started.", registry=self.registry
        )
        self.registry.register(_EngineCollector(sessions, engines_of))

    def observe_turn(self, turn: TurnLatency) -> None:
        for histogram, value in (
            (self.stt_seconds, turn.stt),
            (self.llm_first_token_seconds, turn.llm_first_token),
            (self.tts_first_audio_seconds, turn.tts_first_audio),
            (self.voice_to_voice_seconds, turn.voice_to_voice),
        ):
            if value is not None:
                histogram.observe(value)

    def count_error(self, kind: str) -> None:
        self.errors.labels(kind=kind).inc()

    def count_underrun(self) -> None:
        self.audio_underruns.inc()

    def observe_tts_sentence(self, audio_seconds: float, wall_seconds: float) -> None:
        self.tts_realtime_factor.observe(wall_seconds / audio_seconds)

    def count_session_started(self) -> None:
        self.sessions_started.inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector(Collector):
    """Reads the shared engines and the session registry at scrape time."""

    def __init__(self, sessions: SessionRegistry, engines_of):
        self._sessions = sessions
        self._engines_of = engines_of

    def collect(self):
        yield _gauge("voice_agent_sessions_active", "Conversations running.", self._sessions.active)
        yield _gauge("voice_agent_sessions_capacity", "Conversations this process takes.", self._sessions.capacity)
        yield _gauge("voice_agent_load", "Load reported to LiveKit (active / capacity).", self._sessions.load)
        engines = self._engines_of()
        if engines is None or not engines.ready:
            return
        queued = GaugeMetricFamily(
            "voice_agent_engine_queue_depth", "Requests waiting for or inside an engine.", labels=["engine"]
        )
        for stage, engine in engines.by_stage().items():
            queued.add_metric([stage], engine.in_flight)
        for name, batcher in engines.batchers().items():
            queued.add_metric([name], batcher.queue_depth)
        yield queued
        requests = CounterMetricFamily("voice_agent_llm_requests", "LLM requests by outcome.", labels=["outcome"])
        for outcome, count in vars(engines.llm.stats).items():
            requests.add_metric([outcome], count)
        yield requests
        for name, batcher in engines.batchers().items():
            yield _batch_sizes(name, batcher.stats.batch_sizes)


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)


def _batch_sizes(engine: str, sizes: dict[int, int]) -> HistogramMetricFamily:
    """A batcher's lifetime batch-size counts as a Prometheus histogram."""
    buckets, cumulative = [], 0
    for bound in BATCH_BUCKETS:
        cumulative = sum(count for size, count in sizes.items() if size <= bound)
        buckets.append((str(bound), cumulative))
    buckets.append(("+Inf", sum(sizes.values())))
    family = HistogramMetricFamily(
        "voice_agent_batch_size", "Items per batched engine call.", labels=["engine"]
    )
    family.add_metric([engine], buckets, sum_value=sum(size * count for size, count in sizes.items()))
    return family
