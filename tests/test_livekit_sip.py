"""SIP through LiveKit: `voice-agent sip setup` against a real livekit-server backed by Redis."""

import asyncio
import shutil
import subprocess
import time

import pytest

from agent.cli import main
from agent.config import Settings
from agent.livekit_dev_server import DEV_API_KEY, DEV_API_SECRET, LiveKitServerProcess, free_port
from agent.livekit_sip import ROOM_PREFIX, list_provisioned


@pytest.fixture(scope="module")
def livekit_with_redis(tmp_path_factory):
    """livekit-server as the compose stack runs it for SIP: with Redis (its SIP API needs it)."""
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is not installed: run scripts/install-sip.sh")
    directory = tmp_path_factory.mktemp("livekit-redis")
    port = free_port()
    redis = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(directory)],
        stdout=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while subprocess.run(["redis-cli", "-p", str(port), "ping"], capture_output=True, text=True).stdout.strip() != "PONG":
            assert redis.poll() is None and time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.1)
        with LiveKitServerProcess(log_path=directory / "livekit.log", redis_host=f"127.0.0.1:{port}") as server:
            yield server.url
    finally:
        redis.terminate()
        redis.wait(10)


@pytest.fixture
def environment(livekit_with_redis, monkeypatch):
    """The settings `voice-agent sip ...` reads, as an operator would export them."""
    for name, value in {
        "LIVEKIT_URL": livekit_with_redis,
        "LIVEKIT_API_KEY": DEV_API_KEY,
        "LIVEKIT_API_SECRET": DEV_API_SECRET,
        "AGENT_NAME": "phone-agent",
        "SIP_ALLOWED_SOURCES": "203.0.113.0/24",
        "SIP_USERNAME": "carrier",
        "SIP_PASSWORD": "trunk-secret",
    }.items():
        monkeypatch.setenv(name, value)
    return Settings(_env_file=None)


async def test_sip_setup_twice_leaves_one_trunk_and_one_rule_dispatching_to_the_agent(environment, capsys):
    settings = environment
    await main_async(["sip", "setup", "--number", "+15550100"])
    first = await list_provisioned(settings)
    await main_async(["sip", "setup", "--number", "+15550100"])
    ours = await list_provisioned(settings)
    assert len(ours.trunks) == 1 and len(ours.rules) == 1, ours
    trunk, rule = ours.trunks[0], ours.rules[0]
    assert trunk.sip_trunk_id == first.trunks[0].sip_trunk_id  # brought up to date, not made anew
    assert list(trunk.numbers) == ["+15550100"]
    assert list(trunk.allowed_addresses) == ["203.0.113.0/24"]
    assert trunk.auth_username == "carrier"
    assert list(rule.trunk_ids) == [trunk.sip_trunk_id]
    assert rule.rule.dispatch_rule_individual.room_prefix == ROOM_PREFIX
    assert [a.agent_name for a in rule.room_config.agents] == ["phone-agent"]

    await main_async(["sip", "list"])
    listed = capsys.readouterr().out
    assert trunk.sip_trunk_id in listed and rule.sip_dispatch_rule_id in listed
    assert "trunk-secret" not in listed

    await main_async(["sip", "teardown"])
    gone = await list_provisioned(settings)
    assert not gone.trunks and not gone.rules


async def main_async(argv: list[str]) -> None:
    """`voice-agent ARGV` in a thread: the command runs its own event loop."""
    await asyncio.to_thread(main, argv)
