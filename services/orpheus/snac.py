"""Streaming SNAC 24 kHz decoding: window planning per stream, batched decode across streams."""

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from loguru import logger
from snac import SNAC
from snac.layers import DecoderBlock, NoiseBlock
from torch import nn

from services.batcher import DynamicBatcher

SAMPLE_RATE = 24000
SAMPLES_PER_FRAME = 2048  # one Orpheus frame (7 codes) = one L0 code = 4 latent steps of 512 samples
LATENT_STEPS_PER_FRAME = 4
NOISE_PERIOD = 1 << 20  # samples of the noise table (43.7 s at 24 kHz)

# `hubertsiuzdak/snac_24khz`, the codec Orpheus speaks through (19.8 M parameters).
SNAC_24KHZ_CONFIG = dict(
    sampling_rate=24000,
    encoder_dim=48,
    encoder_rates=[2, 4, 8, 8],
    decoder_dim=1024,
    decoder_rates=[8, 8, 4, 2],
    attn_window_size=None,
    codebook_size=4096,
    codebook_dim=8,
    vq_strides=[4, 2, 1],
    noise=True,
    depthwise=True,
)

Frame = tuple[int, int, int, int, int, int, int]  # the 7 codes of one Orpheus frame, in token order


class PositionalNoise(nn.Module):
    """SNAC's NoiseBlock with noise looked up by absolute sample position instead of drawn anew.

    SNAC adds `randn * linear(x)` after each upsampling; fresh noise on every call would make a
    window decode differ from the same samples in a full decode however much context it has.
    Indexing one fixed Gaussian table by position keeps the noise's statistics and makes every
    window reproduce the full decode exactly (tests compare them with the noise on).
    """

    def __init__(self, block: NoiseBlock, table: torch.Tensor, samples_per_frame: int):
        super().__init__()
        self.linear = block.linear
        self.register_buffer("table", table, persistent=False)
        self.samples_per_frame = samples_per_frame
        self.frame_offsets = torch.zeros(1, dtype=torch.long)  # set before each decode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        steps = torch.arange(x.shape[-1], device=x.device)
        positions = (self.frame_offsets[:, None] * self.samples_per_frame + steps) % NOISE_PERIOD
        noise = self.table[positions].to(x.dtype)[:, None, :]
        return x + noise * self.linear(x)


class SnacDecoder:
    """SNAC 24 kHz decoding of 7-code frames, with every stream's windows batched together.

    Load-time changes: weight norm is folded into the weights (~20% faster), noise is
    positional (see PositionalNoise), inference mode throughout, optional torch.compile.
    """

    loads = 0  # models loaded in this process: sessions must share, never add to this

    def __init__(
        self,
        model: SNAC,
        *,
        device: str,
        max_batch: int,
        max_wait_ms: float,
        compile: bool = False,
        noise_seed: int = 0,
    ):
        SnacDecoder.loads += 1
        self.device = torch.device(device)
        self.model = _prepare(model, self.device, noise_seed)
        self._noise = [m for m in self.model.modules() if isinstance(m, PositionalNoise)]
        self._pad_batches = compile  # fixed batch sizes (powers of two) let compiled graphs be reused
        if compile:
            self.model.decoder = torch.compile(self.model.decoder, dynamic=False)
        self.batcher: DynamicBatcher[SnacWindow, np.ndarray] = DynamicBatcher(
            self._decode_batch,
            max_batch=max_batch,
            max_wait_ms=max_wait_ms,
            key=lambda window: len(window.frames),  # one tensor shape per call
            name="snac-batcher",
        )
        self.decode_seconds = 0.0  # compute spent in decode calls, lifetime
        self.decoded_frames = 0

    @classmethod
    def load(cls, source: str, *, device: str, **kwargs) -> "SnacDecoder":
        """Load from a hub id or a local directory (config.json + pytorch_model.bin)."""
        started = time.perf_counter()
        model = SNAC.from_pretrained(source)
        logger.info(f"SNAC {source} loaded on {device} in {time.perf_counter() - started:.1f}s")
        return cls(model, device=device, **kwargs)

    @torch.inference_mode()
    def decode_frames(self, frames: torch.Tensor, first_frames: torch.Tensor) -> torch.Tensor:
        """(B, W, 7) codes whose windows start at absolute frames `first_frames` → (B, W·2048) audio."""
        batch, width = frames.shape[:2]
        frames = frames.to(self.device)
        codes = [
            frames[:, :, 0],
            frames[:, :, [1, 4]].reshape(batch, 2 * width),
            frames[:, :, [2, 3, 5, 6]].reshape(batch, 4 * width),
        ]
        offsets = first_frames.to(self.device)  # once, not once per noise block
        for noise in self._noise:
            noise.frame_offsets = offsets
        started = time.perf_counter()
        audio = self.model.decoder(self.model.quantizer.from_codes(codes))[:, 0, :].float()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.decode_seconds += time.perf_counter() - started
        self.decoded_frames += batch * width
        return audio

    def decode_utterance(self, frames: Sequence[Frame]) -> np.ndarray:
        """All frames of one utterance in one call: the reference that streaming must match."""
        codes = torch.tensor([list(frames)], dtype=torch.long)
        return self.decode_frames(codes, torch.zeros(1, dtype=torch.long))[0].cpu().numpy()

    def _decode_batch(self, windows: list["SnacWindow"]) -> list[np.ndarray]:
        rows = len(windows)
        padded = 1 << math.ceil(math.log2(rows)) if self._pad_batches else rows
        windows_in = windows + [windows[-1]] * (padded - rows)
        codes = torch.tensor([w.frames for w in windows_in], dtype=torch.long)
        starts = torch.tensor([w.first_frame for w in windows_in], dtype=torch.long)
        audio = self.decode_frames(codes, starts).cpu().numpy()
        return [w.kept(audio[i]) for i, w in enumerate(windows)]

    async def decode(self, window: "SnacWindow") -> np.ndarray:
        """The float audio of `window`'s kept frames, decoded in a batch with other streams' windows."""
        return await self.batcher.submit(window)

    def close(self) -> None:
        self.batcher.close()


