"""The contrastive task for text encoders (docs/contrastive.md): in-batch symmetric InfoNCE on text pairs.

Each step takes B (query, document) pairs, runs the 2B texts through the encoder in ONE forward (so every MoE
layer's routing record, which the router losses, EESD and DPSL read, covers the whole batch), mean-pools the last
hidden states over the attention mask (`upcycle.train.embedding`, as sentence-transformers does for
all-MiniLM-L6-v2), normalizes, and scores s_ij = cos(q_i, d_j) / tau. The loss is symmetric InfoNCE (CLIP,
Radford et al. 2021, eq. in docs/methods.md §3; CLIP-UP trains its text tower with it):

    L = ( CE(S, diag) + CE(S^T, diag) ) / 2,     the other pairs of the batch as negatives.

An off-diagonal entry whose document is the pair's own document (two queries of one gloss) or whose query is the
pair's own query text is no negative: it is masked out of both softmaxes (the same document twice in a batch
would otherwise be pushed away from itself).

Temperature: fixed by default at tau = 0.05, sentence-transformers' MultipleNegativesRankingLoss scale 20, with
which all-MiniLM-L6-v2 was trained (`temperature` in the run config). `InfoNCE(learn=True)` learns it instead as
CLIP does (log 1/tau a parameter, the scale clamped at 100) for a caller that adds the module's parameter to its
optimizer; `upcycle train` uses the fixed one (its optimizer and checkpoints hold the model's parameters only).
Shape suffixes: B pairs, E embedding size, L tokens.
"""

from __future__ import annotations

import math
import random

import torch
import torch.nn.functional as F
from torch import nn

from ..checkpoint.loading import check_sequence_length
from ..config import TrainConfig
from ..data.packing import SeededBatches
from ..data.text_pairs import TextPairs, load_text_pairs
from ..errors import UpcycleError
from .embedding import last_hidden, mean_pool, tokenize, trim
from .retrieval import pair_retrieval

DEFAULT_TEMPERATURE = 0.05      # sentence-transformers MultipleNegativesRankingLoss: scale 20 = 1 / 0.05
DIAGNOSTIC_TEXTS = 256          # held-out texts in `eval_rows` (what `upcycle compare` diagnoses the layers on)


def info_nce(query_BE: torch.Tensor, doc_BE: torch.Tensor, temperature: float | torch.Tensor,
             same_BB: torch.Tensor | None = None) -> torch.Tensor:
    """Symmetric InfoNCE of pair i = (query_i, doc_i) against the batch's other pairs (module docstring), computed
    in float32; `same_BB[i, j]` True marks j as no negative of i (the diagonal is always the positive)."""
    q = F.normalize(query_BE.float(), dim=-1)
    d = F.normalize(doc_BE.float(), dim=-1)
    logits_BB = q @ d.t() / temperature
    if same_BB is not None:
        off_diagonal = same_BB.to(torch.bool) & ~torch.eye(len(q), dtype=torch.bool, device=same_BB.device)
        logits_BB = logits_BB.masked_fill(off_diagonal.to(logits_BB.device), -torch.inf)
    target = torch.arange(len(q), device=logits_BB.device)
    return (F.cross_entropy(logits_BB, target) + F.cross_entropy(logits_BB.t(), target)) / 2


class InfoNCE(nn.Module):
    """`info_nce` with its temperature as a module: fixed (a buffer) or learned (CLIP: log 1/tau a parameter,
    1/tau clamped at `max_scale` = 100)."""

    def __init__(self, temperature: float = DEFAULT_TEMPERATURE, *, learn: bool = False, max_scale: float = 100.0):
        super().__init__()
        if not (math.isfinite(temperature) and temperature > 0):
            raise UpcycleError(f"temperature must be a finite number > 0, got {temperature}")
        log_scale = torch.tensor(math.log(1.0 / temperature))
        if learn:
            self.log_scale = nn.Parameter(log_scale)
        else:
            self.register_buffer("log_scale", log_scale)
        self.max_scale = max_scale

    @property
    def temperature(self) -> torch.Tensor:
        return 1.0 / self.log_scale.exp().clamp(max=self.max_scale)

    def forward(self, query_BE: torch.Tensor, doc_BE: torch.Tensor, same_BB: torch.Tensor | None = None,
                ) -> torch.Tensor:
        return info_nce(query_BE, doc_BE, self.temperature, same_BB)


class PairBatches(SeededBatches):
    """Tokenized pairs in the seeded, resumable order of `SeededBatches`, padded per batch: input_ids and
    attention_mask [B, 2, L] (row 0 the query, row 1 the document, so that slicing a batch by rows keeps pairs
    whole), and doc_index / query_index [B] (which pairs share a document or a query text)."""

    def __init__(self, tokenizer, pairs: TextPairs, batch_size: int, seed: int, max_length: int) -> None:
        super().__init__({"pair": torch.arange(len(pairs))}, batch_size, seed)
        if tokenizer.pad_token_id is None:
            raise UpcycleError("the tokenizer has no padding token to batch texts of different lengths")
        self.pad = tokenizer.pad_token_id
        self.queries = tokenizer(pairs.queries, truncation=True, max_length=max_length)["input_ids"]
        self.documents = tokenizer(pairs.documents, truncation=True, max_length=max_length)["input_ids"]
        # by text, not doc_id: two ids with one text are one document to any encoder, never a negative of it
        self.doc_index = _ids(pairs.documents)
        self.query_index = _ids(pairs.queries)

    def batch(self, step: int) -> dict[str, torch.Tensor]:
        picked = super().batch(step)["pair"].tolist()
        doc, query = self.doc_index[picked], self.query_index[picked]
        if bool(((doc[:, None] == doc[None, :]) | (query[:, None] == query[None, :])).all()):
            raise UpcycleError(f"the training batch of step {step + 1} has no negative pair: its {len(picked)} pairs "
                               f"all share one document or one query, and InfoNCE would train nothing; the pair "
                               f"file needs more distinct documents")
        rows = [(self.queries[i], self.documents[i]) for i in picked]
        length = max(len(t) for pair in rows for t in pair)
        ids = torch.full((len(rows), 2, length), self.pad, dtype=torch.long)
        mask = torch.zeros((len(rows), 2, length), dtype=torch.long)
        for b, pair in enumerate(rows):
            for side, tokens in enumerate(pair):
                ids[b, side, :len(tokens)] = torch.tensor(tokens, dtype=torch.long)
                mask[b, side, :len(tokens)] = 1
        return {"input_ids": ids, "attention_mask": mask, "doc_index": self.doc_index[picked],
                "query_index": self.query_index[picked]}


