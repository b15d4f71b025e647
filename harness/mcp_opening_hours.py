"""A small MCP server for tests (stdio): one tool, the restaurant's opening hours; each call is logged to a file."""

import sys
from pathlib import Path

from mcp.server.mcpserver import MCPServer

CALLS = Path(sys.argv[1]) if len(sys.argv) > 1 else None  # where each call is written, one per line
server = MCPServer("opening-hours")


@server.tool()
def opening_hours(day: str) -> str:
    """The restaurant's opening hours on a day of the week."""
    if CALLS is not None:
        with CALLS.open("a") as f:
            f.write(f"{day}\n")
    return f"On {day} the restaurant is open from nine in the morning to five in the evening."


if __name__ == "__main__":
    server.run("stdio")
