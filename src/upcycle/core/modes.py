"""Modules in another state for a while, given back as they were even when the block raises.

  - `eval_mode(model)`: the model in eval mode (the probe, the calibration replay, the export check and the
    evaluations all need this);
  - `forward_replaced(modules, replace)`: each module computing something else (the replay's FFN on real tokens
    only, a merge's blocks handing back states already computed)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from torch import nn


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[nn.Module]:
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)


@contextlib.contextmanager
def forward_replaced(modules: list[nn.Module], replace: Callable[[nn.Module, Callable], Callable]) -> Iterator[None]:
    """While active, each module's `forward` is `replace(module, its forward)`; after, the forward it had comes
    back: the class's, or an instance's own (accelerate's hooks set one)."""
    own = [vars(m).get("forward") for m in modules]
    try:
        for module in modules:
            module.forward = replace(module, module.forward)
        yield
    finally:
        for module, forward in zip(modules, own, strict=True):
            if forward is None:
                vars(module).pop("forward", None)       # the class's forward again
            else:
                module.forward = forward
