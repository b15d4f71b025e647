"""Tools from MCP servers (MCP_SERVERS), through Pipecat's MCPClient: one client per conversation."""

import asyncio
import shlex

from loguru import logger
from mcp import StdioServerParameters
from mcp.client.session_group import StreamableHttpParameters
from pipecat.services.mcp_service import MCPClient

from agent.config import Settings


def mcp_clients(settings: Settings) -> list[MCPClient]:
    """A client per configured server: an http(s) URL is streamable HTTP, anything else a stdio command.

    A stdio server is a child process; the MCP SDK gives it only a safe default environment
    (HOME, PATH, ...), so the agent's secrets do not reach it."""
    clients = []
    for entry in (settings.mcp_servers or "").split(","):
        entry = entry.strip()
        if not entry:
            continue
        if entry.startswith(("http://", "https://")):
            clients.append(MCPClient(StreamableHttpParameters(url=entry)))
        else:
            command, *args = shlex.split(entry)
            clients.append(MCPClient(StdioServerParameters(command=command, args=args)))
    return clients


async def add_mcp_tools(conversation, clients: list[MCPClient]) -> None:
    """List each server's tools and give them to the conversation's LLM; close the connections
    (and stop stdio servers) when the conversation ends. A conversation chore: it starts with the
    conversation and is cancelled at its end. A server that cannot be reached costs its tools only."""
    try:
        for client in clients:
            try:
                tools = await client.tools()
            except Exception as e:
                logger.warning(f"an MCP server is unavailable, its tools are not offered: {e}")
                continue
            for schema in tools.standard_tools:
                conversation.add_tool(schema, schema.handler)
            logger.info(f"MCP tools offered: {[s.name for s in tools.standard_tools]}")
        await asyncio.Event().wait()  # until the conversation ends
    finally:
        for client in clients:
            await client.close()
