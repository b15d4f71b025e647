"""The `voice-agent` command line: argument parsing and process start-up, nothing else."""

import argparse
import asyncio
import signal
import sys
from pathlib import Path

from loguru import logger

LOG_LEVELS = ["TRACE", "DEBUG", "INFO", "WARNING", "ERROR"]


def add_log_level(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--log-level", default="INFO", type=str.upper, choices=LOG_LEVELS, help="(default: INFO)"
    )


def add_server_options(parser: argparse.ArgumentParser) -> None:
    # Defaults stay None so that Settings (environment, .env) decides what is unset here.
    parser.add_argument("--host", help="address to listen on (default: $HOST or 127.0.0.1)")
    parser.add_argument("--port", type=int, help="port to listen on (default: $PORT or 7860)")
    add_log_level(parser)


def settings_from(args: argparse.Namespace, *names: str):
    """Settings from the environment and .env, with the options given on the command line on top."""
    from agent.config import Settings

    return Settings(**{name: getattr(args, name) for name in names if getattr(args, name) is not None})


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="voice-agent",
        description="A self-hosted voice agent: local STT, LLM and TTS, served over WebRTC.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, run, summary: str, description: str) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=summary, description=description)
        sub.set_defaults(run=run)
        return sub

    add_server_options(command(
        "serve", serve_command, "serve the agent and its browser client over HTTP and WebRTC",
        "Load the models, then serve /health, /api/offer (WebRTC) and /client/; with SIP_PORT set, "
        "also answer phone calls over SIP on that port.",
    ))  # fmt: skip
    dev = command(
        "dev", dev_command,
        "local development: livekit-server (when installed), the worker and the HTTP server in one go",
        "Start livekit-server in dev mode if it is on PATH (or in $GOPATH/bin), then serve the agent "
        "with LiveKit: HTTP server and agent worker in this one process, sharing the models. Without "
        "livekit-server, serve peer-to-peer WebRTC instead.",
    )  # fmt: skip
    add_server_options(dev)
    dev.add_argument("--livekit-port", type=int, default=7880, help="livekit-server port (default: 7880)")

    worker = command(
        "worker", worker_command,
        "register with livekit-server and talk in every room the agent is dispatched to",
        "Load the models once, register with LiveKit as an agent worker (LIVEKIT_URL, LIVEKIT_API_KEY, "
        "LIVEKIT_API_SECRET) and run one conversation per dispatched room, all in this process, "
        "sharing the models.",
    )  # fmt: skip
    worker.add_argument("--agent-name", help="name to be dispatched by (default: $AGENT_NAME or voice-agent)")
    worker.add_argument("--max-sessions", type=int, help="rooms taken before refusing (default: $MAX_SESSIONS or 8)")
    add_log_level(worker)

    command(
        "download", download_command,
        "download the configured profile's hub models now (Docker builds bake them in this way)",
        "Fetch every model the settings load from the Hugging Face hub into its cache (HF_HOME), so the "
        "agent starts without downloading. Bundled models and local paths are skipped.",
    )  # fmt: skip

    client = command(
        "client", client_command,
        "talk to a running agent over its /ws WebSocket: microphone and speaker, or WAV files",
        "Connect to URL (ws://HOST:PORT/ws) once and talk: from the microphone to the speaker (needs the "
        "sounddevice package), or, with --input, say each WAV file as one turn and wait for the agent's "
        "reply before the next; --output saves the replies' audio.",
    )  # fmt: skip
    client.add_argument("url", help="the agent's WebSocket, e.g. ws://127.0.0.1:7860/ws")
    client.add_argument("--input", type=Path, action="append", help="a WAV file to say (repeat for more turns)")
    client.add_argument("--output", type=Path, help="WAV file for the agent's replies (24 kHz)")
    client.add_argument("--api-key", help="the agent's API_KEY, when it has one (default: $API_KEY)")

    sip = command(
        "sip", lambda args: sip.print_help(), "phone calls the agent makes",
        "Ask a running agent (voice-agent serve with SIP_PORT set) to act on the phone.",
    )  # fmt: skip
    sip_commands = sip.add_subparsers(dest="sip_command", metavar="SIP_COMMAND")
    call = sip_commands.add_parser(
        "call", help="the agent calls a number or SIP URI and speaks first",
        description="Ask the running agent to call NUMBER_OR_URI: a number is dialled through SIP_TRUNK, a "
        "sip: URI directly. The agent greets whoever answers and converses as on any call.",
    )  # fmt: skip
    call.add_argument("target", metavar="NUMBER_OR_URI", help="e.g. +4930123456 or sip:alice@pbx.example.com")
    call.add_argument("--url", help="the running agent (default: http://127.0.0.1:$PORT)")
    call.add_argument("--api-key", help="the agent's API_KEY, when it has one (default: $API_KEY)")
    call.set_defaults(run=sip_call_command)
    setup = sip_commands.add_parser(
        "setup", help="make LiveKit send phone calls to this agent (inbound trunk + dispatch rule)",
        description="Through livekit-api (LIVEKIT_URL, LIVEKIT_API_KEY, LIVEKIT_API_SECRET; livekit-server "
        "needs Redis for SIP): an inbound trunk for calls to --number from SIP_ALLOWED_SOURCES (with "
        "SIP_USERNAME/SIP_PASSWORD when set), and a dispatch rule that puts each call in a room of its own "
        "with AGENT_NAME dispatched. Running it again updates them; it never makes a second pair.",
    )  # fmt: skip
    setup.add_argument("--number", action="append", default=[], help="a phone number the trunk takes calls for (repeat; none: any)")
    setup.set_defaults(run=sip_setup_command)
    sip_commands.add_parser("list", help="show the LiveKit trunk and dispatch rule `sip setup` made").set_defaults(run=sip_list_command)
    sip_commands.add_parser("teardown", help="delete them").set_defaults(run=sip_teardown_command)
    return parser


