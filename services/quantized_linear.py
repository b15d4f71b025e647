"""Linear layers on torch's int8 CPU kernel: a GGUF's 4-bit layers and its 8-bit output layer."""

import torch

GROUP = 32  # weights per (scale, zero) group along the input: GGUF's Q4_1 block size
LEVELS = 15  # a 4-bit code is 0..15


def is_4bit_groups(linear: torch.nn.Linear) -> bool:
    """Whether `linear`'s weights are exactly 4-bit codes with one scale and zero per 32 inputs:
    what transformers de-quantizes a GGUF's Q4_0/Q4_1 layers to."""
    weight = linear.weight.detach().float()
    rows, inputs = weight.shape
    if inputs % GROUP:
        return False
    groups = weight.reshape(rows, inputs // GROUP, GROUP)
    low, high = groups.amin(-1), groups.amax(-1)
    scale = ((high - low) / LEVELS).clamp_min(torch.finfo(torch.float32).tiny)
    codes = ((groups - low[..., None]) / scale[..., None]).round().clamp(0, LEVELS)
    rebuilt = codes * scale[..., None] + low[..., None]
    # A 4-bit group rebuilds to float32 rounding; anything else (fp32 weights, 8-bit, k-quants
    # whose groups do not reach both 0 and 15) is off by a sizeable fraction of a step.
    return bool(((rebuilt - groups).abs() <= 1e-3 * scale[..., None]).all())


def pack_4bit_linear_layers(model: torch.nn.Module) -> tuple[int, int]:
    """Run every Linear layer whose weights are exactly 4-bit groups on the int8 kernel (Int8Linear:
    int8 weights with a scale per output row; the activations are not quantized).

    Returns (packed, kept). Layers that are not 4-bit (k-quants, fp32 models) keep their fp32
    weights and answers. The output layer of a tied model shares the embeddings' weights and is
    left to quantize_output_layer.

    Not torch's dynamic int8 kernel (fbgemm), though it read a prompt twice as fast (~3 ms a token
    against ~5.7, decoding ~24 ms a token against ~31, SmolLM2-135M here): it quantizes each call's
    activations with one scale for all its rows, so one token's outlier (a prompt's first token
    carries huge activations) crushes every other row of the call, and in a continuous batch the
    rows are other conversations. With every 4-bit layer on it, SmolLM2-135M answered 25 of 60 short
    questions in one turn (the benchmark's ten and fifty others) and 3 of 60 asked one after another
    in one conversation (each prompt read whole); with int8 weights and unquantized activations 37
    and 42 (fp32: 38 in one turn).
    """
    packed = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear and is_4bit_groups(child):
                setattr(parent, name, Int8Linear(child))
                packed += 1
    kept = sum(type(m) is torch.nn.Linear for m in model.modules())
    return packed, kept


class Int8Linear(torch.nn.Module):
    """A Linear layer holding 8-bit weights with one scale per output: a quarter of fp32's reads.

    Only the weights are quantized, so each row of the input (each token of each request in a
    batch) comes out as it would alone. A GGUF's 4-bit layers lose nothing at 8 bits a row.

    It also runs the output layer of a tied model, which `pack_4bit_linear_layers` leaves in fp32: in
    SmolLM2-135M it is a fifth of the weights but, in fp32, two thirds of what a token reads
    (49152 x 576 x 4 bytes), and in int8 a token took ~25 ms instead of ~37. The bundled GGUF
    stores these weights in 8 bits already (Q8_0, a scale per 32); one scale per row rounds them
    again, and the benchmark questions' greedy answers stayed as they were. In 4 bits they did
    not ("L'Étoile is the capital of France"). The embeddings keep their fp32 copy: a lookup reads
    one row.

    The kernel is a private aten op checked against torch 2.15; tests/test_library_internals.py
    fails when it changes. Activations enter it in bf16 (its fast path).
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
