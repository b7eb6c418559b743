"""The expert count of an upcycled model changed after conversion: `prune_model` keeps the N most salient experts
of every MoE layer (REAP, frequency or random; `metrics.saliency`), `grow_model` adds copies of the experts chosen
by utility, or of every expert in turn (`core.resize`), each copy's router row its source's plus the offset that
shares the source's calibration tokens out between them (`core.router_split`).

Both work on a model in memory, layer by layer: the layer's inputs on the calibration tokens are taken from one
forward of the original model, each layer is rebuilt and installed, and the report says, per layer, what was
removed or copied with the scores it was chosen by. The caller measures the KL of the new model to the old one
and each expert's load: pruning keeps only part of the function, and growth under a fixed top-k is not
function-preserving either (a token may take two copies of one expert among its k, or a copy's logit in its
source's place).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import torch
from torch import nn

from ..config import MAX_EXPERTS
from ..core.layer_inputs import layer_inputs
from ..core.moe import MoELayer, moe_layers
from ..core.resize import copy_groups, duplicate_experts, select_experts
from ..core.router_split import copy_row_offsets
from ..core.stock_moe import as_moe_layer, stock_moe_blocks
from ..errors import UpcycleError
from ..metrics.saliency import expert_saliency
from .perturb import PERTURB, perturb_copies

PRUNE_BY = ("reap", "frequency", "random")
GROW_STOCK = ("grow takes an upcycle folder (a stock MoE class's router has no selection bias to keep for the "
              "copies): grow the upcycle folder the stock one was exported from, then export the grown folder")
GROW_BY = ("utility", "uniform")


@dataclass(frozen=True)
class ExpertCount:
    """What a prune or a grow does: the experts every MoE layer ends with, and how they are chosen."""

    num_experts: int
    by: str
    seed: int = 0
    add: str | None = None          # grow by one expert from this fine-tune instead (`add_expert.py`)
    perturb: str = "none"           # grow: the copies perturbed as `noise` or `drop` initializes (`perturb.py`)


def check_request(model: nn.Module, request: ExpertCount, *, grow: bool) -> dict[str, nn.Module]:
    """The model's MoE layers (upcycle's, or a stock class's sparse blocks), once the request is possible for
    every one of them (refused before any change)."""
    layers = moe_layers(model) or stock_moe_blocks(model)
    if not layers:
        raise UpcycleError(f"the model has no MoE layer (a dense model): {'grow' if grow else 'prune'} takes an "
                           f"upcycle folder, a training run's model or a stock MoE folder")
    check_counts({name: (layer.num_experts, layer.top_k) if isinstance(layer, MoELayer) else
                  (layer.gate.num_experts, layer.gate.top_k) for name, layer in layers.items()}, request, grow=grow)
    return layers


def check_counts(layers: dict[str, tuple[int | None, int | None]], request: ExpertCount, *, grow: bool) -> None:
    """The request refused unless its rule is one of the command's and its count is possible for every layer,
    given as name -> (experts, top-k) (None where a folder's files do not say: the loaded model's check does)."""
    choices = GROW_BY if grow else PRUNE_BY
    if request.by not in choices:
        raise UpcycleError(f"--by must be one of {', '.join(choices)}, got {request.by!r}")
    if request.perturb not in (PERTURB if grow else ("none",)):
        raise UpcycleError(f"--perturb is growth's ({', '.join(PERTURB)}), got {request.perturb!r}")
    if not 1 <= request.num_experts <= MAX_EXPERTS:
        raise UpcycleError(f"--num-experts must be between 1 and {MAX_EXPERTS:,}, got {request.num_experts}")
    N = request.num_experts
    for name, (E, k) in layers.items():
        if not isinstance(E, int) or not isinstance(k, int):
            continue
        if grow and N < E:
            raise UpcycleError(f"{name} has {E} experts: growing to {N} would remove some (use prune)")
        if not grow and N > E:
            raise UpcycleError(f"{name} has {E} experts: pruning to {N} would add some (use grow)")
        if not grow and N < k:
            raise UpcycleError(f"{name} routes each token to top-{k}: it keeps at least {k} experts, not {N}")


@torch.no_grad()
def moe_inputs(model: nn.Module, layers: dict[str, nn.Module], batches: list[dict]) -> dict[str, torch.Tensor]:
    """Each MoE layer's inputs at the real tokens of `batches` [N, D], from forwards of the model as it is."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    current: dict[str, torch.Tensor | None] = {"mask": None}

    def real_tokens(layer: nn.Module, x_TD: torch.Tensor) -> torch.Tensor | None:
        mask = current["mask"]          # the batch's own (a stock block keeps no routing record of its own)
        return mask.reshape(-1) if mask is not None and mask.numel() == x_TD.shape[0] else None
    try:
        with layer_inputs(layers, real_tokens) as got:
            for batch in batches:
                current["mask"] = batch.get("attention_mask")
                model(**{k: v.to(device) for k, v in batch.items()})
    finally:
        model.train(was_training)
    return {name: torch.cat(rows) for name, rows in got.items()}


