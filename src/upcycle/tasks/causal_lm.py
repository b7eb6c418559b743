"""The causal-LM task: next-token cross-entropy on packed documents (`data.packing.pack_documents`), padding and
-100 labels masked; evaluated by held-out perplexity (`tasks.evaluate.perplexity`). Its text defaults to the
embedded Wikipedia corpus for the embedded SmolLM2 and folders converted from it."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ..checkpoint.loading import check_sequence_length
from ..config import TrainConfig
from ..data.packing import PackedBatches, pack_documents
from ..data.token_ids import check_token_ids, embedding_rows
from ..errors import UpcycleError
from . import head_loss
from .base import Task
from .evaluate import held_out_rows, perplexity


def causal_lm_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    """Next-token cross-entropy, padding (attention_mask 0) and -100 labels ignored; through the output head a
    chunk of tokens at a time (`head_loss`), so the full logits never exist, where the head allows it."""
    labels, mask = batch.get("labels"), batch.get("attention_mask")
    if labels is None:      # a batch without a mask is all real tokens
        labels = batch["input_ids"] if mask is None else batch["input_ids"].masked_fill(mask == 0, -100)
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    if not head_loss.install(head_loss.unwrapped(model)):
        return model(**inputs, labels=labels, use_cache=False).loss
    with head_loss.labels_for(labels) as computed:
        model(**inputs, use_cache=False)
        loss = computed.loss
    if loss is None:
        raise RuntimeError(f"{type(head_loss.unwrapped(model)).__name__}'s forward did not call its output head")
    return loss


class CausalLMTask(Task):
    name = "causal_lm"

    def __init__(self, cfg: TrainConfig, model: nn.Module, tokenizer, *, is_default: bool | None = None) -> None:
        is_default = from_embedded_model(cfg.model) if is_default is None else is_default
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
            rows = held_out_rows(cfg.eval_tokens, cfg.sequence_length)   # the rows `upcycle eval` reads
            ids, mask = pack_documents(tokenizer, eval_texts, cfg.sequence_length,
                                       max_tokens=rows * cfg.sequence_length)
            check_token_ids(ids, vocabulary, f"evaluation data {cfg.eval_data or '(embedded Wikipedia)'} as tokenized")
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
