"""The contrastive task for text encoders (docs/contrastive.md): in-batch symmetric InfoNCE on text pairs.

Each step takes B (query, document) pairs, runs the 2B texts through the encoder in ONE forward (so every MoE
layer's routing record, which the router losses, EESD and DPSL read, covers the whole batch), mean-pools the last
hidden states over the attention mask (`upcycle.tasks.embedding`, as sentence-transformers does for
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
from ..core.devices import pin_tensors, to_device
from ..core.moe import joined_records
from ..core.routing_context import real_positions, real_tokens
from ..data.length_buckets import bucket_plan
from ..data.packing import SeededBatches
from ..data.text_pairs import TextPairs, load_text_pairs, text_chars
from ..data.token_ids import check_token_ids, embedding_rows
from ..data.token_lists import token_lists
from ..errors import UpcycleError
from .base import Task
from .embedding import attention_for_many_shapes, last_hidden, mean_pool, tokenize
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
    whole), and doc_index / query_index [B] (which pairs share a document or a query text).

    Every text is tokenized once, at start-up, into one padded [N, 2, L_max] table, so a step is an index-select
    and a trim; the check that a batch has a negative pair runs once per epoch over all of its batches."""

    def __init__(self, tokenizer, pairs: TextPairs, batch_size: int, seed: int, max_length: int) -> None:
        super().__init__({"pair": torch.arange(len(pairs))}, batch_size, seed)
        if tokenizer.pad_token_id is None:
            raise UpcycleError("the tokenizer has no padding token to batch texts of different lengths")
        queries = token_lists(tokenizer, pairs.queries, max_length)
        documents = token_lists(tokenizer, pairs.documents, max_length)
        self.ids_N2L, self.lengths_N2 = _table([t for pair in zip(queries, documents, strict=True) for t in pair],
                                               tokenizer.pad_token_id, rows=len(pairs))
        # by text, not doc_id: two ids with one text are one document to any encoder, never a negative of it
        self.doc_index = _ids(pairs.documents)
        self.query_index = _ids(pairs.queries)
        self._epoch: tuple[int, torch.Tensor, torch.Tensor] | None = None

    def _epoch_plan(self, epoch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(the epoch's order [per_epoch, B], which of its batches has no negative pair), made once per epoch.
        A batch has no negative exactly when all its pairs share one document or all share one query (two pairs
        with different documents and one query, and a third with another query, always leave a pair that
        differs in both)."""
        if self._epoch is None or self._epoch[0] != epoch:
            order = self._order(epoch)[: self.per_epoch * self.batch_size].view(self.per_epoch, self.batch_size)
            doc, query = self.doc_index[order], self.query_index[order]
            none = (doc == doc[:, :1]).all(1) | (query == query[:, :1]).all(1)
            self._epoch = (epoch, order, none)
        return self._epoch[1], self._epoch[2]

    def first_without_negative(self, steps: int, start: int = 0) -> int | None:
        """The first step from `start` to `steps` whose batch has no negative pair, or None: the order of every
        epoch is known from the seed, so a run learns it at start-up, not at that step."""
        for epoch in range(start // self.per_epoch, -(-steps // self.per_epoch)):
            _, no_negative = self._epoch_plan(epoch)
            for index in no_negative.nonzero().flatten().tolist():
                step = epoch * self.per_epoch + index
                if start <= step < steps:
                    return step
        return None

    def batch(self, step: int) -> dict[str, torch.Tensor]:
        epoch, index = divmod(step, self.per_epoch)
        order, no_negative = self._epoch_plan(epoch)
        if bool(no_negative[index]):
            raise UpcycleError(f"the training batch of step {step + 1} has no negative pair: its {self.batch_size} "
                               f"pairs all share one document or one query, and InfoNCE would train nothing; the "
                               f"pair file needs more distinct documents")
        picked = order[index]
        lengths = self.lengths_N2[picked]
        width = int(lengths.max())
        return {"input_ids": self.ids_N2L[picked, :, :width], "attention_mask": _mask(lengths, width),
                "doc_index": self.doc_index[picked], "query_index": self.query_index[picked]}


def _table(texts: list[list[int]], pad: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists (query, document, query, ...) as one padded [rows, 2, L] table and their lengths [rows, 2]."""
    lengths = torch.tensor([len(t) for t in texts], dtype=torch.long)
    width = max(1, int(lengths.max())) if len(texts) else 1
    ids = torch.full((len(texts), width), pad, dtype=torch.long)
    ids[_mask(lengths, width).bool()] = torch.tensor([i for t in texts for i in t], dtype=torch.long)
    return ids.view(rows, 2, width), lengths.view(rows, 2)


def _mask(lengths: torch.Tensor, width: int) -> torch.Tensor:
    """Right-padding attention masks [..., width] of texts of `lengths` [...]."""
    return (torch.arange(width) < lengths.unsqueeze(-1)).long()


def _ids(keys: list[str]) -> torch.Tensor:
    """Each key as a small integer, equal keys equal."""
    index: dict[str, int] = {}
    return torch.tensor([index.setdefault(k, len(index)) for k in keys], dtype=torch.long)


# The fixed cost of one more forward in a batch's length-bucketed chunks, in positions (`length_buckets`). On the
# CPU a forward costs its arithmetic, so padding is what to cut. On a GPU a forward of a small encoder costs its
# kernel launches: on an H200, MiniLM at 512 pairs x 64 tokens trained at 0.036 s a step padded to the longest
# text (one forward, 5.35 positions per real token) and at 0.054 s in two chunks (1.90 positions per real token)
# (benchmarks/results/gpu/h200-2026-11-28-contrastive/), so a second forward costs more than the ~43k positions
# it saves: 131,072 keeps such batches one forward, and still cuts batches of several hundred thousand positions.
# Either way the MoE layers route and compute the real tokens alone.
CHUNK_OVERHEAD = {"cpu": 128, "cuda": 131072}


def chunk_overhead(device: torch.device | str) -> int:
    return CHUNK_OVERHEAD.get(torch.device(device).type, CHUNK_OVERHEAD["cuda"])


def lay_out_pairs(batch: dict[str, torch.Tensor], overhead: float, pin: bool = False) -> dict:
    """A `PairBatches` (micro-)batch on the host as the step computes it: its 2B texts (queries, then documents)
    in length-bucketed chunks (`length_buckets.bucket_plan`), each padded only to its longest text, with the flat
    positions of its real tokens; `order` puts the chunks' embeddings back in text order. Every size is read
    here, on the host, so the step needs no read of the device. `pin`: page-locked tensors for an asynchronous
    copy to a GPU."""
    ids_B2L, mask_B2L = batch["input_ids"], batch["attention_mask"]
    b = ids_B2L.shape[0]
    ids_NL = ids_B2L.transpose(0, 1).reshape(2 * b, -1)
    lengths_N = mask_B2L.transpose(0, 1).reshape(2 * b, -1).sum(1)
    chunks, rows = [], []
    for picked in bucket_plan(lengths_N, overhead):
        width = max(1, int(lengths_N[picked].max()))
        mask = _mask(lengths_N[picked], width)
        chunks.append({"input_ids": ids_NL[picked, :width], "attention_mask": mask,
                       "positions": real_positions(mask)})
        rows.append(picked)
    order = torch.empty(2 * b, dtype=torch.long)
    order[torch.cat(rows)] = torch.arange(2 * b)
    out = {"chunks": chunks, "order": order, "doc_index": batch["doc_index"], "query_index": batch["query_index"],
           "real_tokens": int(lengths_N.sum()), "positions": sum(c["input_ids"].numel() for c in chunks)}
    return pin_tensors(out) if pin else out


def pair_loss(model: nn.Module, batch: dict, temperature: float | torch.Tensor) -> torch.Tensor:
    """InfoNCE of a `PairBatches` batch: queries and documents mean-pooled from length-bucketed chunks (a batch
    not laid out yet is laid out here, for its device), whose MoE layers run the real tokens alone and whose
    routing records join into one per layer, so the router losses read the whole batch as one forward."""
    if "chunks" not in batch:
        batch = lay_out_pairs({k: v.cpu() for k, v in batch.items()}, chunk_overhead(batch["input_ids"].device))
        batch = to_device(batch, next(model.parameters()).device)
    pooled = []
    with joined_records(model), attention_for_many_shapes(batch["order"].device):
        for chunk in batch["chunks"]:
            ids, mask = chunk["input_ids"], chunk["attention_mask"]
            with real_tokens(mask, chunk["positions"]):
                pooled.append(mean_pool(last_hidden(model, ids, mask).float(), mask))
    embedding = torch.cat(pooled).index_select(0, batch["order"])
    b = embedding.shape[0] // 2
    doc, query = batch["doc_index"], batch["query_index"]
    same_BB = (doc[:, None] == doc[None, :]) | (query[:, None] == query[None, :])
    return info_nce(embedding[:b], embedding[b:], temperature, same_BB)


class ContrastiveTask(Task):
    name = "contrastive"

    def __init__(self, cfg: TrainConfig, model: nn.Module, tokenizer) -> None:
        if tokenizer is None:
            raise UpcycleError("contrastive training needs the encoder's tokenizer (none found next to the model)")
        check_sequence_length(model, cfg.sequence_length)
        check_room_for_text(tokenizer, cfg.sequence_length)
        self.tokenizer, self.max_length, self.temperature = tokenizer, cfg.sequence_length, cfg.temperature
        self.steps = cfg.steps
        train, held = load_text_pairs(cfg.data, cfg.eval_data, max_chars=text_chars(cfg.sequence_length))
        self.train = PairBatches(tokenizer, train, cfg.batch_size, cfg.seed, cfg.sequence_length)
        check_token_ids(self.train.ids_N2L, embedding_rows(model.config),
                        f"text pairs {cfg.data or '(packaged)'} as tokenized")
        # the same held-out pairs whatever the run's seed, so that runs and seeds are scored on one set
        keep = sorted(random.Random(0).sample(range(len(held)), min(len(held), cfg.eval_pairs)))
        self.held = held.subset(keep)
        self.held_where = f"held-out text pairs {cfg.eval_data or cfg.data or '(packaged)'}"
        texts = [t for pair in zip(self.held.queries, self.held.documents, strict=True) for t in pair]
        enc = tokenize(tokenizer, texts[:DIAGNOSTIC_TEXTS], cfg.sequence_length)
        self.eval_rows = (enc["input_ids"], enc["attention_mask"])

    def check_forward(self, pairs: int) -> None:
        """Refuse a forward of fewer than two pairs (batch_size / (processes x grad_accum)): the other pairs of a
        forward are each pair's negatives, so one pair has none and trains nothing (loss 0, gradient 0)."""
        if pairs < 2:
            raise UpcycleError(f"contrastive training needs at least 2 pairs in each forward, since the other pairs "
                               f"of the batch are each pair's negatives; this run has {pairs} (batch_size / "
                               f"(processes x grad_accum)): raise batch_size")
        if int(self.train.doc_index.max()) < 1:
            raise UpcycleError("every training pair has the same document: InfoNCE has no negative to train "
                               "against; the pair file needs at least two distinct documents")
        step = self.train.first_without_negative(self.steps)
        if step is not None:
            raise UpcycleError(f"the training batch of step {step + 1} of {self.steps} has no negative pair: its "
                               f"{self.train.batch_size} pairs all share one document or one query, and InfoNCE "
                               f"would train nothing (the seeded order of every epoch is known now); the pair file "
                               f"needs more distinct documents, or another seed or batch_size")

    def loss(self, model: nn.Module, batch: dict) -> torch.Tensor:
        return pair_loss(model, batch, self.temperature)

    @staticmethod
    def layout(batch: dict, device: torch.device, processes: int = 1) -> dict:
        """A micro-batch laid out on the host for `device` (`lay_out_pairs`), pinned for a GPU. With several
        processes it stays one forward (DDP's reducer pairs one forward with each backward); its MoE layers
        still compute the real tokens alone."""
        overhead = chunk_overhead(device) if processes == 1 else math.inf
        return lay_out_pairs(batch, overhead, pin=device.type == "cuda")

    @staticmethod
    def tokens(batch: dict) -> int:
        return batch["real_tokens"] if "real_tokens" in batch else int(batch["attention_mask"].sum())

    def evaluate(self, model: nn.Module) -> dict | None:
        return pair_retrieval(model, self.tokenizer, self.held, max_length=self.max_length, where=self.held_where)


def evaluate_encoder(model: nn.Module, tokenizer, data: str | None, *, sequence_length: int,
                     pairs: int | None = None) -> dict:
    """`upcycle eval` of an encoder: retrieval on `data` (a pair file, evaluated whole) or on the held-out split
    of the packaged pairs; `pairs` caps the number (a fixed sample)."""
    if tokenizer is None:
        raise UpcycleError("evaluating an encoder needs its tokenizer (none found next to the model)")
    if pairs is not None and pairs < 1:
        raise UpcycleError(f"--pairs must be >= 1, got {pairs}")
    check_sequence_length(model, sequence_length)
    check_room_for_text(tokenizer, sequence_length)
    if data is None:
        held = load_text_pairs(None, max_chars=text_chars(sequence_length))[1]
    else:
        from ..data.text_pairs import read_text_pairs

        held = read_text_pairs(data, max_chars=text_chars(sequence_length))
    if pairs is not None and pairs < len(held):
        held = held.subset(sorted(random.Random(0).sample(range(len(held)), pairs)))
    return {"data": data or "held-out split of the packaged pairs", "sequence_length": sequence_length,
            **pair_retrieval(model, tokenizer, held, max_length=sequence_length,
                             where=f"held-out text pairs {data or '(packaged)'}")}


def check_room_for_text(tokenizer, sequence_length: int) -> None:
    """Refuse a sequence length that cannot hold the tokenizer's special tokens and one token of text: the
    tokenizer would then leave every text uncut (it cannot truncate below its special tokens), so the run would
    train on full-length texts while its config said otherwise."""
    special = tokenizer.num_special_tokens_to_add(pair=False) if hasattr(tokenizer, "num_special_tokens_to_add") \
        else 0
    if sequence_length < max(2, special + 1):
        raise UpcycleError(f"sequence_length {sequence_length} cannot hold a text: this tokenizer adds {special} "
                           f"special tokens to every text, so the least is {max(2, special + 1)}")