def print_provisioned(provisioned, verb: str) -> None:
    for trunk in provisioned.trunks:
        numbers = ", ".join(trunk.numbers) or "any number"
        print(f"{verb} trunk {trunk.sip_trunk_id} ({trunk.name}): {numbers} from {', '.join(trunk.allowed_addresses) or 'anywhere'}")
    for rule in provisioned.rules:
        agents = ", ".join(a.agent_name for a in rule.room_config.agents)
        print(f"{verb} rule {rule.sip_dispatch_rule_id} ({rule.name}): each call a room, agent {agents}")


def sip_setup_command(args: argparse.Namespace) -> None:
    from agent.config import Settings
    from agent.livekit_sip import setup

    print_provisioned(run_livekit_sip(setup(Settings(), args.number)), "set up")


def sip_list_command(args: argparse.Namespace) -> None:
    from agent.config import Settings
    from agent.livekit_sip import list_provisioned

    provisioned = run_livekit_sip(list_provisioned(Settings()))
    print_provisioned(provisioned, "has")
    if not provisioned.trunks and not provisioned.rules:
        print("nothing set up (voice-agent sip setup)")


def sip_teardown_command(args: argparse.Namespace) -> None:
    from agent.config import Settings
    from agent.livekit_sip import teardown

    print_provisioned(run_livekit_sip(teardown(Settings())), "deleted")


def run_livekit_sip(coroutine):
    from livekit.api import TwirpError

    try:
        return asyncio.run(coroutine)
    except ValueError as e:
        sys.exit(str(e))
    except TwirpError as e:  # livekit-server said no: "sip not connected (redis required)", bad keys ...
        sys.exit(f"livekit-server refused: {e.message}")


