"""Training data for causal LMs: documents packed into fixed-length rows, a resumable seeded order.

Packing (as in GPT-style pre-training): every document is tokenized and followed by the EOS token, the
streams are concatenated, and the result is cut into rows of `sequence_length` tokens, so no compute is spent
on padding. The final partial row is padded and its padding carries label -100 (ignored by the loss), as do
the positions masked by `attention_mask`; a row may span a document boundary (the EOS marks it), as in the
usual packed setup.

The order is a seeded permutation per epoch, so `(seed, step)` alone fixes which rows a step sees: resuming
at step s yields exactly the batches an uninterrupted run would have seen from step s on.
Shape suffixes: N rows, S sequence length, B batch rows.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ..errors import UpcycleError

# The most characters the tokenizer is given at once. A document is tokenized whole up to this size; a longer one
# (a 200 MB file with no blank line is one document) in pieces cut just before a whitespace, so that the
# tokenizer's working memory stays bounded: tokenized whole, such a document took over 11 GB. A piece starts at
# the whitespace a whole-document tokenizer would also see before its word.
MAX_PIECE_CHARS = 1_000_000


def document_ids(tokenizer, text: str, max_tokens: int | None = None) -> list[int]:
    """The token ids of a document, without special tokens, to be cut into rows by the caller (in pieces of at
    most MAX_PIECE_CHARS characters); with `max_tokens`, the pieces stop once that many are made (a 200 MB line
    read for 64 tokens is one piece's work). A transformers tokenizer is asked not to warn that the text is longer
    than its model_max_length: that warning would be false here (the rows are cut to the sequence length). Other
    tokenizers are called plainly."""
    ids: list[int] = []
    for piece in text_pieces(text, MAX_PIECE_CHARS):
        if max_tokens is not None and len(ids) >= max_tokens:
            break
        if hasattr(tokenizer, "deprecation_warnings"):      # transformers' PreTrainedTokenizerBase
            ids += tokenizer(piece, add_special_tokens=False, verbose=False)["input_ids"]
        else:
            ids += tokenizer(piece, add_special_tokens=False)["input_ids"]
    return ids


def text_pieces(text: str, limit: int) -> Iterator[str]:
    """`text` in consecutive pieces of at most `limit` characters, each cut just before a whitespace character
    where the piece has one (else at the limit)."""
    start = 0
    while len(text) - start > limit:
        cut = max(text.rfind(" ", start + 1, start + limit), text.rfind("\n", start + 1, start + limit))
        cut = cut if cut > start else start + limit
        yield text[start:cut]
        start = cut
    yield text[start:]


def pack_documents(tokenizer, texts: list[str], sequence_length: int, max_tokens: int | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids_NS, attention_mask_NS): the documents, each ended by EOS, concatenated and cut into rows; with
    `max_tokens`, the rows that hold the first that many tokens (only as much text is tokenized)."""
    if sequence_length < 2:
        raise UpcycleError(f"sequence_length must be >= 2, got {sequence_length}")
    eos = tokenizer.eos_token_id
    if eos is None:
        raise UpcycleError("the tokenizer has no EOS token to separate packed documents")
    stream: list[int] = []
    for text in texts:
        if max_tokens is not None and len(stream) >= max_tokens:
            break
        stream += document_ids(tokenizer, text, None if max_tokens is None else max_tokens - len(stream)) + [eos]
    if max_tokens is not None:
        stream = stream[:max(max_tokens, 2)]
    if len(stream) < 2:
        raise UpcycleError("the training text produced fewer than 2 tokens")
    rows = -(-len(stream) // sequence_length)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    ids_NS = torch.full((rows * sequence_length,), pad, dtype=torch.long)
    ids_NS[: len(stream)] = torch.tensor(stream, dtype=torch.long)
    mask_NS = torch.zeros(rows * sequence_length, dtype=torch.long)
    mask_NS[: len(stream)] = 1
    return ids_NS.view(rows, sequence_length), mask_NS.view(rows, sequence_length)


def labels_for(input_ids_BS: torch.Tensor, attention_mask_BS: torch.Tensor) -> torch.Tensor:
    """Labels for next-token prediction (the model shifts them): the ids, with -100 where the mask is 0."""
    return input_ids_BS.masked_fill(attention_mask_BS == 0, -100)


class SeededBatches:
    """Batches of `batch_size` rows of aligned tensors in a seeded order that reshuffles every epoch;
    `batch(step)` depends on (seed, step) alone and `batches(start)` is the stream from step `start` on, which is
    what resuming needs."""

    def __init__(self, rows: dict[str, torch.Tensor], batch_size: int, seed: int):
        if batch_size < 1:
            raise UpcycleError(f"batch_size must be >= 1, got {batch_size}")
        n = next(iter(rows.values())).shape[0]
        if any(t.shape[0] != n for t in rows.values()):
            raise UpcycleError("all row tensors must have the same number of rows")
        if n < batch_size:
            raise UpcycleError(f"{n} training rows cannot fill a batch of {batch_size}; give more data or a smaller "
                               f"batch")
        self.rows, self.num_rows, self.batch_size, self.seed = rows, n, batch_size, seed
        self.per_epoch = n // batch_size   # the incomplete last batch of an epoch is dropped

    def _order(self, epoch: int) -> torch.Tensor:
        return torch.randperm(self.num_rows, generator=torch.Generator().manual_seed(self.seed * 100_003 + epoch))

    def batch(self, step: int) -> dict[str, torch.Tensor]:
        epoch, index = divmod(step, self.per_epoch)
        picked = self._order(epoch)[index * self.batch_size:(index + 1) * self.batch_size]
        return {name: t[picked] for name, t in self.rows.items()}

    def batches(self, start: int = 0) -> Iterator[dict[str, torch.Tensor]]:
        step = start
        while True:
            yield self.batch(step)
            step += 1


class PackedBatches(SeededBatches):
    """Packed causal-LM rows with their labels."""

    def __init__(self, input_ids_NS: torch.Tensor, attention_mask_NS: torch.Tensor, batch_size: int, seed: int):
        super().__init__({"input_ids": input_ids_NS, "attention_mask": attention_mask_NS}, batch_size, seed)

    def batch(self, step: int) -> dict[str, torch.Tensor]:
        out = super().batch(step)
        out["labels"] = labels_for(out["input_ids"], out["attention_mask"])
        return out
