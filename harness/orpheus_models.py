"""Random-weight models of Orpheus' real architecture (no hub here): a tiny Llama with its vocabulary, a real-size SNAC."""

import json
import math
from pathlib import Path

import torch
from torch import nn
from snac import SNAC
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from services.orpheus.tokens import END_OF_SPEECH, PAD
from services.orpheus.snac import SNAC_24KHZ_CONFIG

ORPHEUS_VOCAB = 156940  # Llama-3's 128256 + Orpheus' added tokens, as in canopylabs/orpheus-3b-0.1-ft


def build_random_snac(seed: int = 0) -> SNAC:
    """SNAC 24 kHz at its real size (19.8 M parameters), random weights that depend on `seed` alone.

    Weights are drawn from a private generator: PyTorch's default init draws from the global
    one, which a running continuous-batching thread also draws from while it samples.
    """
    model = SNAC(**SNAC_24KHZ_CONFIG).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Embedding):
                module.weight.copy_(torch.randn(module.weight.shape, generator=generator))
            elif isinstance(module, (nn.Conv1d, nn.ConvTranspose1d)):
                direction = module.parametrizations.weight.original1  # weight = g · v / |v|
                bound = 1 / math.sqrt(nn.init._calculate_fan_in_and_fan_out(direction)[0])
                direction.copy_(_uniform(direction.shape, bound, generator))
                norm_dims = tuple(range(1, direction.dim()))
                module.parametrizations.weight.original0.copy_(direction.norm(dim=norm_dims, keepdim=True))
                if module.bias is not None:
                    module.bias.copy_(_uniform(module.bias.shape, bound, generator))
    return model


def _uniform(shape, bound: float, generator: torch.Generator) -> torch.Tensor:
    return (torch.rand(shape, generator=generator) * 2 - 1) * bound


def build_tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE that, like Llama-3's, encodes any text and starts with a begin-of-text token."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(
        ["tara: Hello there, how are you today? leah: The weather is nice."],
        trainers.BpeTrainer(
            vocab_size=320,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            special_tokens=["<|begin_of_text|>"],
        ),
    )
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", 0)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<|begin_of_text|>")


def build_tiny_orpheus_lm(seed: int = 0) -> LlamaForCausalLM:
    """A 2-layer Llama with Orpheus' vocabulary layout (audio tokens at 128266 + 4096·p + code)."""
    config = LlamaConfig(
        vocab_size=ORPHEUS_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=END_OF_SPEECH,
        pad_token_id=PAD,
    )
    model = LlamaForCausalLM(config).eval()
    generator = torch.Generator().manual_seed(seed)  # see build_random_snac
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if not name.endswith("norm.weight"):  # RMSNorm scales stay at one
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * config.initializer_range)
    return model


def save_tiny_orpheus(directory: Path) -> tuple[Path, Path]:
    """Write a tiny Orpheus LM and a real-size random SNAC the way their hub repos hold them."""
    lm_dir, snac_dir = directory / "orpheus-lm", directory / "snac"
    build_tiny_orpheus_lm().save_pretrained(lm_dir)
    build_tiny_tokenizer().save_pretrained(lm_dir)
    snac_dir.mkdir(parents=True)
    (snac_dir / "config.json").write_text(json.dumps(SNAC_24KHZ_CONFIG))
    torch.save(build_random_snac().state_dict(), snac_dir / "pytorch_model.bin")
    return lm_dir, snac_dir


def orpheus_3b_config() -> LlamaConfig:
    """canopylabs/orpheus-3b-0.1-ft's architecture (Llama-3.2-3B with Orpheus' vocabulary)."""
    return LlamaConfig(
        vocab_size=ORPHEUS_VOCAB, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
        num_attention_heads=24, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
        rope_theta=500000.0, tie_word_embeddings=True, eos_token_id=END_OF_SPEECH, pad_token_id=PAD,
    )  # fmt: skip


def build_random_orpheus_3b(device: str, dtype: torch.dtype) -> LlamaForCausalLM:
    """Orpheus at its real size with random weights (default init, straight on `device`)."""
    with torch.device(device):
        return LlamaForCausalLM(orpheus_3b_config()).to(dtype).eval()


def save_random_orpheus_3b(directory: Path, device: str = "cuda") -> tuple[Path, Path]:
    """An Orpheus-3B-shaped LM (bf16) and a real-size SNAC, random, saved as their hub repos hold them."""
    lm_dir, snac_dir = directory / "orpheus-lm", directory / "snac"
    build_random_orpheus_3b(device, torch.bfloat16).save_pretrained(lm_dir)
    build_tiny_tokenizer().save_pretrained(lm_dir)
    snac_dir.mkdir(parents=True)
    (snac_dir / "config.json").write_text(json.dumps(SNAC_24KHZ_CONFIG))
    torch.save(build_random_snac().state_dict(), snac_dir / "pytorch_model.bin")
    return lm_dir, snac_dir


if __name__ == "__main__":  # python -m harness.orpheus_models DIR: random Orpheus 3B + SNAC for GPU runs
    import sys

    print(*save_random_orpheus_3b(Path(sys.argv[1])))
