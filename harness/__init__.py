"""Helpers for tests and benchmarks, not shipped with the agent: in-process sessions, a LiveKit caller, speech, fixtures."""
