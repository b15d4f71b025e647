"""The latency waterfall over a real livekit-server alone: `python -m bench.latency --transports livekit`."""

import asyncio
import os
import sys

from loguru import logger

from bench.latency import main, parser
from bench.report import RESULTS
from agent.config import Settings

if __name__ == "__main__":
    logger.remove()
    logger.add(sys.stderr, level="WARNING")
    args = parser.parse_args(["--transports", "livekit", *sys.argv[1:]])
    args.out = args.out or RESULTS / f"livekit-latency-{Settings().profile}.json"
    asyncio.run(main(args))
    os._exit(0)  # LiveKit's job threads can outlive the loop
