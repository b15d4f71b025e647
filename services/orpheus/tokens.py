"""Orpheus' token layout: the vocabulary's control and audio ids, the parser from ids to SNAC frames, and the code mask."""

import torch
from transformers import LogitsProcessor

from services.orpheus.snac import SAMPLE_RATE, SAMPLES_PER_FRAME, Frame

# Token ids of the Orpheus vocabulary (Llama-3 + 28,683 added tokens; <custom_token_N> = 128256 + N).
START_OF_SPEECH = 128257
END_OF_SPEECH = 128258  # the stop token (the reference engine's 49158 is a bug)
START_OF_HUMAN = 128259
END_OF_HUMAN = 128260
START_OF_AI = 128261
END_OF_TEXT = 128009
PAD = 128263
AUDIO_BASE = 128266  # audio token = AUDIO_BASE + 4096·position + code
CODES = 4096
POSITIONS = 7  # tokens per frame: SNAC L0 ← p0, L1 ← p1 p4, L2 ← p2 p3 p5 p6
FRAMES_PER_SECOND = SAMPLE_RATE / SAMPLES_PER_FRAME  # 11.72
TOKENS_PER_SECOND = POSITIONS * FRAMES_PER_SECOND  # 82.03: a stream below this rate stutters


class OrpheusTokenParser:
    """Turns generated token ids into complete SNAC frames, checking every code's position.

    Each audio id is `AUDIO_BASE + 4096·position + code` and must sit at the position the
    running count expects. Code 0 is a code like any other. A token at the wrong position
    means the model lost the frame grid: the partial frame is dropped and the parser waits
    for the next position-0 token (a misplaced position-0 token starts that frame at once).
    Guessing a slot for it would feed codes to the wrong SNAC level for the rest of the
    utterance; dropping costs at most one frame (85 ms). Ids outside the audio range (text
    tokens, control tokens) are rejected and counted; END_OF_SPEECH ends the utterance.
    """

    def __init__(self) -> None:
        self._frame: list[int] = []
        self._resyncing = False
        self.finished = False
        self.misplaced = 0  # tokens found at the wrong position
        self.skipped = 0  # valid-range tokens dropped: partial frames and tokens while resyncing
        self.rejected = 0  # ids outside the audio range

    def feed(self, ids: list[int]) -> list[Frame]:
        """Consume the ids of one generation step (any number); return the frames they complete."""
        frames: list[Frame] = []
        for token in ids:
            if self.finished:
                break
            if token == END_OF_SPEECH:
                self.finished = True
                self.skipped += len(self._frame)
                self._frame = []
                break
            offset = token - AUDIO_BASE
            if not 0 <= offset < POSITIONS * CODES:
                self.rejected += 1
                continue
            position, code = divmod(offset, CODES)
            if self._resyncing and position != 0:
                self.skipped += 1
                continue
            self._resyncing = False
            if position != len(self._frame):
                self.misplaced += 1
                self.skipped += len(self._frame)
                self._frame = []
                if position != 0:
                    self.skipped += 1
                    self._resyncing = True
                    continue
            self._frame.append(code)
            if len(self._frame) == POSITIONS:
                frames.append(tuple(self._frame))
                self._frame = []
        return frames


def audio_token(position: int, code: int) -> int:
    return AUDIO_BASE + CODES * position + code


class OrpheusCodeMask(LogitsProcessor):
    """Allows only the codes of the next frame position, and END_OF_SPEECH only after a whole frame.

    The next position follows from the last token alone (after START_OF_SPEECH: 0; after an
    audio token at p: p+1 mod 7), so this needs no per-request state and works inside
    transformers' continuous batching, which hands processors only each row's last token.
    With it a sampled stream cannot lose the frame grid.
    """

    supports_continuous_batching = True

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        last = input_ids if input_ids.dim() == 1 else input_ids[:, -1]
        offset = last - AUDIO_BASE
        is_audio = (offset >= 0) & (offset < POSITIONS * CODES)
        position = torch.where(is_audio, offset // CODES + 1, 0) % POSITIONS
        low = (AUDIO_BASE + CODES * position)[:, None]
        vocab = torch.arange(scores.shape[-1], device=scores.device)[None, :]
        allowed = (vocab >= low) & (vocab < low + CODES)
        allowed[:, END_OF_SPEECH] = is_audio & (position == 0)
        return scores.masked_fill(~allowed, float("-inf"))
