"""`eval_mode(model)`: run a block with the model in eval mode and give it back in the mode it was in, even when
the block raises (the probe, the calibration replay, the export check and the evaluations all need this)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[nn.Module]:
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)