def prune_model(model: nn.Module, request: ExpertCount, batches: list[dict]) -> dict:
    """Keep the `request.num_experts` most salient experts of every MoE layer (ties: the lower index), in their
    order; exact copies of an earlier expert (`core.resize.copy_groups`, as growth makes them) go first, and the
    copies of a group that stay take back the removed ones' probability (+log(n / m) on their logits), so that
    pruning a grown model back removes its copies and gives its function again. Returns, per layer, the scores,
    the experts kept and removed, and which were copies."""
    layers = check_request(model, request, grow=False)
    inputs = moe_inputs(model, layers, batches) if request.by != "random" else {}
    activation = getattr(model.config.get_text_config(), "hidden_act", None) or "silu"
    report = {}
    for index, (name, module) in enumerate(layers.items()):
        stock = not isinstance(module, MoELayer)
        layer = as_moe_layer(module, activation) if stock else module
        with _eval(layer):
            score = expert_saliency(layer, inputs.get(name, torch.empty(0)), request.by, seed=request.seed + index)
        first = copy_groups(layer)
        keep, shift = choose_experts(first, score, request.num_experts)
        if stock:
            if any(shift):
                raise UpcycleError(f"{name}: pruning its exact copies would need a router bias the stock class "
                                   f"does not have; prune the upcycle folder instead")
            _select_stock(module, keep)
        else:
            replace_layer(model, name, select_experts(layer, keep, shift))
        report[name] = {"saliency": [float(s) for s in score], "kept": keep,
                        "removed": [e for e in range(layer.num_experts) if e not in keep],
                        "copies_of": {e: first[e] for e in range(layer.num_experts) if first[e] != e}}
    if not all(isinstance(m, MoELayer) for m in layers.values()):    # a stock class's config says its count
        _set_stock_count(model, request.num_experts)
    return report


def choose_experts(first: list[int], score: torch.Tensor, n: int) -> tuple[list[int], list[float]]:
    """The `n` experts kept (their indices, in order) and each one's logit shift, from the scores and each
    expert's first exact copy (`core.resize.copy_groups`): copies go before any distinct expert, then the lowest
    score (of equal scores the lower index stays); the copies of a group that stay take back the removed ones'
    share of its probability, +log(n / m)."""
    order = sorted(range(len(first)), key=lambda e: (first[e] != e, -float(score[e]), e))
    keep = sorted(order[:n])
    group, kept = Counter(first), Counter(first[e] for e in keep)
    return keep, [math.log(group[first[e]] / kept[first[e]]) for e in keep]


@torch.no_grad()
def _select_stock(block: nn.Module, keep: list[int]) -> None:
    """A stock sparse block with only the experts `keep`: its router rows and stacked expert tensors (transformers
    5's `gate_up_proj`, `down_proj` and their biases), and the counts the modules hold."""
    index = torch.tensor(keep, dtype=torch.long, device=block.gate.weight.device)
    for module in (block.gate, block.experts):
        for name, parameter in list(module.named_parameters(recurse=False)):
            if parameter.shape[0] == module.num_experts:
                setattr(module, name, nn.Parameter(parameter.index_select(0, index).clone(),
                                                   requires_grad=parameter.requires_grad))
        module.num_experts = len(keep)


def _set_stock_count(model: nn.Module, n: int) -> None:
    config = model.config.get_text_config()
    keys = [k for k in ("num_local_experts", "num_experts") if isinstance(getattr(config, k, None), int)]
    if not keys:
        raise UpcycleError(f"{type(model).__name__}'s config names its expert count under no key upcycle knows")
    for key in keys:
        setattr(config, key, n)


def grow_model(model: nn.Module, request: ExpertCount, batches: list[dict]) -> dict:
    """Add `request.num_experts - E` copies to every MoE layer: of the experts of highest utility (each expert
    once before any twice), or of every expert in turn (`uniform`), their router rows split on the calibration
    tokens (`core.router_split`); returns, per layer, the scores and the experts copied (expert E + i is a copy of
    `copied[i]`)."""
    layers = check_request(model, request, grow=True)
    if not all(isinstance(layer, MoELayer) for layer in layers.values()):
        raise UpcycleError(GROW_STOCK)
    inputs = moe_inputs(model, layers, batches)
    generator = torch.Generator().manual_seed(request.seed)       # the copies' perturbation, layer after layer
    report = {}
    for index, (name, layer) in enumerate(layers.items()):
        E = layer.num_experts
        score = None
        if request.by == "utility":
            with _eval(layer):
                score = expert_saliency(layer, inputs[name], "utility")
        copied = choose_copies(score, E, request.num_experts)
        with _eval(layer):
            offsets = copy_row_offsets(layer, inputs[name], copied, seed=request.seed + index)
        grown = duplicate_experts(layer, copied, offsets)
        perturb_copies(grown.experts, range(E, request.num_experts), request.perturb, generator)
        replace_layer(model, name, grown)
        report[name] = {"utility": None if score is None else [float(s) for s in score], "copied": copied,
                        "perturbed": request.perturb}
    return report


def choose_copies(score: torch.Tensor | None, E: int, n: int) -> list[int]:
    """The experts copied to grow E experts to `n`: of the highest score first, each once before any twice (ties:
    the lower index), or each in turn when there is no score (`uniform`); new expert E + i copies the i-th."""
    ranked = sorted(range(E), key=lambda e: (-float(score[e]), e)) if score is not None else list(range(E))
    return [ranked[i % E] for i in range(n - E)]


def replace_layer(model: nn.Module, name: str, layer: MoELayer) -> None:
    """Put `layer` where the MoE layer `name` is (its parent module's attribute of that name)."""
    parent, _, attribute = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attribute, layer)


class _eval:
    """The layer in eval mode while scored (capacity as at evaluation), as it was afterwards."""

    def __init__(self, layer: nn.Module) -> None:
        self.layer, self.was = layer, layer.training

    def __enter__(self) -> None:
        self.layer.eval()

    def __exit__(self, *exc) -> None:
        self.layer.train(self.was)
