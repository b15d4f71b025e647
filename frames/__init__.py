"""Pipecat frame processors: thin per-session adapters that turn frames into engine requests and back."""
