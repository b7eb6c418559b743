"""Activation checkpointing (`activation_checkpointing` in the run config): keep fewer activations through the
forward pass and recompute them in the backward pass (Chen et al. 2016, arXiv:1604.06174), trading about one
more forward of the recomputed part for memory.

  none   every activation is kept (the fastest step)
  full   each transformer block keeps only its input; the block runs again in the backward pass (transformers'
         own gradient checkpointing of its blocks, non-reentrant, the mode torchtitan and Megatron call "full")
  moe    only upcycle's MoE layers are recomputed: their inputs are kept, and the routed experts' projections,
         hidden states and dispatch, the largest activations of an upcycled block, are made again in the
         backward pass (attention and the dense blocks keep theirs)

Both modes run `torch.utils.checkpoint` with `core.routing_context.recompute_contexts`, so a recomputed forward is
counted once: the MoE layers keep the routing record of the real forward (the router losses and the run's routing
statistics read it), the aux-free balancer counts its loads once, the EMA teacher runs once (`teacher.py`), and
the recomputation sees the padding mask the real forward saw. The same code runs under DDP and FSDP2: transformers
checkpoints a block's `forward`, inside FSDP2's hooks on the block, so a recomputation gathers no weight twice.
"""

from __future__ import annotations

from torch import nn

from ...config import CHECKPOINTING
from ...core.moe import moe_layers
from ...core.routing_context import recompute_contexts
from ...errors import UpcycleError


def apply_activation_checkpointing(model: nn.Module, mode: str) -> None:
    """Switch `model` to `mode` (module docstring); refused where the model cannot do it."""
    if mode not in CHECKPOINTING:
        raise UpcycleError(f"activation_checkpointing must be one of {', '.join(CHECKPOINTING)}, got {mode!r}")
    layers = moe_layers(model)
    if mode == "moe" and not layers:
        from ...core.stock_moe import stock_moe_blocks

        what = (f"its sparse blocks are {type(model).__name__}'s own, which upcycle does not recompute"
                if stock_moe_blocks(model) else "it has no MoE layer")
        raise UpcycleError(f"activation_checkpointing: moe recomputes upcycle's MoE layers, and this "
                           f"{type(model).__name__} holds none ({what}); use full")
    for layer in layers.values():
        layer.recompute = mode == "moe"
    if mode == "full":
        if not getattr(model, "supports_gradient_checkpointing", False):
            raise UpcycleError(f"activation_checkpointing: full needs transformers' gradient checkpointing, which "
                               f"{type(model).__name__} does not support" +
                               ("; moe recomputes the MoE layers alone" if layers else ""))
        kwargs = {"use_reentrant": False, "context_fn": recompute_contexts}
        if hasattr(model, "activation_checkpointing_enable"):       # transformers >= 5.2x; the old name warns
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    elif _checkpointing(model):
        disable = getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable
        disable()


def _checkpointing(model: nn.Module) -> bool:
    """Whether transformers' checkpointing is on (its newer name first: the old one warns)."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(model), name):
            return bool(getattr(model, name))
    return False