def sip_call_command(args: argparse.Namespace) -> None:
    import json
    import os
    import urllib.error
    import urllib.request

    url = args.url or f"http://127.0.0.1:{os.environ.get('PORT', '7860')}"
    api_key = args.api_key or os.environ.get("API_KEY")
    request = urllib.request.Request(
        f"{url.rstrip('/')}/api/sip/calls",
        data=json.dumps({"to": args.target}).encode(),
        headers={"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})},
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            print(f"calling {args.target}: call {json.load(response)['call']}")
    except urllib.error.HTTPError as e:
        sys.exit(f"the agent refused the call ({e.code}): {e.read().decode(errors='replace')}")
    except urllib.error.URLError as e:
        sys.exit(f"no agent answers at {url}: {e.reason}")


def client_command(args: argparse.Namespace) -> None:
    import os

    from agent.ws_client import talk_from_files, talk_from_microphone

    api_key = args.api_key or os.environ.get("API_KEY")
    if args.input:
        asyncio.run(talk_from_files(args.url, args.input, args.output, api_key))
    elif args.output:
        sys.exit("--output needs --input (in microphone mode the replies play on the speaker)")
    else:
        try:
            asyncio.run(talk_from_microphone(args.url, api_key))
        except KeyboardInterrupt:
            pass


def download_command(args: argparse.Namespace) -> None:
    from agent.config import Settings
    from agent.download import download_models, hub_models

    settings = Settings()
    if not hub_models(settings):
        print(f"the {settings.profile} profile's models are bundled or local: nothing to download")
        return
    for path in download_models(settings):
        print(f"  -> {path}")


def dev_command(args: argparse.Namespace) -> None:
    import os

    from agent.livekit_dev_server import DEV_API_KEY, DEV_API_SECRET, LiveKitServerProcess, find_livekit_server

    if find_livekit_server() is None:
        print("livekit-server not found; serving peer-to-peer WebRTC instead", flush=True)
        serve_command(args)
        return
    with LiveKitServerProcess(port=args.livekit_port) as livekit:
        print(f"livekit-server (dev keys) listening at {livekit.url}", flush=True)
        os.environ.update(
            LIVEKIT_URL=livekit.url, LIVEKIT_API_KEY=DEV_API_KEY, LIVEKIT_API_SECRET=DEV_API_SECRET
        )
        serve_command(args)


def worker_command(args: argparse.Namespace) -> None:
    from agent.engines import load_engines_warm
    from agent.server.admission import Admission
    from agent.server.metrics import AgentMetrics
    from agent.server.sessions import SessionRegistry, session_capacity
    from agent.transports.livekit import create_agent_server, drain

    logger.remove()
    logger.add(sys.stderr, level=args.log_level)
    settings = settings_from(args, "agent_name", "max_sessions")
    if not settings.livekit_enabled:
        sys.exit("voice-agent worker needs LIVEKIT_URL, LIVEKIT_API_KEY and LIVEKIT_API_SECRET")

    async def run() -> None:
        engines = await load_engines_warm(settings)
        sessions = SessionRegistry(session_capacity(settings))
        admission = Admission(settings, sessions, AgentMetrics(sessions), engines_of=lambda: engines)
        server = create_agent_server(engines, admission)

        async def drain_and_stop() -> None:
            await drain(server, sessions, settings.drain_grace_secs)
            await server.aclose()

        server.on("worker_registered", lambda worker_id, _info: print(f"voice-agent worker: registered as {worker_id}", flush=True))
        # SIGTERM (an orchestrator scaling down): drain, then exit. SIGINT (Ctrl-C): stop now.
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, lambda: asyncio.ensure_future(drain_and_stop()))
        print(f"voice-agent worker: registering as {settings.agent_name!r} at {settings.livekit_url}", flush=True)
        try:
            await server.run()
        finally:
            await server.aclose()
            engines.close()

    asyncio.run(run())


def serve_command(args: argparse.Namespace) -> None:
    # Imported here so that `--help` answers without loading pipecat and torch.
    import uvicorn

    from agent.app import create_app, uvicorn_config

    logger.remove()
    logger.add(sys.stderr, level=args.log_level)
    settings = settings_from(args, "host", "port")
    app = create_app(settings)
    config = uvicorn_config(app, host=settings.host, port=settings.port, log_level=args.log_level.lower())
    asyncio.run(serve_and_announce(uvicorn.Server(config), settings))


async def serve_and_announce(server, settings) -> None:
    """Run uvicorn and print the client's URL once the socket is listening."""
    serving = asyncio.create_task(server.serve())
    while not server.started and not serving.done():
        await asyncio.sleep(0.05)
    if server.started:
        host = "127.0.0.1" if settings.host in ("0.0.0.0", "::") else settings.host
        print(f"voice-agent is listening: open http://{host}:{settings.port}/client/", flush=True)
        if settings.sip_enabled:
            print(f"voice-agent answers SIP calls on {settings.sip_host}:{settings.sip_port} (UDP, TCP)", flush=True)
    await serving


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    args.run(args)
