"""The one configuration object: environment variables and `.env`, with per-profile defaults."""

import os
from pathlib import Path
from typing import Literal, get_args

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

VOICE_SYSTEM_PROMPT = (
    "You are a friendly voice assistant. Your words are spoken aloud, so answer in one or two "
    "short sentences of plain speech: no lists, no markdown, no emojis."
)

# Models the `gpu` profile uses when nothing else is configured (hub ids or baked-in directories).
GPU_STT_MODEL = "large-v3-turbo"
GPU_LLM_MODEL = "meta-llama/Llama-3.1-8B-Instruct"
ORPHEUS_MODEL = "canopylabs/orpheus-3b-0.1-ft"
SNAC_MODEL = "hubertsiuzdak/snac_24khz"

# The multilingual profile's voices: Kokoro's, one per language, all women's voices (French has
# no other). Kokoro has no German or Korean voice.
KOKORO_VOICE = "af_heart"  # TTS_ENGINE=kokoro's default TTS_VOICE
KOKORO_VOICES = f"en={KOKORO_VOICE},es=ef_dora,fr=ff_siwis,it=if_sara,pt=pf_dora,zh=zf_xiaoxiao,ja=jf_alpha"

# Secrets that libraries put into os.environ themselves: livekit-agents 1.8 copies its key, secret
# and worker token there when its worker starts (`AgentServer.run`), so every child process would
# inherit them.
LIBRARY_SECRET_VARIABLES = ("LIVEKIT_API_KEY", "LIVEKIT_API_SECRET", "LIVEKIT_WORKER_TOKEN")


