"""Token ids checked against the model's embedding rows before any forward sees them.

An id outside [0, rows) makes the embedding lookup fail: on the CPU an IndexError, on a GPU a device-side assert
that leaves the process's CUDA context unusable, so that every later piece of work in that process fails too.
Every path that feeds ids to a model (calibration files and texts, training and evaluation data, text pairs)
checks them first, on the host, and refuses with one line naming where they came from and the first bad id.
"""

from __future__ import annotations

import torch

from ..errors import UpcycleError

GPU_STATE_LOST = ("on a GPU such a failure also leaves this process's CUDA context unusable: any later work in it "
                  "fails too, so start a new process after fixing the input (CUDA_LAUNCH_BLOCKING=1 names the "
                  "failing operation)")


def embedding_rows(config) -> int | None:
    """How many token ids the model's text embedding takes (`vocab_size` of the config, or of its text tower's);
    None when the model takes no token ids."""
    for cfg in (config, getattr(config, "text_config", None)):
        rows = getattr(cfg, "vocab_size", None) if cfg is not None else None
        if isinstance(rows, int) and rows > 0:
            return rows
    return None


def check_token_ids(ids: torch.Tensor, rows: int | None, where: str) -> None:
    """Refuse `ids` holding an id outside [0, rows), naming `where`, the first bad id and its position."""
    if rows is None or ids.numel() == 0:
        return
    bad = (ids < 0) | (ids >= rows)
    if not bool(bad.any()):
        return
    flat = int(bad.reshape(-1).nonzero()[0, 0])
    position = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), ids.shape))
    raise UpcycleError(f"{where}: token id {int(ids.reshape(-1)[flat])} at position {list(position)} is outside "
                       f"the model's embedding of {rows:,} rows (ids 0 to {rows - 1:,}): the ids were made for "
                       f"another vocabulary (give the model's own tokenizer, or ids made with it)")


def is_cuda_failure(error: BaseException) -> bool:
    """Whether an exception from a forward is a CUDA error (a device-side assert among them)."""
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(error, accelerator_error):
        return True
    return "CUDA error" in str(error) or "device-side assert" in str(error)
