#!/usr/bin/env bash
# On a CUDA machine: the latency waterfall with every stage on the GPU (bundled STT and LLM, Orpheus
# with the real 3B architecture and random weights, real-size random SNAC), then Orpheus' stream
# ramp. Results go to bench/results/*-gpu.json. Random weights speak noise: the timings are real,
# the "right answer" column is not meaningful for the Orpheus run.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh piper,dev
scripts/install-livekit.sh
random=$(mktemp -d)
.venv/bin/python -m harness.orpheus_models "$random"   # writes $random/orpheus-lm and $random/snac
export DEVICE=cuda
# Bundled models on the GPU, Piper voice (CPU-only engine) for comparison with the CPU figures.
TTS_ENGINE=piper .venv/bin/python -m bench.latency --transports ws,livekit --baseline stock \
    --out bench/results/latency-gpu-piper.json
# Orpheus 3B (random weights) as the voice.
PROFILE=gpu STT_MODEL="$(.venv/bin/python -c 'from services import bundled; print(bundled.whisper_tiny_en())')" \
    LLM_MODEL="$(.venv/bin/python -c 'from services import bundled; print(bundled.smollm2_gguf())')" \
    TTS_ENGINE=orpheus ORPHEUS_MODEL="$random/orpheus-lm" SNAC_MODEL="$random/snac" \
    .venv/bin/python -m bench.latency --transports ws,livekit --out bench/results/latency-gpu-orpheus.json
.venv/bin/python -m bench.orpheus --device cuda --lm random-3b --streams 1,8,32,64,128 \
    --out bench/results/orpheus-gpu.json