@dataclass
class SnacWindow:
    """Frames [first_frame, first_frame + len(frames)) to decode, of which [keep_from, keep_to) are emitted."""

    frames: list[Frame]
    first_frame: int
    keep_from: int
    keep_to: int

    def kept(self, audio: np.ndarray) -> np.ndarray:
        start = (self.keep_from - self.first_frame) * SAMPLES_PER_FRAME
        return audio[start : start + (self.keep_to - self.keep_from) * SAMPLES_PER_FRAME]


@dataclass
class SnacWindowPlanner:
    """Decides, for one stream, which window to decode next so every frame is emitted exactly once.

    Each emitted frame has `context` frames decoded on both sides (SNAC's receptive field is
    ±2.3 frames; 2 frames give ~1e-5 relative error vs a full decode), except at the
    utterance's own edges, where a window edge coincides with the full decode's edge and is
    exact. Frame 0 is emitted once `context + 1` frames exist (21 tokens). Hops then grow
    1, 2, 4, ... up to `max_hop`, so compute per second of audio falls to
    (max_hop + 2·context) / max_hop decoded frames per frame (2× at the defaults; the
    reference decodes 4 frames per frame) while the early chunks stay small. At end of speech
    the tail is decoded in a window of the steady-state width, reaching further left.
    """

    context: int = 2
    max_hop: int = 4
    frames: list[Frame] = field(default_factory=list)
    emitted: int = 0

    @property
    def width(self) -> int:
        return self.max_hop + 2 * self.context

    def push(self, frame: Frame) -> None:
        self.frames.append(frame)

    def next_window(self, *, final: bool = False) -> SnacWindow | None:
        """The next window to decode, or None until more frames arrive (or, when final, when done)."""
        held, done = len(self.frames), self.emitted
        hop = min(self.max_hop, done + 1)
        if held >= done + hop + self.context:
            return self._window(max(0, done - self.context), done + hop + self.context, done, done + hop)
        if final and held > done:
            return self._window(max(0, held - self.width), held, done, held)
        return None

    def _window(self, first: int, stop: int, keep_from: int, keep_to: int) -> SnacWindow:
        self.emitted = keep_to
        return SnacWindow(self.frames[first:stop], first, keep_from, keep_to)


def _prepare(model: SNAC, device: torch.device, noise_seed: int) -> SNAC:
    """Fold weight norm into the weights and swap each NoiseBlock for PositionalNoise.

    A reach into the snac package's layer layout (checked against snac 1.2.1: DecoderBlock.block
    is [Snake, ConvTranspose1d, NoiseBlock, ResidualUnit...]); tests/test_library_internals.py and
    the streamed-equals-full-decode tests fail if it changes.
    """
    for module in model.modules():
        if hasattr(module, "parametrizations") and "weight" in module.parametrizations:
            torch.nn.utils.parametrize.remove_parametrizations(module, "weight", leave_parametrized=True)
    table = torch.randn(NOISE_PERIOD, generator=torch.Generator().manual_seed(noise_seed))
    samples_per_frame = LATENT_STEPS_PER_FRAME
    for block in model.decoder.model:
        if not isinstance(block, DecoderBlock):
            continue  # the convolutions before and after the upsampling blocks
        layers = block.block
        samples_per_frame *= layers[1].stride[0]  # the block's transposed convolution
        for i, layer in enumerate(layers):
            if isinstance(layer, NoiseBlock):
                layers[i] = PositionalNoise(layer, table, samples_per_frame)
    return model.to(device).eval()
