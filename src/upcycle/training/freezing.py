"""Which parameters train, and when: named parameter groups, a trainable set, and timed freezing rules.

SPRI (Shan et al. 2026; docs/methods.md §2.6) trains in two stages: for the first tau*T steps only the routed experts'
residual-carrying projection and the router train (the copied gate/up stay frozen), then all routed-expert
parameters and the router. That is `train: [routed]` plus the rule `{params: [experts_in], until: 0.1}`;
any other "freeze these groups for the first fraction of steps" schedule is written the same way.

Groups name parts of the MoE layers (the rest of the model is `dense`); anything else is a glob on parameter
names (`*.self_attn.*`). Gated experts keep gate and up fused in one [E, 2F, D] tensor, so `experts_gate` and
`experts_up` are row ranges of it: a rule that freezes a row range zeroes those gradient rows (AdamW's moments of
a fresh optimizer stay 0, so Adam moves them by 0) and restores the rows after the step (undoing weight decay).
Whole tensors frozen for part of the run lose their gradient before the step, so AdamW skips them entirely;
tensors frozen for the whole run never require a gradient at all. Under FSDP (`upcycle.training.parallel.sharding`) the
parameters are shards along dim 0 (experts) and a row range is cut out of each process's own part.
"""

from __future__ import annotations

import fnmatch

import torch
from torch import nn

from ..config import FreezeRule
from ..core.delta_experts import DeltaExperts
from ..core.moe import moe_layers
from ..errors import UpcycleError
from .parallel.sharding import is_dtensor, local

GROUPS = ("all", "dense", "moe", "routed", "router", "experts", "experts_in", "experts_gate", "experts_up",
          "experts_down", "shared_experts")

# parameter name -> index of the frozen part (None = the whole tensor); rows of [E, 2F, D] are dim 1
Selection = dict[str, tuple | None]


def _group(model: nn.Module, group: str) -> Selection:
    names = [n for n, _ in model.named_parameters()]
    layers = moe_layers(model)
    if group == "all":
        return dict.fromkeys(names)
    moe_names = [n for n in names if any(n.startswith(path + ".") for path in layers)]
    if group == "dense":
        in_moe = set(moe_names)
        return dict.fromkeys(n for n in names if n not in in_moe)
    if group == "moe":
        return dict.fromkeys(moe_names)
    picked: Selection = {}
    for path, layer in layers.items():
        experts = layer.experts
        F_ = experts.intermediate_size
        routed = {f"{path}.experts.{n}": p for n, p in experts.named_parameters()}
        if isinstance(experts, DeltaExperts):       # base and factors apart per matrix: whole tensors, no rows
            matrix = {n: DeltaExperts.matrix_of(n.rsplit(".", 1)[1]) for n in routed}
            in_names = [n for n in routed if matrix[n] in ("gate", "up")]
            down_names = [n for n in routed if matrix[n] == "down"]
            if group in ("experts_gate", "experts_up"):
                picked.update(dict.fromkeys(n for n in routed if matrix[n] == group.removeprefix("experts_")))
                continue
        else:
            in_names = [n for n in routed if n.rsplit(".", 1)[1] in ("w_gate_up", "w_up", "b_gate_up", "b_up")]
            down_names = [n for n in routed if n.endswith(".w_down") or n.endswith(".b_down")]
        router = [f"{path}.router.{n}" for n, _ in layer.router.named_parameters()]
        if group in ("router", "routed"):
            picked.update(dict.fromkeys(router))
        if group in ("experts", "routed"):
            picked.update(dict.fromkeys(routed))
        elif group == "experts_in":
            picked.update(dict.fromkeys(in_names))
        elif group == "experts_down":
            picked.update(dict.fromkeys(down_names))
        elif group in ("experts_gate", "experts_up"):
            if experts.gated:   # fused [gate; up] rows
                rows = (slice(None), slice(0, F_) if group == "experts_gate" else slice(F_, 2 * F_))
                picked.update(dict.fromkeys(in_names, rows))
            elif group == "experts_up":
                picked.update(dict.fromkeys(in_names))
        elif group == "shared_experts" and layer.shared_experts is not None:
            picked.update(dict.fromkeys(f"{path}.shared_experts.{n}" for n, _ in
                                        layer.shared_experts.named_parameters()))
    return picked