class Settings(BaseSettings):
    """Every knob of the agent. Each field is also an environment variable (upper case)."""

    model_config = SettingsConfigDict(env_file=".env", env_file_encoding="utf-8", extra="ignore")

    profile: Literal["cpu", "gpu", "multilingual"] = Field(
        "cpu",
        description=(
            "cpu: English, bundled tiny.en, SmolLM2 and Piper. gpu: the large models on cuda. "
            "multilingual (CPU): Whisper base detecting the language of each turn, Qwen2.5-0.5B "
            "and Kokoro, answering in the user's language (TTS_VOICES)."
        ),
    )
    device: str = Field("cpu", description="Default torch/CTranslate2 device for every stage.")
    stt_device: str | None = Field(None, description="STT device; defaults to `device`.")
    llm_device: str | None = Field(None, description="LLM device; defaults to `device`.")
    tts_device: str | None = Field(None, description="TTS device; defaults to `device`.")

    stt_model: str | None = Field(
        None, description="faster-whisper model name or directory; default: bundled tiny.en (cpu)."
    )
    stt_compute_type: str = Field("default", description="CTranslate2 compute type (int8 on cpu).")
    stt_language: str | None = Field(
        None,
        description=(
            "Spoken language (Whisper's code: en, es, ...); empty to detect it in each turn. Default: "
            "detect on the multilingual profile, en otherwise. Set, it pins the conversation's language."
        ),
    )
    stt_workers: int = Field(2, ge=1, description="Transcriptions run in parallel on the one model.")
    stt_beam_size: int = Field(1, ge=1, description="Whisper beam size (1 = greedy, the fastest).")
    stt_cpu_threads: int = Field(
        1,
        ge=1,
        description=(
            "CTranslate2 threads for each transcription on cpu. In the agent on 2 cores, a question "
            "took 0.11-0.14 s on one and 0.16-0.23 s on CTranslate2's default four, which fight the "
            "VAD and the LLM for the cores."
        ),
    )
    stt_short_encode: bool = Field(
        True,
        description=(
            "Encode a turn spoken into silence in a window of its own length (at least 10 s) rather "
            "than Whisper's padded 30 s one: 0.17 s instead of 0.51 s a turn on 2 CPU cores, the same "
            "word error rate over bench.stt_window's phrases; a result that looks like a loop is redone "
            "on the full window. Only in STT_LANGUAGE's language. Sounds heard while the agent speaks "
            "keep the full window (a short encoding writes words for a hum, and words stop the agent)."
        ),
    )

    llm_model: str | None = Field(
        None, description="HF id, local directory or .gguf file; default: bundled SmolLM2 (cpu)."
    )
    llm_gguf_file: str | None = Field(None, description="GGUF file name inside `llm_model`.")
    llm_dtype: str = Field(
        "auto",
        description=(
            "auto (cpu: float32, with every Linear layer whose weights are exactly 4-bit groups, as in "
            "a Q4_1 GGUF, and a tied output layer on torch's int8 kernel: a token in about half the "
            "time; cuda: bfloat16), "
            "float32, bfloat16, float16."
        ),
    )
    llm_cpu_threads: int = Field(
        1,
        ge=1,
        description=(
            "torch threads for the LLM on cpu. One decodes faster than two on 2 cores (39 against "
            "55 ms a step: a step is many small operations) and leaves the other core to STT and TTS."
        ),
    )
    llm_own_process: bool = Field(
        True,
        description=(
            "Run the LLM's continuous batch in a child process with a GIL of its own. Beside four "
            "LiveKit rooms its first words came 2-4x later in the agent's process than alone."
        ),
    )
    llm_max_new_tokens: int = Field(96, ge=1, description="Longest reply, in tokens.")
    llm_context_tokens: int | None = Field(
        None,
        ge=64,
        description=(
            "Most tokens of conversation sent with each request; the oldest turns are left out "
            "first. Default: 512 on cpu (a long prefill delays the first word, and the small model "
            "answers better with less history), 4096 on gpu."
        ),
    )
    reply_max_sentences: int = Field(
        0,
        ge=0,
        description=(
            "Sentences in a reply, unless the user asks for more (a story, an explanation, details); "
            "0 for no limit (the default until the suite has run green with a limit on a loaded "
            "machine). A reply always ends before a sentence that repeats it."
        ),
    )
    llm_temperature: float = Field(0.0, ge=0.0, description="0 = greedy.")
    llm_max_batch: int = Field(16, ge=1, description="Requests decoded together per step.")
    llm_kv_cache_tokens: int = Field(
        16384, ge=256, description="KV cache size shared by all requests, in tokens."
    )
    system_prompt: str | None = Field(
        None,
        description=(
            "Assistant instructions. Default: a spoken-style prompt on gpu; on cpu none, so the "
            "model's own default applies (SmolLM2-135M answers in French given any other prompt)."
        ),
    )

    tts_engine: Literal["piper", "orpheus", "kokoro"] | None = Field(
        None, description="piper, orpheus or kokoro; default: orpheus on gpu, kokoro on multilingual, piper on cpu."
    )
    tts_voice: str | None = Field(
        None,
        description=(
            "Orpheus voice name (tara, leah, jess, leo, dan, mia, zac, zoe; default tara), "
            "Piper .onnx path (default: bundled en_US-joe-medium) or Kokoro voice, whose first letter "
            "names its language (default af_heart)."
        ),
    )
    tts_voices: str | None = Field(
        None,
        description=(
            "A multilingual agent's voice for each language it answers in, `code=voice` comma-separated; "
            f"default with Kokoro: {KOKORO_VOICES}. Its languages are the ones a turn may switch to."
        ),
    )
    tts_workers: int = Field(2, ge=1, description="Piper, Kokoro: sentences synthesized in parallel.")
    orpheus_model: str = Field(ORPHEUS_MODEL, description="Orpheus LM: hub id or local directory.")
    orpheus_models: str | None = Field(
        None,
        description=(
            "Orpheus LMs for other languages, `code=hub id or directory` comma-separated, e.g. "
            "fr=canopylabs/3b-fr-ft-research_release (canopylabs' research release: fr, de, es_it, zh, "
            "ko, hi); a reply in the voice TTS_VOICES gives such a language is spoken by its model, any "
            "other by ORPHEUS_MODEL. Each model has its own TTS_MAX_STREAMS batch and TTS_KV_CACHE_TOKENS "
            "cache; one SNAC decodes for all."
        ),
    )
    snac_model: str = Field(SNAC_MODEL, description="SNAC 24 kHz codec: hub id or local directory.")
    tts_dtype: str = Field("auto", description="Orpheus LM dtype: auto (bfloat16 on cuda), float32, ...")
    tts_temperature: float = Field(0.6, gt=0, description="Orpheus sampling temperature.")
    tts_top_p: float = Field(0.8, gt=0, le=1, description="Orpheus nucleus sampling.")
    tts_max_streams: int = Field(32, ge=1, description="Orpheus utterances generated together per step.")
    tts_kv_cache_tokens: int = Field(
        65536, ge=256, description="Orpheus KV cache shared by all streams, in tokens (112 KiB each in bf16)."
    )
    snac_max_batch: int = Field(32, ge=1, description="SNAC windows decoded in one call.")
    snac_max_wait_ms: float = Field(
        2.0, ge=0, description="How long a SNAC window waits for others to batch with."
    )
    tts_compile: bool = Field(False, description="torch.compile the SNAC decoder (GPU).")

    greeting: str = Field(
        "Hi! I'm your voice assistant. How can I help?",
        description="Said when a user joins; empty for none.",
    )
    echo_cancellation: bool = Field(
        False,
        description=(
            "Remove the agent's own voice from the microphone (WebRTC AEC3) before VAD and STT: for "
            "speakerphones and phone lines. Off by default: browsers cancel echo themselves, and "
            "until AEC3 has heard an echo it also mutes the first ~0.5 s of a user talking over the agent."
        ),
    )
    barge_in_min_words: int = Field(
        1, ge=1, description="Words (besides backchannels like 'mhm') that make the user's sound a barge-in."
    )
    barge_in_min_speech_secs: float = Field(
        1.2, gt=0, description="Speech this long while the agent talks is a barge-in, words or not."
    )
    false_interruption_secs: float = Field(
        1.5, gt=0, description="A sound that paused the agent and brought no words by then: the agent resumes."
    )
    vad_start_secs: float = Field(
        0.1,
        gt=0,
        description="Speech before a user turn starts, or pauses the agent (a false start only pauses it).",
    )
    vad_stop_secs: float = Field(0.2, gt=0, description="Silence before the turn detector runs.")
    vad_min_volume: float = Field(
        0.5,
        ge=0,
        le=1,
        description="Smoothed loudness speech must reach; Pipecat's 0.6 adds ~0.1 s to barge-in.",
    )
    turn_speculation: bool = Field(
        True,
        description=(
            "When smart-turn judges a turn incomplete, start the LLM on the transcript so far while "
            "it waits; the reply is held, then spoken if the turn ends with the same text, or "
            "cancelled if the user speaks again."
        ),
    )

    livekit_url: str | None = Field(None, description="ws(s):// URL of livekit-server; unset = peer-to-peer WebRTC.")
    livekit_api_key: str | None = None
    livekit_api_secret: SecretStr | None = Field(None, description="Never logged.")
    livekit_public_url: str | None = Field(
        None, description="LiveKit URL handed to browsers, when it differs from `livekit_url`."
    )
    agent_name: str = Field("voice-agent", description="Name the worker registers for explicit dispatch.")
    max_sessions: int = Field(8, ge=1, description="Conversations one process takes before refusing.")
    no_audio_timeout_secs: float = Field(
        30.0, gt=0, description="A conversation whose client sends no audio (and hears none) this long ends."
    )
    drain_grace_secs: float = Field(
        60.0,
        ge=1.0,
        description=(
            "On SIGTERM a worker takes no new room; each conversation ends once its current reply "
            "is spoken, and the process exits within this many seconds."
        ),
    )
    session_token_ttl_secs: int = Field(600, ge=10, description="Lifetime of browser tokens.")
    api_key: SecretStr | None = Field(
        None, description="When set, every way in (/api/session, /api/offer, /start, /ws) and /metrics need `Bearer <API_KEY>`."
    )
    allowed_hosts: str | None = Field(
        None,
        description=(
            "Host names the server answers to, comma-separated (* for any): a DNS-rebinding page "
            "cannot reach it under another name. Default: loopback names when HOST is a loopback "
            "address, any otherwise (behind a proxy or in Docker)."
        ),
    )
    allowed_origins: str = Field(
        "",
        description=(
            "Web origins, comma-separated, whose pages may open /ws besides the agent's own; "
            "clients that are not browsers send no Origin and are not affected."
        ),
    )
    session_requests_per_minute: int = Field(
        30, ge=1, description="POST /api/session requests one client address may make per minute."
    )
    metrics_public: bool = Field(False, description="Serve /metrics without the API key (e.g. to a scraper on a private network).")

    tools_end_call: bool = Field(
        False, description="Give the LLM the end_call tool: it says goodbye and ends the call, room or socket."
    )
    mcp_servers: str | None = Field(
        None,
        description="MCP servers whose tools the LLM may call, comma-separated: a streamable-HTTP URL "
        "(http://host:port/mcp) or a command that serves MCP on stdio (`python server.py`).",
    )
    tool_filler: str = Field(
        "One moment, please.", description="Said when a tool call takes longer than TOOL_FILLER_SECS; empty: nothing."
    )
    tool_filler_secs: float = Field(1.5, ge=0.0, description="How long a tool call runs before the filler is said.")
    goodbye: str = Field("Thank you for calling. Goodbye!", description="What the agent says as it ends a call with the end_call tool.")
    tools_transfer_call: bool = Field(
        False, description="Give the LLM the transfer_call tool: phone calls are transferred (REFER) to SIP_TRANSFER_TO."
    )

    sip_port: int | None = Field(
        None, ge=1, le=65535, description="Answer SIP calls on this port (UDP and TCP); unset = no SIP."
    )
    sip_host: str = Field("0.0.0.0", description="Address the SIP endpoint listens on.")
    sip_public_address: str | None = Field(
        None, description="Address put in SDP and Contact headers when the agent is behind NAT."
    )
    sip_rtp_port: int = Field(
        20000, ge=1024, le=65535, description="First UDP port for calls' RTP (each call takes two: RTP and RTCP)."
    )
    sip_rtp_port_range: int = Field(200, ge=2, description="How many RTP ports from SIP_RTP_PORT calls may use.")
    sip_allowed_sources: str = Field(
        "127.0.0.1/32,::1/128",
        description="Addresses or CIDRs, comma-separated, whose calls are answered (a carrier's trunk); others get 403.",
    )
    sip_username: str | None = Field(None, description="With SIP_PASSWORD: callers must also pass digest authentication.")
    sip_password: SecretStr | None = Field(None, description="Digest password callers must know; never logged.")
    sip_trunk: str | None = Field(
        None,
        description="Where the agent's own calls go (`voice-agent sip call`): the carrier trunk's URI, e.g. "
        "sip:trunk.example.com:5060;transport=tcp; a number N is dialled as sip:N@ that host.",
    )
    sip_trunk_username: str | None = Field(None, description="Digest user name the trunk asks of the agent's calls.")
    sip_trunk_password: SecretStr | None = Field(None, description="Digest password for the trunk; never logged.")
    sip_transfer_to: str | None = Field(
        None, description="Where a call is transferred (REFER) when the agent hands the caller on: a number (through SIP_TRUNK) or a sip: URI."
    )
    sip_echo_cancellation: bool = Field(
        False,
        description=(
            "Cancel the agent's echo on phone calls, whatever ECHO_CANCELLATION says. Off by default: "
            "carriers and handsets cancel line echo themselves, and on a call with no echo AEC3 took "
            "the caller's first seconds over the agent for echo (\"Sorry to cut you off\" heard as "
            "\"Thank you. Thank you.\"), so barge-ins early in a reply were missed. Turn it on for "
            "lines that echo the agent back."
        ),
    )

    host: str = "127.0.0.1"
    port: int = Field(7860, ge=1, le=65535)
    cache_dir: Path = Field(
        Path.home() / ".cache" / "voice-agent", description="Converted models (GGUF → HF)."
    )
    hf_token: SecretStr | None = Field(None, description="For gated hub models; never logged.")

    def of_stage(self, stage: str, *names: str) -> dict:
        """One stage's settings as an engine's keyword arguments: `of_stage("tts", "voice")` → {"voice": tts_voice}."""
        return {name: getattr(self, f"{stage}_{name}") for name in names}

    @property
    def host_names(self) -> list[str]:
        """ALLOWED_HOSTS as a list, with its default filled in."""
        if self.allowed_hosts is not None:
            return [h.strip() for h in self.allowed_hosts.split(",") if h.strip()]
        if self.host in ("127.0.0.1", "localhost", "::1"):
            return ["127.0.0.1", "localhost", "::1", "[::1]"]
        return ["*"]

    @property
    def voice_by_language(self) -> dict[str, str]:
        """TTS_VOICES as a mapping ({} when unset)."""
        return _by_language(self.tts_voices)

    @property
    def orpheus_model_by_language(self) -> dict[str, str]:
        """ORPHEUS_MODELS as a mapping ({} when unset)."""
        return _by_language(self.orpheus_models)

    @property
    def livekit_enabled(self) -> bool:
        return bool(self.livekit_url and self.livekit_api_key and self.livekit_api_secret)

    @property
    def tools_configured(self) -> bool:
        return self.tools_end_call or self.tools_transfer_call or bool(self.mcp_servers)

    @property
    def sip_enabled(self) -> bool:
        return self.sip_port is not None

    @model_validator(mode="after")
    def _fill_profile_defaults(self) -> "Settings":
        from services import bundled

        self.stt_device = self.stt_device or self.device
        self.llm_device = self.llm_device or self.device
        self.tts_device = self.tts_device or self.device
        multilingual = self.profile == "multilingual"
        if self.stt_model is None:
            self.stt_model = {"gpu": GPU_STT_MODEL, "multilingual": bundled.WHISPER_BASE}.get(self.profile) or str(
                bundled.whisper_tiny_en()
            )
        if self.stt_language is None:
            self.stt_language = "" if multilingual else "en"
        if self.llm_model is None:
            self.llm_model = {"gpu": GPU_LLM_MODEL, "multilingual": bundled.QWEN_05B}.get(self.profile) or str(
                bundled.smollm2_gguf()
            )
        if self.llm_context_tokens is None:
            self.llm_context_tokens = 4096 if self.profile == "gpu" else 512
        if self.tts_engine is None:
            self.tts_engine = {"gpu": "orpheus", "multilingual": "kokoro"}.get(self.profile, "piper")
        if self.tts_voices is None and self.tts_engine == "kokoro":
            self.tts_voices = KOKORO_VOICES
        if self.tts_voice is None:
            self.tts_voice = {"orpheus": "tara", "kokoro": KOKORO_VOICE}.get(self.tts_engine) or str(bundled.piper_joe())
        if self.stt_compute_type == "default" and self.stt_device == "cpu":
            self.stt_compute_type = "int8"
        if self.system_prompt is None and self.profile in ("gpu", "multilingual"):
            self.system_prompt = VOICE_SYSTEM_PROMPT
        if self.system_prompt == "":
            self.system_prompt = None
        if self.stt_language == "":
            self.stt_language = None
        return self


