"""Sentence embeddings of an encoder: mean pooling of the last hidden states over the attention mask.

This is what sentence-transformers does for all-MiniLM-L6-v2 (its `1_Pooling/config.json`: pooling_mode_mean_tokens,
then `2_Normalize`): e = sum_t m_t h_t / sum_t m_t, then e / ||e||. [CLS] and [SEP] count as tokens, as there.
Shape suffixes: B rows, L tokens, D hidden size, N texts.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from ..core.modes import eval_mode
from ..core.routing_context import real_positions, real_tokens
from ..data.token_ids import check_token_ids, embedding_rows
from ..errors import UpcycleError


def mean_pool(hidden_BLD: torch.Tensor, mask_BL: torch.Tensor) -> torch.Tensor:
    """[B, D] mean of the hidden states at the real tokens (a row with none is refused by the caller's data)."""
    mask = mask_BL.to(hidden_BLD.dtype).unsqueeze(-1)
    return (hidden_BLD * mask).sum(1) / mask.sum(1).clamp_min(1.0)


def last_hidden(model: nn.Module, input_ids_BL: torch.Tensor, attention_mask_BL: torch.Tensor) -> torch.Tensor:
    """The encoder's last hidden states [B, L, D]. The model is called as it is (a DDP or FSDP wrapper keeps its
    gradient hooks); a bare encoder returns `last_hidden_state`, a model with a head its `hidden_states`."""
    # use_cache=False: an encoder caches nothing, and a BERT config's use_cache would make transformers warn under
    # activation checkpointing
    out = model(input_ids=input_ids_BL, attention_mask=attention_mask_BL, output_hidden_states=True, use_cache=False)
    hidden = getattr(out, "last_hidden_state", None)
    if hidden is None:
        states = getattr(out, "hidden_states", None)
        if not states:
            raise UpcycleError(f"{type(model).__name__} returns no hidden states to pool into sentence embeddings")
        hidden = states[-1]
    return hidden


def attention_for_many_shapes(device: torch.device):
    """Scaled-dot-product attention without its cuDNN backend, for forwards whose batch shapes change from call to
    call (length-bucketed chunks, evaluation batches sorted by length). cuDNN builds an execution plan for every
    new shape, and on an H200 that made most steps of a bucketed MiniLM batch take 0.25-0.35 s instead of 0.05 s
    until the plans of every shape had been built (benchmarks/results/gpu/h200-2026-11-28-contrastive/); the
    memory-efficient and flash kernels need no plan. Elsewhere (CPU, fixed shapes) nothing changes."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def trim(input_ids_BL: torch.Tensor, attention_mask_BL: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows cut to the longest real row (right padding), so a batch of short texts does not run padding."""
    length = max(1, int(attention_mask_BL.sum(1).max()))
    return input_ids_BL[:, :length], attention_mask_BL[:, :length]


def tokenize(tokenizer, texts: list[str], max_length: int) -> dict[str, torch.Tensor]:
    """Texts as padded rows of at most `max_length` tokens (the tokenizer's special tokens included)."""
    enc = tokenizer(texts, padding=True, truncation=True, max_length=max_length, return_tensors="pt")
    return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}


@torch.no_grad()
def embed_texts(model: nn.Module, tokenizer, texts: list[str], *, max_length: int, batch_size: int = 64,
                where: str = "texts to embed") -> torch.Tensor:
    """Unit-norm sentence embeddings [N, D] (float32, on the CPU), in eval mode. Texts are sorted by length
    before batching (less padding); the result is in the order given. `where`: what the texts are (their file),
    for the message refusing an id past the embedding."""
    device = next(model.parameters()).device
    rows = embedding_rows(getattr(model, "config", None))
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
    out = torch.empty(len(texts), 0)
    with eval_mode(model):
        for start in range(0, len(texts), batch_size):
            picked = order[start:start + batch_size]
            enc = tokenize(tokenizer, [texts[i] for i in picked], max_length)
            check_token_ids(enc["input_ids"], rows, f"{where} as tokenized")
            # the real tokens' positions read on the host: MoE layers route and compute those alone
            positions = real_positions(enc["attention_mask"]).to(device)
            ids, mask = enc["input_ids"].to(device), enc["attention_mask"].to(device)
            with real_tokens(mask, positions), attention_for_many_shapes(ids.device):
                pooled = F.normalize(mean_pool(last_hidden(model, ids, mask).float(), mask), dim=-1).cpu()
            if out.shape[1] == 0:
                out = torch.empty(len(texts), pooled.shape[1])
            out[picked] = pooled
    return out
