"""The LLM's int8 layers: which layers are packed, and that batched requests do not change each other's numbers."""

import torch

from services.quantized_linear import GROUP, Int8Linear, pack_4bit_linear_layers


def exact_4bit_linear(inputs: int, outputs: int) -> torch.nn.Linear:
    """A Linear layer as transformers de-quantizes a GGUF Q4_1 one: 4-bit codes, a scale and a zero per 32 inputs."""
    codes = torch.randint(0, 16, (outputs, inputs)).float()
    codes[:, ::GROUP], codes[:, 1::GROUP] = 0, 15  # as Q4_1 quantizes: each group spans 0..15
    scale = torch.rand(outputs, inputs // GROUP) * 0.01 + 0.001
    low = torch.randn(outputs, inputs // GROUP) * 0.05
    layer = torch.nn.Linear(inputs, outputs, bias=False)
    with torch.no_grad():
        layer.weight.copy_((codes.reshape(outputs, -1, GROUP) * scale[..., None] + low[..., None]).reshape(outputs, inputs))
    return layer


def test_only_exact_4bit_layers_are_packed_and_they_keep_their_outputs():
    torch.manual_seed(0)
    model = torch.nn.Sequential(exact_4bit_linear(128, 96), torch.nn.Linear(96, 64))
    x = torch.randn(3, 128)
    with torch.inference_mode():
        expected = model(x)
    assert pack_4bit_linear_layers(model) == (1, 1), "exact 4-bit groups packed, fp32 weights kept"
    assert type(model[0]) is Int8Linear and type(model[1]) is torch.nn.Linear
    with torch.inference_mode():
        got = model(x)
    assert (got - expected).abs().max() < 0.02 * expected.abs().max(), (got - expected).abs().max()


def test_a_row_comes_out_the_same_beside_another_requests_outlier():
    # In a continuous batch the rows of one call are different conversations' tokens. A prompt's
    # first token carries activations a hundred times the others': a kernel that scales the
    # activations per call (torch's dynamic int8 one) rounds every other row to a few levels.
    torch.manual_seed(0)
    layer = Int8Linear(exact_4bit_linear(576, 256))
    token = torch.randn(1, 576)
    outlier = torch.randn(1, 576)
    outlier[0, :4] = 3000.0
    with torch.inference_mode():
        alone = layer(token)
        batched = layer(torch.cat([outlier, token, outlier]))[1:2]
    assert torch.equal(alone, batched)
