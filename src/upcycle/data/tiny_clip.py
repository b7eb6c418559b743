"""A tiny random dense CLIPModel sized for the offline digits image-caption task (`upcycle tiny-clip`).

No pretrained CLIP installs offline, so the CLIP protocol (pretrain dense, upcycle with CLIP-UP, continue) starts
from this model; its text tower reads the word-level caption tokenizer of `upcycle.data.packing.clip_pairs`.
"""

from __future__ import annotations

import torch


def tiny_clip(tokenizer, *, image_size: int = 16, patch_size: int = 4, hidden_size: int = 64, layers: int = 4,
              heads: int = 4, projection_dim: int = 64, max_length: int = 16, seed: int = 0):
    """A small random dense CLIPModel whose text tower reads `tokenizer`'s ids (EOS pooling)."""
    import transformers

    torch.manual_seed(seed)
    tower = dict(hidden_size=hidden_size, intermediate_size=4 * hidden_size, num_hidden_layers=layers,
                 num_attention_heads=heads)
    config = transformers.CLIPConfig(
        projection_dim=projection_dim,
        text_config=dict(tower, vocab_size=len(tokenizer), max_position_embeddings=max_length,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id),
        vision_config=dict(tower, image_size=image_size, patch_size=patch_size, num_channels=3))
    return transformers.CLIPModel(config)
