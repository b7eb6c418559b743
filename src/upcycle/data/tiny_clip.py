"""A tiny random dense CLIPModel sized for the offline digits image-caption task (`upcycle tiny-clip`).

No pretrained CLIP installs offline, so the CLIP protocol (pretrain dense, upcycle with CLIP-UP, continue) starts
from this model; its text tower reads the word-level caption tokenizer of `upcycle.data.packing.clip_pairs`.
"""

from __future__ import annotations

import torch

from ..errors import UpcycleError

HEADS = 4


def check_sizes(*, image_size: int, patch_size: int, hidden_size: int, layers: int, max_length: int,
                seed: int) -> None:
    """Refuse sizes that build no model (a zero, a patch that does not tile the image, a width the heads do not
    divide) or one far beyond a tiny model (so a typo cannot start allocating terabytes)."""
    bounds = {"image_size": (image_size, 1, 1024), "patch_size": (patch_size, 1, 1024),
              "hidden_size": (hidden_size, HEADS, 8192), "layers": (layers, 1, 64),
              "max_length": (max_length, 3, 4096), "seed": (seed, 0, 2**32 - 1)}
    for name, (value, low, high) in bounds.items():
        if not low <= value <= high:
            raise UpcycleError(f"--{name.replace('_', '-')} must be from {low} to {high:,}, got {value}")
    if image_size % patch_size:
        raise UpcycleError(f"--patch-size {patch_size} must divide --image-size {image_size}")
    if hidden_size % HEADS:
        raise UpcycleError(f"--hidden-size must be a multiple of the {HEADS} attention heads, got {hidden_size}")


def tiny_clip(tokenizer, *, image_size: int = 16, patch_size: int = 4, hidden_size: int = 64, layers: int = 4,
              projection_dim: int = 64, max_length: int = 16, seed: int = 0):
    """A small random dense CLIPModel whose text tower reads `tokenizer`'s ids (EOS pooling), with `HEADS`
    attention heads in each tower."""
    import transformers

    torch.manual_seed(seed)
    tower = dict(hidden_size=hidden_size, intermediate_size=4 * hidden_size, num_hidden_layers=layers,
                 num_attention_heads=HEADS)
    config = transformers.CLIPConfig(
        projection_dim=projection_dim,
        text_config=dict(tower, vocab_size=len(tokenizer), max_position_embeddings=max_length,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id),
        vision_config=dict(tower, image_size=image_size, patch_size=patch_size, num_channels=3))
    return transformers.CLIPModel(config)
