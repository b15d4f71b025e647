"""What the HTTP side shows a stranger: with API_KEY set nothing opens without it, bad input gets a 4xx, nothing leaks."""

import asyncio
import json

import httpx
import numpy as np
import pytest
from aiortc import RTCPeerConnection
from pipecat.frames.frames import InputAudioRawFrame
from pydantic import SecretStr
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from agent.app import create_app
from agent.livekit_dev_server import free_port
from frames.audio_guard import MAX_RESAMPLERS, InputAudioGuard
from harness.serving import agent_settings as with_livekit
from harness.serving import serving
from harness.speech import normalize
from agent.ws_client import VoiceClient

API_KEY = "exposure-test-key"
KEY = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
async def keyed_agent(engines, settings):
    """The agent as `voice-agent serve` runs it peer to peer, with an API key."""
    agent_settings = settings.model_copy(update={"api_key": SecretStr(API_KEY), "port": free_port()})
    async with serving(create_app(agent_settings, engines), agent_settings.port) as app:
        yield f"127.0.0.1:{agent_settings.port}", app


async def test_no_way_in_without_the_key(keyed_agent):
    address, _ = keyed_agent
    async with httpx.AsyncClient(base_url=f"http://{address}") as http:
        offer = {"sdp": "v=0", "type": "offer"}
        for method, path, body in (("POST", "/api/offer", offer), ("POST", "/start", None), ("GET", "/metrics", None)):
            response = await http.request(method, path, json=body)
            assert response.status_code == 401, (path, response.status_code, response.text)
        ice = {"pc_id": "x", "candidates": []}
        assert (await http.patch("/api/offer", json=ice)).status_code == 401
        # With it: the metrics are served, /start answers.
        assert (await http.get("/metrics", headers=KEY)).status_code == 200
        assert (await http.post("/start", headers=KEY)).status_code == 200
        # Nothing to browse: no API docs.
        for path in ("/docs", "/redoc", "/openapi.json"):
            assert (await http.get(path)).status_code == 404, path


async def test_a_broken_offer_is_a_client_error_and_leaves_no_session(keyed_agent):
    address, app = keyed_agent
    async with httpx.AsyncClient(base_url=f"http://{address}") as http:
        for offer in ({"sdp": "x", "type": "offer"}, {"sdp": "v=0\r\n" * 20000, "type": "offer"}, {"sdp": "x", "type": "answer"}):
            response = await http.post("/api/offer", json=offer, headers=KEY)
            assert 400 <= response.status_code < 500, (response.status_code, response.text)
    await asyncio.sleep(0.5)
    assert app.state.sessions.active == 0


async def test_health_names_models_without_paths(keyed_agent):
    address, _ = keyed_agent
    async with httpx.AsyncClient(base_url=f"http://{address}") as http:
        health = (await http.get("/health")).json()
    assert health["status"] == "ok"
    assert all("/" not in name for name in health["models"].values()), health


async def test_an_unknown_host_name_is_refused(keyed_agent):
    address, _ = keyed_agent
    async with httpx.AsyncClient(base_url=f"http://{address}") as http:
        response = await http.get("/health", headers={"Host": "attacker.example"})
    assert response.status_code == 400


async def test_a_foreign_web_page_cannot_open_the_websocket(keyed_agent):
    address, _ = keyed_agent
    headers = {**KEY, "Origin": "https://attacker.example"}
    with pytest.raises(InvalidStatus) as refused:
        async with connect(f"ws://{address}/ws", additional_headers=headers):
            pass
    assert refused.value.response.status_code == 403
    # The agent's own page (same origin) and non-browser clients (no Origin) get in.
    async with connect(f"ws://{address}/ws", additional_headers={**KEY, "Origin": f"http://{address}"}) as ws:
        await ws.send(b"\x00\x00" * 320)
    async with connect(f"ws://{address}/ws", additional_headers=KEY) as ws:
        await ws.send(b"\x00\x00" * 320)


async def test_a_client_cycling_sample_rates_keeps_few_resamplers(settings):
    guard = InputAudioGuard()
    silence = np.zeros(160, dtype=np.int16).tobytes()
    for rate in range(8000, 8000 + 300 * 7, 7):
        assert guard._repair(InputAudioRawFrame(audio=silence, sample_rate=rate, num_channels=1)) is not None
    assert len(guard._resamplers) <= MAX_RESAMPLERS


async def test_session_requests_are_rate_limited_per_client(livekit_url, engines, settings):
    agent_settings = with_livekit(
        settings,
        livekit_url,
        agent_name="rate-limit-test",  # not the shared live agent's: it takes no rooms of theirs
        session_requests_per_minute=3,
    )
    async with serving(create_app(agent_settings, engines), agent_settings.port):
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{agent_settings.port}") as http:
            codes = [(await http.post("/api/session")).status_code for _ in range(4)]
    assert codes == [200, 200, 200, 429], codes