def select(model: nn.Module, specs: tuple[str, ...] | list[str], where: str = "train") -> Selection:
    """Union of groups and globs; an entry that matches nothing is an error (a typo must not train everything)."""
    names = [n for n, _ in model.named_parameters()]
    out: Selection = {}
    for spec in specs:
        if spec in GROUPS:
            part = _group(model, spec)
            if not part and spec != "shared_experts":
                raise UpcycleError(f"{where}: group {spec!r} selects no parameter of this model"
                                   + (" (it has no MoE layers)" if not moe_layers(model) else ""))
        else:
            part = dict.fromkeys(n for n in names if fnmatch.fnmatchcase(n, spec))
            if not part:
                raise UpcycleError(f"{where}: {spec!r} is neither a group ({', '.join(GROUPS)}) nor a pattern that "
                                   f"matches a parameter name (e.g. {names[0]!r})")
        for name, rows in part.items():
            out[name] = None if name in out and out[name] != rows else rows
    return out


def fixed_parameters(model: nn.Module) -> list[str]:
    """Parameters no train set or rule can make trainable: the bases of delta experts built with
    `moe.train_base: false` (the layer's config says so, and the saved spec keeps it)."""
    return [f"{path}.experts.{n}" for path, layer in moe_layers(model).items()
            if isinstance(layer.experts, DeltaExperts) and not layer.experts.train_base
            for n, p in layer.experts.named_parameters() if any(p is b for b in layer.experts.base_parameters())]


class Freezer:
    """Applies `train` (once) and timed `FreezeRule`s (each step) to a model's parameters."""

    def __init__(self, model: nn.Module, train: tuple[str, ...], rules: tuple[FreezeRule, ...], total_steps: int):
        self.params = dict(model.named_parameters())
        trainable = select(model, train, "train")
        partial = [n for n, rows in trainable.items() if rows is not None]
        if partial:
            raise UpcycleError(f"train: row groups (experts_gate, experts_up) cannot be the trainable set "
                               f"({partial[0]})")
        self.timed: list[tuple[int, Selection]] = []
        self._rule_of: list[int] = []      # which config rule each timed entry came from (for the log)
        for i, rule in enumerate(rules):
            if not 0 < rule.until <= 1:
                raise UpcycleError(f"freeze[{i}].until must be in (0, 1], got {rule.until}")
            chosen = select(model, rule.params, f"freeze[{i}]")
            if rule.until >= 1:
                for name, rows in chosen.items():
                    if rows is None:
                        trainable.pop(name, None)
                    else:
                        self.timed.append((total_steps, {name: rows}))
                        self._rule_of.append(i)
            else:
                self.timed.append((round(rule.until * total_steps), chosen))
                self._rule_of.append(i)
        for name in fixed_parameters(model):      # delta experts' bases under `moe.train_base: false`
            trainable.pop(name, None)
        for name, p in self.params.items():
            p.requires_grad_(name in trainable)
        self.trainable = [name for name in self.params if name in trainable]
        if not self.trainable:
            raise UpcycleError("nothing to train: the train set and the freeze rules leave no parameter")
        self._restore: list[tuple[torch.Tensor, tuple, torch.Tensor]] = []

    def rebind(self, model: nn.Module) -> None:
        """Use `model`'s parameters from now on: the same names, new objects once FSDP has sharded them. A row
        range (dim 1 of [E, 2F, D]) is cut from each process's part, which holds whole rows only when the
        tensor is split along dim 0 alone."""
        params = dict(model.named_parameters())
        if params.keys() != self.params.keys():
            raise UpcycleError("freezing: the sharded model's parameter names differ from the model's")
        for _, chosen in self.timed:
            for name in chosen:
                p = params[name]
                if chosen[name] is not None and is_dtensor(p) and any(
                        pl.is_shard() and pl.dim != 0 for pl in p.placements):
                    raise UpcycleError(f"freezing rows of {name}: it is sharded along {p.placements}, not dim 0")
        self.params = params

    def frozen_now(self, step: int) -> Selection:
        out: Selection = {}
        for until, chosen in self.timed:
            if step < until:
                for name, rows in chosen.items():
                    if name in self.trainable:
                        out[name] = None if name in out and out[name] != rows else rows
        return out

    def active_rules(self, step: int) -> list[int]:
        """Indices of the freeze rules holding at `step`."""
        return sorted({i for (until, _), i in zip(self.timed, self._rule_of, strict=True) if step < until})

    def before_step(self, step: int) -> None:
        """Call between backward and the optimizer step."""
        self._restore = []
        for name, rows in self.frozen_now(step).items():
            p = self.params[name]
            if rows is None:
                p.grad = None
            else:          # `local`: the parameter itself, or this process's shard of it under FSDP
                if p.grad is not None:
                    local(p.grad)[rows] = 0
                self._restore.append((p, rows, local(p.detach())[rows].clone()))

    @torch.no_grad()
    def after_step(self) -> None:
        for p, rows, saved in self._restore:
            local(p)[rows] = saved
        self._restore = []
