"""The upcycled model before any weight exists: built on the meta device, for plans and streaming (issue 13).

A model's parameters are created on the meta device (shapes and dtypes, no memory); its buffers are real, since
some are computed at construction and never stored in checkpoints (rotary frequencies). The MoE layers are
built on the meta device too, shaped as the method declares (`methods.LayerLayout`: each routed expert's width, a shared
expert, a router bias), so that, before a weight is read:
  - `upcycle convert --dry-run` counts the parameters and the bytes the conversion would write;
  - the streaming converter knows every output tensor's name, shape and dtype, and so can lay out every shard
    of the output before the first tensor is computed (`shards.ShardedWriter`).
A test converts real tiny models with every method and compares their tensors with this plan.
"""

from __future__ import annotations

import torch
import transformers
from torch import nn

from ..config import MoEConfig
from ..core.architectures import family_of
from ..core.ffn import FFNWeights
from ..core.moe import MoELayer
from ..core.surgery import Target, install, plan_targets, tower_cfg
from ..methods import LayerLayout


def architecture_class(config) -> type[nn.Module]:
    """The transformers class a dense checkpoint's config names (its `architectures`), else the family's Auto
    class's mapping for the config."""
    arch = (getattr(config, "architectures", None) or [None])[0]
    cls = getattr(transformers, arch, None) if arch else None
    if cls is None:
        auto = getattr(transformers, family_of(config).auto_class)
        cls = auto._model_mapping[type(config)]
    return cls


def _no_init():
    """transformers' switch that skips weight initialisation: drawing random values into meta tensors goes
    through torch's reference implementations and took 10 ms a block (a 1,000-block plan: 50 s)."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:             # a transformers without it: initialisation runs, only slower
        import contextlib

        return contextlib.nullcontext()
    return no_init_weights()


def empty_model(config, dtype: torch.dtype) -> nn.Module:
    """The dense model with parameters on the meta device and real buffers, in eval mode."""
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False), _no_init():
        model = architecture_class(config)._from_config(config, dtype=dtype)
    model.tie_weights()          # tied tensors become one object, so they are read and written once
    return model.eval()


def empty_moe_layer(dense: FFNWeights, layout: LayerLayout, moe: MoEConfig, *, dtype: torch.dtype,
                    output_dropout: float = 0.0) -> MoELayer:
    """An MoE layer of the layout's shapes on the meta device (the router float32, as MoELayer makes it)."""
    with torch.device("meta"):
        return MoELayer(hidden_size=dense.hidden_size, intermediate_size=layout.routed_width,
                        activation=dense.activation, gated=dense.gated,
                        bias_in=dense.b_up is not None or dense.b_gate is not None,
                        bias_down=dense.b_down is not None,
                        num_shared_experts=1 if layout.shared_width is not None else 0,
                        shared_intermediate_size=layout.shared_width, router_bias=layout.router_bias,
                        output_dropout=output_dropout, config=moe, dtype=dtype)


def planned_model(config, moe: MoEConfig, placement, layout_of, *, dtype: torch.dtype,
                  model: nn.Module | None = None) -> tuple[nn.Module, list[Target]]:
    """The upcycled model on the meta device and its MoE targets; `layout_of(dense FFN) -> LayerLayout`.
    `model`: the weightless dense model to install the layers into (default: a new one)."""
    model = model if model is not None else empty_model(config, dtype)
    family = family_of(model.config)
    targets = plan_targets(model, placement)
    for target in targets:
        block = model.get_submodule(target.path)
        tcfg = tower_cfg(model, family, target)
        dense = family.extract(block, tcfg)
        install(model, target.path, empty_moe_layer(dense, layout_of(dense), moe, dtype=dtype,
                                                    output_dropout=family.output_dropout(tcfg)))
    return model, targets


def tensor_specs(model: nn.Module) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """(name, shape, dtype) of every tensor the model's checkpoint stores, in state-dict order, a tensor tied to
    an earlier one stored once under the earlier name (as transformers' save_pretrained stores a tied head)."""
    seen, specs = set(), []
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        specs.append((name, tuple(tensor.shape), tensor.dtype))
    return specs


def output_bytes(specs: list[tuple[str, tuple[int, ...], torch.dtype]]) -> int:
    return sum(torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size() for _, shape, dtype in specs)


def bytes_by_block(specs: list[tuple[str, tuple[int, ...], torch.dtype]], blocks: list[str]) -> dict[str, int]:
    """Bytes of the tensors under each block path (one pass over the tensors)."""
    sizes = dict.fromkeys(blocks, 0)
    for name, shape, dtype in specs:
        parts = name.split(".")
        for cut in range(len(parts) - 1, 0, -1):
            key = ".".join(parts[:cut])
            if key in sizes:
                sizes[key] += torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
                break
    return sizes


def layout_function(method, args: dict):
    """dense FFN -> the LayerLayout `method` declares for it with resolved `args`."""
    def layout_of(dense: FFNWeights) -> LayerLayout:
        return method.layout(dense.intermediate_size, args)
    return layout_of
