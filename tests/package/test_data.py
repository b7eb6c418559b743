"""Packed causal-LM data: packing, loss masking and a resumable order."""

from __future__ import annotations

import pytest
import torch

from upcycle.data.packing import PackedBatches, labels_for, pack_documents
from upcycle.errors import UpcycleError


class CharTokenizer:
    eos_token_id, pad_token_id = 2, 0

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [3 + (ord(c) % 100) for c in text]}


def test_packing_concatenates_documents_with_eos_and_masks_the_tail():
    ids, mask = pack_documents(CharTokenizer(), ["abc", "de"], sequence_length=4)
    stream = [3 + ord(c) % 100 for c in "abc"] + [2] + [3 + ord(c) % 100 for c in "de"] + [2]
    assert ids.shape == (2, 4) and ids.flatten()[:7].tolist() == stream   # the 7 tokens: abc<eos>de<eos>
    assert mask.flatten().tolist() == [1] * 7 + [0]
    labels = labels_for(ids, mask)
    assert labels.flatten()[7] == -100 and torch.equal(labels.flatten()[:7], ids.flatten()[:7])
    with pytest.raises(UpcycleError):
        pack_documents(CharTokenizer(), ["abc"], sequence_length=1)


def test_batches_resume_exactly_and_reshuffle_per_epoch():
    ids = torch.arange(40).view(10, 4)
    data = PackedBatches(ids, torch.ones_like(ids), batch_size=3, seed=7)
    straight = [b["input_ids"] for b, _ in zip(data.batches(), range(9), strict=False)]
    resumed = [b["input_ids"] for b, _ in zip(data.batches(start=4), range(5), strict=False)]
    assert all(torch.equal(a, b) for a, b in zip(straight[4:], resumed, strict=True))
    epoch0 = torch.cat(straight[:3])[:, 0].tolist()
    assert len(set(epoch0)) == 9                          # no row twice within an epoch
    assert epoch0 != torch.cat(straight[3:6])[:, 0].tolist()
    other_seed = PackedBatches(ids, torch.ones_like(ids), batch_size=3, seed=8)
    assert not torch.equal(other_seed.batch(0)["input_ids"], straight[0])
    with pytest.raises(UpcycleError, match="cannot fill"):
        PackedBatches(ids[:2], torch.ones_like(ids[:2]), batch_size=3, seed=0)


def test_documents_longer_than_the_model_are_cut_into_rows_without_the_tokenizers_length_warning(monkeypatch):
    """Packing and calibration tokenize a whole document and then cut it into rows, so a document longer than
    the tokenizer's model_max_length is expected: transformers' "Token indices sequence length is longer than
    the specified maximum" warning would be false, and is not logged."""
    from transformers.tokenization_utils_base import logger

    from upcycle.config import CalibrationConfig
    from upcycle.data.clip_pairs import caption_tokenizer
    from upcycle.data.model_inputs import text_batches

    document = " ".join(["the cat sat on the mat"] * 20)           # 120 words, model_max_length 16
    tokenizer = caption_tokenizer([document], max_length=16)
    warned = []
    monkeypatch.setattr(logger, "warning", lambda *a, **k: warned.append(a))
    tokenizer.deprecation_warnings.clear()                         # the warning is logged once per tokenizer
    ids, mask = pack_documents(tokenizer, [document], sequence_length=32)
    assert int(mask.sum()) == 121 and ids.shape == (4, 32)
    batches = text_batches(tokenizer, [document], CalibrationConfig(tokens=120, sequence_length=32, batch_size=2))
    assert sum(int(b["attention_mask"].sum()) for b in batches) == 120
    assert warned == []
    tokenizer(document)                                            # the check can see the warning it guards
    assert len(warned) == 1 and "longer than the specified maximum" in warned[0][0]


def test_a_document_past_the_piece_size_is_tokenized_in_bounded_pieces_with_the_same_ids(monkeypatch):
    """A document longer than MAX_PIECE_CHARS (a file with no blank line is one document) reaches the tokenizer
    in pieces no longer than that, cut before a whitespace, and gives the ids of the whole document."""
    from upcycle.data import packing
    from upcycle.data.clip_pairs import caption_tokenizer

    words = [f"w{i}" for i in range(50)]
    tokenizer = caption_tokenizer([" ".join(words)], max_length=64)
    text = "\n".join(" ".join(words[(i * 7 + j) % 50] for j in range(13)) for i in range(400))
    whole = tokenizer(text, add_special_tokens=False)["input_ids"]
    monkeypatch.setattr(packing, "MAX_PIECE_CHARS", 500)
    seen = []
    original = type(tokenizer).__call__

    def spy(self, piece, **kwargs):
        seen.append(len(piece))
        return original(self, piece, **kwargs)

    monkeypatch.setattr(type(tokenizer), "__call__", spy)
    assert packing.document_ids(tokenizer, text) == whole
    assert len(seen) > 10 and max(seen) <= 500
    assert "".join(packing.text_pieces(text, 500)) == text
    assert list(packing.text_pieces("x" * 1200, 500)) == ["x" * 500, "x" * 500, "x" * 200]     # no whitespace
