"""Linear layers on torch's quantized CPU kernels: 4-bit groups (the GGUF's own) and an 8-bit output layer."""

import torch

GROUP = 32  # weights per (scale, zero) group along the input: GGUF's Q4_1 block size
LEVELS = 15  # a 4-bit code is 0..15


class Int4Linear(torch.nn.Module):
    """A Linear layer holding 4-bit codes (one scale and zero per 32 inputs): the same weights, read in under half the time.

    Decoding a small LLM on CPU is bound by reading its weights once per token: SmolLM2-135M reads
    540 MB of fp32 per token (~85 ms here). Its bundled GGUF is Q4_1, so transformers' de-quantized
    fp32 weights are exactly `scale * code + low` in groups of 32: packing them back loses nothing
    but the rounding of scale and zero to bf16, and a token reads ~80 MB (~40 ms in the batch).

    The kernel is torch's own (tinygemm, the one gpt-fast and torchao call), reached through private
    aten ops checked against torch 2.15; tests/test_library_internals.py fails when they change.
    torchao 0.18 wraps the same ops for CPU only as a prototype tensor subclass, and it chooses its
    own scales: we only pack weights that are already 4-bit, so ours are exact by construction.
    Activations enter the kernel in bf16 (its fast path; fp32 input runs 25x slower).
    """

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, low: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = codes.shape
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
        # The kernel computes (code - 8) * scale + zero, per group: [groups, out_features, 2].
        self.scale_and_zero = torch.stack([scale, low + 8 * scale], -1).transpose(0, 1).contiguous().bfloat16()
        self.bias = bias

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear) -> "Int4Linear | None":
        """The packed layer if `linear`'s weights are exactly 4-bit groups of 32, else None."""
        weight = linear.weight.detach().float()
        rows, inputs = weight.shape
        if inputs % GROUP:
            return None
        groups = weight.reshape(rows, inputs // GROUP, GROUP)
        low, high = groups.amin(-1), groups.amax(-1)
        scale = ((high - low) / LEVELS).clamp_min(torch.finfo(torch.float32).tiny)
        codes = ((groups - low[..., None]) / scale[..., None]).round().clamp(0, LEVELS)
        rebuilt = codes * scale[..., None] + low[..., None]
        # A 4-bit group rebuilds to float32 rounding; anything else (fp32 weights, 8-bit, k-quants
        # whose groups do not reach both 0 and 15) is off by a sizeable fraction of a step.
        if ((rebuilt - groups).abs() > 1e-3 * scale[..., None]).any():
            return None
        return cls(codes.reshape(rows, inputs), scale, low, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, GROUP, self.scale_and_zero)
        y = y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


def pack_4bit_linear_layers(model: torch.nn.Module) -> tuple[int, int]:
    """Swap every Linear layer whose weights are exactly 4-bit groups for an Int4Linear.

    Returns (packed, kept). The output layer of a tied model shares the embeddings' weights (8-bit
    in the bundled GGUF) and stays as it is.
    """
    packed = kept = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not torch.nn.Linear:
                continue
            replacement = Int4Linear.from_linear(child)
            if replacement is None:
                kept += 1
            else:
                setattr(parent, name, replacement)
                packed += 1
    return packed, kept


class Int8Linear(torch.nn.Module):
    """A Linear layer holding 8-bit weights with one scale per output: a quarter of fp32's reads.

    For the output layer of a tied model, which `pack_4bit_linear_layers` leaves in fp32: in
    SmolLM2-135M it is a fifth of the weights but, in fp32, two thirds of what a token reads
    (49152 x 576 x 4 bytes), and in int8 a token took ~25 ms instead of ~37. The bundled GGUF
    stores these weights in 8 bits already (Q8_0, a scale per 32); one scale per row rounds them
    again, and the benchmark questions' greedy answers stayed as they were. In 4 bits they did
    not ("L'Étoile is the capital of France"). The embeddings keep their fp32 copy: a lookup reads
    one row.

    The kernel is a private aten op checked against torch 2.15; tests/test_library_internals.py
    fails when it changes. Activations enter it in bf16, as in Int4Linear.
    """

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        weight = linear.weight.detach().float()
        self.out_features, self.in_features = weight.shape
        scale = (weight.abs().amax(1) / 127).clamp_min(torch.finfo(torch.float32).tiny)
        self.codes = (weight / scale[:, None]).round().clamp(-127, 127).to(torch.int8).contiguous()
        self.scale = scale.bfloat16()
        self.bias = None if linear.bias is None else linear.bias.detach().clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16)
        y = torch.ops.aten._weight_int8pack_mm(flat, self.codes, self.scale)
        y = y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


def quantize_output_layer(model: torch.nn.Module) -> bool:
    """Run a model's fp32 output layer on the int8 kernel; False if it is not an fp32 Linear."""
    head = model.get_output_embeddings()
    if type(head) is not torch.nn.Linear or head.weight.dtype != torch.float32:
        return False
    model.set_output_embeddings(Int8Linear(head))
    model.config.tie_word_embeddings = False  # a later tie_weights() must not swap the fp32 copy back
    return True
