"""Calibration data as model inputs: text cut into a token budget of padded batches (`text_batches`), or the
batches a user prepared as a .safetensors file of model inputs (`tensor_batches`). What a conversion, a merge's
sources and prune/grow's probe read their calibration text with.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..config import CalibrationConfig
from ..errors import UpcycleError
from .packing import document_ids
from .token_ids import check_token_ids


def text_batches(tokenizer, texts: list[str], budget: CalibrationConfig, *, seed: int = 0,
                 embedding_rows: int | None = None, where: str = "calibration text") -> list[dict[str, torch.Tensor]]:
    """Model inputs holding at least `budget.tokens` real tokens: documents in a seeded random order, each cut
    into rows of at most `budget.sequence_length` tokens (a row never spans two documents), right-padded per
    batch of `budget.batch_size` rows. With `embedding_rows` (the model's), an id the tokenizer makes outside
    them is refused, naming `where`."""
    tokens, sequence_length, batch_size = budget.tokens, budget.sequence_length, budget.batch_size
    if tokens < 1 or sequence_length < 1 or batch_size < 1:
        raise UpcycleError(f"calibration tokens, sequence_length and batch_size must be >= 1, got {tokens}, "
                           f"{sequence_length}, {batch_size}")
    order = torch.randperm(len(texts), generator=torch.Generator().manual_seed(seed)).tolist()
    rows, total = [], 0
    for i in order:
        ids = document_ids(tokenizer, texts[i], tokens - total)     # no more text tokenized than the budget takes
        for start in range(0, len(ids), sequence_length):
            rows.append(ids[start:start + sequence_length])
            total += len(rows[-1])
            if total >= tokens:
                break
        if total >= tokens:
            break
    pad = next((t for t in (tokenizer.pad_token_id, tokenizer.eos_token_id) if t is not None), 0)
    batches = []
    for b in range(0, len(rows), batch_size):
        chunk = rows[b:b + batch_size]
        width = max(len(r) for r in chunk)
        ids = torch.full((len(chunk), width), pad, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for j, r in enumerate(chunk):
            ids[j, :len(r)] = torch.tensor(r, dtype=torch.long)
            mask[j, :len(r)] = 1
        check_token_ids(ids, embedding_rows, f"{where} as tokenized")
        batches.append({"input_ids": ids, "attention_mask": mask})
    return batches


INPUT_KEYS = ("input_ids", "attention_mask", "pixel_values", "token_type_ids")


def tensor_batches(path: str | Path, *, batch_size: int = 8) -> list[dict[str, torch.Tensor]]:
    """Model inputs prepared by the user, as a .safetensors file of equally long tensors named like the model's
    arguments (`input_ids`, `attention_mask`, `pixel_values`, `token_type_ids`): image-caption pairs for CLIP,
    or pre-tokenized text for a model without a tokenizer. Split into batches of `batch_size` rows."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(path))
    except (OSError, SafetensorError) as e:
        raise UpcycleError(f"calibration data {path}: not a readable .safetensors file ({e})") from None
    unknown = sorted(set(tensors) - set(INPUT_KEYS))
    if unknown or not tensors:
        raise UpcycleError(f"calibration data {path}: tensors must be named from {list(INPUT_KEYS)}, got "
                           f"{sorted(tensors)}")
    dims = {"input_ids": 2, "attention_mask": 2, "token_type_ids": 2, "pixel_values": 4}
    for key, tensor in tensors.items():
        if tensor.dim() != dims[key] or tensor.numel() == 0:
            raise UpcycleError(f"calibration data {path}: {key} must be a non-empty {dims[key]}-D tensor "
                               f"({'[rows, tokens]' if dims[key] == 2 else '[images, channels, height, width]'}), "
                               f"got shape {list(tensor.shape)}")
        if key == "pixel_values" and not tensor.is_floating_point():
            raise UpcycleError(f"calibration data {path}: pixel_values must be floating-point, got {tensor.dtype}")
        if key != "pixel_values" and (tensor.is_floating_point() or tensor.dtype == torch.bool):
            raise UpcycleError(f"calibration data {path}: {key} must be integer ids, got {tensor.dtype}")
    rows = {t.shape[0] for t in tensors.values()}
    if len(rows) != 1:
        raise UpcycleError(f"calibration data {path}: tensors have different first dimensions "
                           f"{ {k: v.shape[0] for k, v in tensors.items()} }")
    texts = [tensors[k].shape for k in ("input_ids", "attention_mask", "token_type_ids") if k in tensors]
    if len(set(texts)) > 1:
        raise UpcycleError(f"calibration data {path}: input_ids, attention_mask and token_type_ids must have one "
                           f"shape, got {[list(t) for t in texts]}")
    if "pixel_values" in tensors and not bool(torch.isfinite(tensors["pixel_values"]).all()):
        raise UpcycleError(f"calibration data {path}: pixel_values hold NaN or infinite values")
    n = rows.pop()
    return [{k: v[i:i + batch_size] for k, v in tensors.items()} for i in range(0, n, batch_size)]
