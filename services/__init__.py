"""Model engines: one copy of each model per process, shared by every conversation (no Pipecat here)."""