def _ids(keys: list[str]) -> torch.Tensor:
    """Each key as a small integer, equal keys equal."""
    index: dict[str, int] = {}
    return torch.tensor([index.setdefault(k, len(index)) for k in keys], dtype=torch.long)


def pair_loss(model: nn.Module, batch: dict, temperature: float | torch.Tensor) -> torch.Tensor:
    """InfoNCE of a `PairBatches` batch: queries and documents in one forward, mean-pooled."""
    ids_B2L, mask_B2L = batch["input_ids"], batch["attention_mask"]
    b = ids_B2L.shape[0]
    # queries first, then documents: [2B, L], trimmed to the longest real text of the (micro-)batch
    ids, mask = trim(ids_B2L.transpose(0, 1).reshape(2 * b, -1), mask_B2L.transpose(0, 1).reshape(2 * b, -1))
    embedding = mean_pool(last_hidden(model, ids, mask).float(), mask)
    doc, query = batch["doc_index"], batch["query_index"]
    same_BB = (doc[:, None] == doc[None, :]) | (query[:, None] == query[None, :])
    return info_nce(embedding[:b], embedding[b:], temperature, same_BB)


class ContrastiveTask:
    name = "contrastive"

    def __init__(self, cfg: TrainConfig, model: nn.Module, tokenizer) -> None:
        if tokenizer is None:
            raise UpcycleError("contrastive training needs the encoder's tokenizer (none found next to the model)")
        check_sequence_length(model, cfg.sequence_length)
        self.tokenizer, self.max_length, self.temperature = tokenizer, cfg.sequence_length, cfg.temperature
        train, held = load_text_pairs(cfg.data, cfg.eval_data)
        self.train = PairBatches(tokenizer, train, cfg.batch_size, cfg.seed, cfg.sequence_length)
        # the same held-out pairs whatever the run's seed, so that runs and seeds are scored on one set
        keep = sorted(random.Random(0).sample(range(len(held)), min(len(held), cfg.eval_pairs)))
        self.held = held.subset(keep)
        texts = [t for pair in zip(self.held.queries, self.held.documents, strict=True) for t in pair]
        enc = tokenize(tokenizer, texts[:DIAGNOSTIC_TEXTS], cfg.sequence_length)
        self.eval_rows = (enc["input_ids"], enc["attention_mask"])

    def check_forward_pairs(self, pairs: int) -> None:
        """Refuse a forward of fewer than two pairs (batch_size / (processes x grad_accum)): the other pairs of a
        forward are each pair's negatives, so one pair has none and trains nothing (loss 0, gradient 0)."""
        if pairs < 2:
            raise UpcycleError(f"contrastive training needs at least 2 pairs in each forward, since the other pairs "
                               f"of the batch are each pair's negatives; this run has {pairs} (batch_size / "
                               f"(processes x grad_accum)): raise batch_size")
        if int(self.train.doc_index.max()) < 1:
            raise UpcycleError("every training pair has the same document: InfoNCE has no negative to train "
                               "against; the pair file needs at least two distinct documents")

    def loss(self, model: nn.Module, batch: dict) -> torch.Tensor:
        return pair_loss(model, batch, self.temperature)

    @staticmethod
    def tokens(batch: dict) -> int:
        return int(batch["attention_mask"].sum())

    def evaluate(self, model: nn.Module) -> dict | None:
        return pair_retrieval(model, self.tokenizer, self.held, max_length=self.max_length)


def evaluate_encoder(model: nn.Module, tokenizer, data: str | None, *, sequence_length: int,
                     pairs: int | None = None) -> dict:
    """`upcycle eval` of an encoder: retrieval on `data` (a pair file, evaluated whole) or on the held-out split
    of the packaged pairs; `pairs` caps the number (a fixed sample)."""
    if tokenizer is None:
        raise UpcycleError("evaluating an encoder needs its tokenizer (none found next to the model)")
    if pairs is not None and pairs < 1:
        raise UpcycleError(f"--pairs must be >= 1, got {pairs}")
    check_sequence_length(model, sequence_length)
    if data is None:
        held = load_text_pairs(None)[1]
    else:
        from ..data.text_pairs import read_text_pairs

        held = read_text_pairs(data)
    if pairs is not None and pairs < len(held):
        held = held.subset(sorted(random.Random(0).sample(range(len(held)), pairs)))
    return {"data": data or "held-out split of the packaged pairs", "sequence_length": sequence_length,
            **pair_retrieval(model, tokenizer, held, max_length=sequence_length)}
