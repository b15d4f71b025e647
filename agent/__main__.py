"""`python -m agent` is the `voice-agent` command."""

from agent.cli import main

main()
