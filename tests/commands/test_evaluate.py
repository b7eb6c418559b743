"""Held-out perplexity: token-weighted, padding excluded, independent of the batch size."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import make_tiny
from upcycle.tasks.evaluate import perplexity


def test_perplexity_is_exp_of_the_token_weighted_nll():
    model = make_tiny("llama")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 128, (5, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[4, 7:] = 0
    with torch.no_grad():
        logp = model(input_ids=ids, attention_mask=mask).logits.log_softmax(-1)
    nll, n = 0.0, 0
    for r in range(5):
        for t in range(11):
            if mask[r, t + 1]:
                nll -= float(logp[r, t, ids[r, t + 1]])
                n += 1
    one = perplexity(model, ids, mask, batch_size=5)
    two = perplexity(model, ids, mask, batch_size=2)
    assert one["tokens"] == two["tokens"] == n == 5 * 11 - 5
    assert one["nll"] == pytest.approx(nll / n, rel=1e-5) and two["nll"] == pytest.approx(nll / n, rel=1e-5)
    assert one["perplexity"] == pytest.approx(math.exp(nll / n), rel=1e-5)
    # a model that has never seen the data is near-uniform over the 128-token vocabulary
    assert 64 < one["perplexity"] < 256