def _by_language(value: str | None) -> dict[str, str]:
    """`code=item,...` (TTS_VOICES, ORPHEUS_MODELS) as a mapping ({} when unset)."""
    pairs = (entry.split("=", 1) for entry in (value or "").split(",") if "=" in entry)
    return {code.strip(): item.strip() for code, item in pairs}


def secret_variable_names() -> list[str]:
    """Settings' secret fields (API_KEY, LIVEKIT_API_SECRET, HF_TOKEN) and `LIBRARY_SECRET_VARIABLES`."""
    secret_fields = [name.upper() for name, field in Settings.model_fields.items() if SecretStr in get_args(field.annotation)]
    return list(dict.fromkeys([*secret_fields, *LIBRARY_SECRET_VARIABLES]))


def scrub_secrets_from_environment() -> list[str]:
    """Remove every secret from os.environ once Settings and the libraries hold it.

    Child processes (a livekit-server, anything a library spawns) inherit os.environ, and crash
    reporters dump it. Returns the names removed.
    """
    return [name for name in secret_variable_names() if os.environ.pop(name, None) is not None]


def environment_without_secrets() -> dict[str, str]:
    """os.environ for a child process we start ourselves, before the secrets are scrubbed from it."""
    secrets = set(secret_variable_names())
    return {name: value for name, value in os.environ.items() if name not in secrets}
