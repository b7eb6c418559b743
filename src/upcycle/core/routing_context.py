"""What an MoE layer reads besides its input `x`, in one object: `ROUTING`.

A layer is called by a model's own forward, which upcycle never rewrites (docs/design.md principle 3), so what the
layer needs to know about the batch reaches it here, set around the forward by whoever knows it:

  mask              the batch's [B, S] padding mask (1 = real token); set by the model-root hooks of
                    `surgery.track_padding_masks` (or `padding_mask` below), recorded by the layer and left out
                    of capacity and the router losses
  known_mask        a padding mask whose real tokens' flat positions were computed on the host (`real_tokens`):
  known_positions   a layer seeing that very mask routes and runs those positions alone
  joined            collects the routing records of several forwards (`moe.joined_records`)
  recomputing       True while activation checkpointing recomputes a forward in the backward pass: the routing is
                    the same, but nothing that counts a forward (routing records, router-loss inputs, the aux-free
                    balancer's loads, the EMA teacher's pass) may count it again
  kernel_path       "grouped_mm" or "loop" forces the experts' kernel path (`grouped_ffn.forced_kernel_path`:
                    benchmarks and tests compare the two); None takes the rule

This is the one module-level mutable object of `upcycle.core` (a test counts them).

Plain attributes of a plain object, not ContextVars: torch.compile traces an attribute read and breaks the graph
at ContextVar.get. `set` is the one way to change them; it returns what it replaced, so nested forwards (a
teacher's inside a student's) restore what was there.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

FIELDS = ("mask", "known_mask", "known_positions", "joined", "recomputing", "kernel_path")


class RoutingContext:
    mask: torch.Tensor | None = None
    known_mask: torch.Tensor | None = None
    known_positions: torch.Tensor | None = None
    joined: dict | None = None
    recomputing: bool = False
    kernel_path: str | None = None

    def set(self, **fields) -> dict:
        """Set the given fields; returns their previous values (pass them to `set` again to restore)."""
        unknown = set(fields) - set(FIELDS)
        if unknown:
            raise TypeError(f"RoutingContext has no field {sorted(unknown)}")
        before = {name: getattr(self, name) for name in fields}
        for name, value in fields.items():
            setattr(self, name, value)
        return before

    @contextlib.contextmanager
    def using(self, **fields) -> Iterator[None]:
        """The given fields inside the block, what was there before after it."""
        before = self.set(**fields)
        try:
            yield
        finally:
            self.set(**before)


ROUTING = RoutingContext()


@contextlib.contextmanager
def padding_mask(mask_BS: torch.Tensor | None) -> Iterator[None]:
    """Make `mask_BS` the padding mask MoE layers record (and exclude from capacity) inside this block."""
    with ROUTING.using(mask=mask_BS):
        yield


@contextlib.contextmanager
def real_tokens(mask_BS: torch.Tensor, positions_R: torch.Tensor) -> Iterator[None]:
    """Inside this block, an MoE layer whose padding mask is `mask_BS` (the same tensor object: the attention
    mask the model is called with) routes and runs only the tokens at `positions_R` (flat indices into the
    [B*S] tokens, on the mask's device) and gives padding positions a zero output. Padding never reaches a real
    token of an encoder (its attention masks padding keys), so the real tokens' outputs are those of the padded
    computation; the routing record then holds the real tokens alone (`RoutingRecord.positions_T`)."""
    with ROUTING.using(known_mask=mask_BS, known_positions=positions_R):
        yield


def real_positions(mask_BS: torch.Tensor) -> torch.Tensor:
    """The flat positions of a [B, S] mask's ones, on the host (the index `real_tokens` takes)."""
    return mask_BS.reshape(-1).nonzero().squeeze(1)


def recompute_contexts() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """The `context_fn` of `torch.utils.checkpoint.checkpoint` (non-reentrant) for a region holding MoE layers:
    the forward runs as it is; the recomputation in the backward pass sees the padding mask and real-token
    positions the forward saw (the model-root hooks that set them have long returned by then), and `recomputing`,
    so that no record, loss input, load count or teacher pass is taken twice."""
    seen = {"mask": ROUTING.mask, "known_mask": ROUTING.known_mask, "known_positions": ROUTING.known_positions}
    return contextlib.nullcontext(), ROUTING.using(**seen, joined=None, recomputing=True)
