"""The CLIP task: symmetric InfoNCE with CLIP's learned temperature, L = (L_I->T + L_T->I) / 2 (docs/methods.md
§3), computed by transformers' CLIPModel over the batch; evaluated by zero-shot classification and retrieval. The
two towers are separate backbones, so each MoE layer sees one modality and its router losses are per modality
(CLIP-UP)."""

from __future__ import annotations

import torch
from torch import nn

from ..config import TrainConfig
from ..data.clip_pairs import encode_captions, load_pairs, pixel_values
from ..data.packing import SeededBatches
from ..data.token_ids import embedding_rows
from ..errors import UpcycleError
from .base import Task
from .evaluate import clip_metrics


class CLIPTask(Task):
    name = "clip"

    def __init__(self, cfg: TrainConfig, model: nn.Module, tokenizer) -> None:
        if tokenizer is None:
            raise UpcycleError("CLIP training needs the model's caption tokenizer (none found next to the model; "
                               "`upcycle tiny-clip` writes one)")
        self.tokenizer = tokenizer
        self.max_length = model.config.text_config.max_position_embeddings
        self.image_size = model.config.vision_config.image_size
        self.patches = (self.image_size // model.config.vision_config.patch_size) ** 2 + 1
        train = load_pairs(cfg.data, split="train", image_size=self.image_size)
        self.rows = embedding_rows(model.config)
        self.train = SeededBatches(self.encode(train, f"image-caption pairs {cfg.data or '(digits)'}"),
                                   cfg.batch_size, cfg.seed)
        self.held = None
        if cfg.eval_data is not None or cfg.data in (None, "digits"):
            self.held = load_pairs(cfg.eval_data if cfg.eval_data is not None else cfg.data, split="heldout",
                                   image_size=self.image_size)
        self.held_where = f"held-out captions of {cfg.eval_data or cfg.data or 'digits'}"

    def encode(self, pairs, where: str = "captions") -> dict[str, torch.Tensor]:
        return {**encode_captions(self.tokenizer, pairs.captions, self.max_length, self.rows, where),
                "pixel_values": pixel_values(pairs.images, self.image_size)}

    def loss(self, model: nn.Module, batch: dict) -> torch.Tensor:
        return model(**batch, return_loss=True).loss

    def tokens(self, batch: dict) -> int:
        """Text tokens plus image patches (+ class token) that went through the towers."""
        return int(batch["attention_mask"].sum()) + batch["pixel_values"].shape[0] * self.patches

    def evaluate(self, model: nn.Module) -> dict | None:
        if self.held is None:
            return None
        return clip_metrics(model, self.tokenizer, self.held, batch_size=256, where=self.held_where)