async def test_a_websocket_holds_no_slot_until_its_first_audio_and_is_let_go_when_audio_stops(engines, settings):
    agent_settings = settings.model_copy(update={"port": free_port(), "no_audio_timeout_secs": 3.0})
    url = f"ws://127.0.0.1:{agent_settings.port}/ws"
    async with serving(create_app(agent_settings, engines), agent_settings.port) as app:
        # Connected and announced, but no audio: no slot, and let go at the deadline with a reason.
        async with connect(url) as idle:
            await idle.send(json.dumps({"type": "start", "sample_rate": 16000}))
            await asyncio.sleep(1.0)
            assert app.state.sessions.active == 0
            error = json.loads(await asyncio.wait_for(idle.recv(), timeout=60))
            assert error["type"] == "error" and "no audio" in error["message"], error
            with pytest.raises(ConnectionClosed):
                await asyncio.wait_for(idle.recv(), timeout=60)
        # Audio takes a slot; when it stops, the conversation ends and the slot is free again.
        async with connect(url) as stops:
            await stops.send(bytes(640))  # 20 ms of silence
            for _ in range(100):
                if app.state.sessions.active == 1:
                    break
                await asyncio.sleep(0.1)
            assert app.state.sessions.active == 1
            with pytest.raises(ConnectionClosed):  # the agent ends it; nothing more is sent
                while True:
                    await asyncio.wait_for(stops.recv(), timeout=60)
        for _ in range(100):
            if app.state.sessions.active == 0:
                break
            await asyncio.sleep(0.1)
        assert app.state.sessions.active == 0


async def test_an_answered_offer_holds_no_slot_until_its_peer_connects(engines, settings, say):
    agent_settings = settings.model_copy(update={"port": free_port(), "max_sessions": 1})
    async with serving(create_app(agent_settings, engines), agent_settings.port) as app:
        peers = [RTCPeerConnection() for _ in range(2)]  # they offer, and never connect
        for peer in peers:
            peer.addTransceiver("audio", direction="sendrecv")
            await peer.setLocalDescription(await peer.createOffer())
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{agent_settings.port}") as http:
            answered = await http.post("/api/offer", json={"sdp": peers[0].localDescription.sdp, "type": "offer"})
            assert answered.status_code == 200, answered.text
            # Peers waiting to connect are capped apart (at the capacity, here 1).
            second = await http.post("/api/offer", json={"sdp": peers[1].localDescription.sdp, "type": "offer"})
            assert second.status_code == 503 and "connecting" in second.text, second.text
        # The one slot is still free: a user on /ws gets it and is answered.
        async with VoiceClient(f"ws://127.0.0.1:{agent_settings.port}/ws") as user:
            reply = await user.ask(await say("What is the capital of France?"))
        assert "paris" in normalize(reply.text), (reply.text, user.events)
        assert app.state.sessions.active <= 1
        for peer in peers:
            await peer.close()


async def test_junk_offers_and_silent_sockets_cannot_keep_a_user_out(engines, settings, say):
    """8 junk offers, offers whose peer never connects, and 8 silent sockets hold no slot: a real
    user is admitted at once and answered, and the silent sockets are let go at the deadline."""
    no_audio_secs = 5.0
    agent_settings = settings.model_copy(update={"port": free_port(), "no_audio_timeout_secs": no_audio_secs, "max_sessions": 2})
    async with serving(create_app(agent_settings, engines), agent_settings.port) as app:
        address = f"127.0.0.1:{agent_settings.port}"
        async with httpx.AsyncClient(base_url=f"http://{address}") as http:
            for _ in range(8):
                junk = await http.post("/api/offer", json={"sdp": "x", "type": "offer"})
                assert junk.status_code == 400, junk.text
            peers = [RTCPeerConnection() for _ in range(2)]
            for peer in peers:  # a real offer, answered, and then nobody connects
                peer.addTransceiver("audio", direction="sendrecv")
                await peer.setLocalDescription(await peer.createOffer())
                offer = {"sdp": peer.localDescription.sdp, "type": "offer"}
                assert (await http.post("/api/offer", json=offer)).status_code == 200
        silent = [await connect(f"ws://{address}/ws") for _ in range(8)]
        await asyncio.sleep(1.0)
        assert app.state.sessions.active == 0  # none of them holds a slot

        async with VoiceClient(f"ws://{address}/ws") as user:
            reply = await user.ask(await say("What is the capital of France?"))
        assert "paris" in normalize(reply.text), (reply.text, user.events)
        for ws in silent:
            with pytest.raises(ConnectionClosed):  # each silent socket is let go at the deadline
                while True:
                    await asyncio.wait_for(ws.recv(), timeout=30)
        for peer in peers:
            await peer.close()
