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
