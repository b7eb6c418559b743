"""Training tasks: how a model and a data source become batches, a task loss and an evaluation.

- causal_lm: next-token cross-entropy on packed documents (`data.pack_documents`), padding masked; evaluated by
  held-out perplexity.
- clip: symmetric InfoNCE with CLIP's learned temperature, L = (L_I->T + L_T->I) / 2 (docs/methods.md §3), computed by
  transformers' CLIPModel over the batch; evaluated by zero-shot classification and retrieval. The two towers are
  separate backbones, so each MoE layer sees one modality and its router losses are per modality (CLIP-UP).
- contrastive: text encoders (BERT family) on query-document pairs, symmetric in-batch InfoNCE of mean-pooled
  embeddings; evaluated by retrieval (`upcycle.train.contrastive`).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ..checkpoint.loading import check_sequence_length
from ..config import TrainConfig
from ..data.clip_pairs import encode_captions, load_pairs, pixel_values
from ..data.packing import PackedBatches, SeededBatches, pack_documents
from ..data.token_ids import check_token_ids, embedding_rows
from ..errors import UpcycleError
from .evaluate import clip_metrics, held_out_rows, perplexity
from .objective import causal_lm_loss
from .task_kind import model_task


class CausalLMTask:
    name = "causal_lm"

    def __init__(self, cfg: TrainConfig, model: nn.Module, tokenizer, *, is_default: bool) -> None:
        if tokenizer is None:
            raise UpcycleError("causal-LM training needs the model's tokenizer (none found next to the model)")
        check_sequence_length(model, cfg.sequence_length)
        train_texts, eval_texts = self.texts(cfg, is_default)
        ids, mask = pack_documents(tokenizer, train_texts, cfg.sequence_length)
        vocabulary = embedding_rows(model.config)
        check_token_ids(ids, vocabulary, f"training data {cfg.data or '(embedded Wikipedia)'} as tokenized")
        self.train = PackedBatches(ids, mask, cfg.batch_size, cfg.seed)
        self.eval_rows = None
        if eval_texts:
            ids, mask = pack_documents(tokenizer, eval_texts, cfg.sequence_length)
            check_token_ids(ids, vocabulary, f"evaluation data {cfg.eval_data or '(embedded Wikipedia)'} as tokenized")
            rows = held_out_rows(cfg.eval_tokens, cfg.sequence_length)   # the rows `upcycle eval` reads
            self.eval_rows = (ids[:rows], mask[:rows])

    @staticmethod
    def texts(cfg: TrainConfig, is_default: bool) -> tuple[list[str], list[str] | None]:
        from ..data.text import read_texts, wikipedia_split

        def read(path: str, what: str) -> list[str]:
            if Path(path).is_dir():
                raise UpcycleError(f"{what}: {path} is a folder; give a .txt or .jsonl file")
            try:
                return read_texts(path)
            except (OSError, ValueError) as e:       # missing, unreadable, binary (UnicodeDecodeError), bad JSON
                raise UpcycleError(f"{what}: {e}") from None

        wiki = None
        if cfg.data is None or cfg.eval_data is None:
            if is_default:
                wiki = wikipedia_split()
        if cfg.data is None and wiki is None:
            raise UpcycleError("give training text with --data FILE (.txt or .jsonl with a \"text\" field)")
        train = read(cfg.data, "data") if cfg.data is not None else wiki[0]
        held = read(cfg.eval_data, "eval_data") if cfg.eval_data is not None else (wiki[1] if wiki else None)
        return train, held

    def loss(self, model: nn.Module, batch: dict) -> torch.Tensor:
        return causal_lm_loss(model, batch)

    @staticmethod
    def tokens(batch: dict) -> int:
        return int(batch["attention_mask"].sum())

    def evaluate(self, model: nn.Module) -> dict | None:
        if self.eval_rows is None:
            return None
        return perplexity(model, *self.eval_rows, batch_size=8)


class CLIPTask:
    name = "clip"

    def __init__(self, cfg: TrainConfig, model: nn.Module, tokenizer) -> None:
        if tokenizer is None:
            raise UpcycleError("CLIP training needs the model's caption tokenizer (none found next to the model; "
                               "`upcycle tiny-clip` writes one)")
        self.tokenizer = tokenizer
        self.max_length = model.config.text_config.max_position_embeddings
        self.image_size = model.config.vision_config.image_size
        self.patches = (self.image_size // model.config.vision_config.patch_size) ** 2 + 1
        train = load_pairs(cfg.data, split="train")
        self.rows = embedding_rows(model.config)
        self.train = SeededBatches(self.encode(train, f"image-caption pairs {cfg.data or '(digits)'}"),
                                   cfg.batch_size, cfg.seed)
        self.held = None
        if cfg.eval_data is not None or cfg.data in (None, "digits"):
            self.held = load_pairs(cfg.eval_data if cfg.eval_data is not None else cfg.data, split="heldout")

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
        return clip_metrics(model, self.tokenizer, self.held, batch_size=256)


def from_embedded_model(name: str) -> bool:
    """Whether `name` is the embedded SmolLM2 or a folder converted from it (its run_config.yaml says so), so
    that the embedded Wikipedia corpus is its default text."""
    from ..data.assets import DEFAULT_MODEL_NAMES

    if name in DEFAULT_MODEL_NAMES:
        return True
    run_config = Path(name) / "run_config.yaml"
    if not run_config.is_file():
        return False
    import yaml

    try:
        saved = yaml.safe_load(run_config.read_text()) or {}
    except yaml.YAMLError:
        return False
    return isinstance(saved, dict) and saved.get("model") in DEFAULT_MODEL_NAMES


def make_task(cfg: TrainConfig, model: nn.Module, tokenizer):
    from .contrastive import ContrastiveTask

    kind = model_task(model, cfg.task)
    if kind == "contrastive":        # encoders: text pairs (upcycle.train.contrastive)
        return ContrastiveTask(cfg, model, tokenizer)
    if kind == "clip":
        return CLIPTask(cfg, model, tokenizer)
    return CausalLMTask(cfg, model, tokenizer, is_default=from_embedded_model(cfg.model))
