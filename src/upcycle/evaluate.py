"""Evaluation (METHODS §6). Causal LMs: held-out perplexity = exp(mean next-token negative log-likelihood over
every real predicted token), summed over batches before dividing, so batch sizes and padding do not weight it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


@torch.no_grad()
def perplexity(model: nn.Module, input_ids_NS: torch.Tensor, attention_mask_NS: torch.Tensor, *,
               batch_size: int = 8) -> dict:
    """{"perplexity", "nll", "tokens"} of `model` on packed rows (token t predicts t+1 within a row; positions
    whose target is padding are excluded)."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    total, count = 0.0, 0
    try:
        for start in range(0, input_ids_NS.shape[0], batch_size):
            ids = input_ids_NS[start:start + batch_size].to(device)
            mask = attention_mask_NS[start:start + batch_size].to(device)
            logits = model(input_ids=ids, attention_mask=mask).logits.float()
            targets = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
            nll = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                  ignore_index=-100, reduction="sum")
            total += float(nll)
            count += int((targets != -100).sum())
    finally:
        model.train(was_training)
    mean = total / max(count, 1)
    return {"perplexity": math.exp(mean), "nll": mean, "tokens": count}
