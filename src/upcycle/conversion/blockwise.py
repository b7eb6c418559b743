"""The conversion, block by block: replay the dense blocks in order, build each target's MoE layer.

One loop serves every conversion (`orchestrator.run_conversion` calls it for every block source): the dense
model in memory, a checkpoint read block by block (`streaming.py`), and several fine-tunes merged (`merge.py`),
so they compute the same layers and the same per-layer reports. For
each tower, in block order (the GPTQ-style replay of `calibration.py`):
  1. the block's weights are made available (`before_block`: a no-op in memory, a read from disk otherwise);
  2. the dense block runs on the hidden states of every `ReplayGroup` (the probe's, the calibration data's, a
     merge's per-source texts), each output becoming the next block's input; at a target block a hook on its
     FFN hands the FFN's inputs to the group's sampler (every probe token; the calibration's reservoir-sampled
     to the budget with a per-layer seed). A group's consecutive text batches of one width run as one forward
     (`calibration.join_batches`), and padding tokens skip an FFN that is one module (`replay_block`): the
     same rows for real tokens, in less time;
  3. at a target, `build_layer` turns the dense block and what the replay gathered into the MoE layer and its
     report entry (`MethodLayers` below for one dense model; `merge_layers.SourceLayers` for several);
  4. `after_block(visit, block, built)` gets the block and its layer (None for other blocks): the streamed
     source installs it, writes the block and releases it; the in-memory source keeps the layer and installs
     every layer at the end, so a method failing on any layer leaves the model untouched.
Blocks after the last one that needs the replay (no target, no check, no calibration after them) are visited
without running: `needs_compute` is False for them and `before_block` is not called.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn
from tqdm.auto import tqdm

from ..core.architectures import Family, find_tower_layers
from ..core.ffn import FFNWeights
from ..core.keyed import keyed_generator
from ..core.modes import eval_mode
from ..core.moe import MoELayer
from ..core.surgery import Target, tower_cfg
from ..errors import UpcycleError
from ..metrics.experts import similarity_and_diversity
from ..metrics.routing import layer_routing_stats
from .calibration import Capture, JoinedBatch, Reservoir, first_block_inputs, join_batches, replay_block
from .inputs import ConversionInputs
from .layer_check import layer_check, layer_probe
from .plan import ConversionPlan
from .report import LayerCalibration, LayerEntry, RoutingAtInit, Timings
from .upcycle_layer import upcycle_layer


class AllRows:
    """Collects every row handed to it (the probe's FFN inputs: a few hundred tokens)."""

    def __init__(self) -> None:
        self.rows: list[torch.Tensor] = []
        self.seen = 0

    def add(self, rows_ND: torch.Tensor) -> None:
        self.rows.append(rows_ND.detach())
        self.seen += rows_ND.shape[0]

    def sample(self) -> torch.Tensor:
        return torch.cat(self.rows)


@dataclass
class ReplayGroup:
    """Token batches replayed through the blocks. At a target block the FFN's inputs (real tokens) go to
    `sampler(target)`, a fresh `Reservoir` or `AllRows`; `keep_outputs` also records the model's own FFN output
    (the per-layer check's reference). The replay's seconds count to `timing`."""

    name: Hashable
    batches: list[dict]
    sampler: Callable[[Target], Reservoir | AllRows]
    timing: str = "calibration"
    keep_outputs: bool = False


@dataclass
class Replayed:
    """What one target block's replay gathered, by group name."""

    samples: dict[Hashable, Reservoir | AllRows]
    outputs: dict[Hashable, list[torch.Tensor]]


@dataclass
class BlockVisit:
    path: str
    tower: str
    index: int
    target: Target | None
    needs_compute: bool


# (the visit, the dense block, what its replay gathered, the timings to add to) -> the layer and its entry
LayerBuilder = Callable[[BlockVisit, nn.Module, Replayed, Timings], tuple[MoELayer, LayerEntry]]


class Blocks(Protocol):
    """What `convert_blocks` asks of a block source (`orchestrator.BlockSource` gives it all)."""

    model: nn.Module
    family: Family
    desc: str
    first_inputs: Callable[[dict, list[list[dict]]], list[dict]] | None

    def layer_builder(self) -> LayerBuilder: ...

    def before_block(self, path: str, block: nn.Module) -> None: ...

    def after_block(self, visit: BlockVisit, block: nn.Module, layer: MoELayer | None) -> None: ...


def visits(model: nn.Module, family: Family, targets: list[Target], *, replay: bool) -> list[BlockVisit]:
    """Every block of every tower present, in order; `needs_compute` up to the tower's last target when
    batches are replayed, else at the targets only."""
    by_path = {t.path: t for t in targets}
    out = []
    for name, tower in family.towers_of(model.config).items():
        found = find_tower_layers(model, tower)
        if found is None:
            continue
        layers_path, blocks = found
        last = max((t.index for t in targets if t.tower == name), default=-1)
        for i in range(len(blocks)):
            path = f"{layers_path}.{i}"
            out.append(BlockVisit(path, name, i, by_path.get(path), (replay and i <= last) or path in by_path))
    return out


def _masks(joined: list[JoinedBatch], tower) -> list[torch.Tensor | None]:
    """Each batch's padding mask for a tower that has one (the architecture table says), else None."""
    return [j.batch.get("attention_mask") if tower.padding_mask else None for j in joined]


@torch.no_grad()
def convert_blocks(source: Blocks, targets: list[Target], groups: list[ReplayGroup], timings: Timings, *,
                   progress: bool = True) -> list[LayerEntry]:
    """Run the conversion's per-block work (module docstring) over `source`'s model; each target's report
    entry, in block order. `source.first_inputs(towers,
    [batches, ...])` records the inputs of each tower's first block for each group's batches (None: the model's
    forward, stopped there)."""
    model, family, build_layer = source.model, source.family, source.layer_builder()
    before_block, after_block, first_inputs = source.before_block, source.after_block, source.first_inputs
    layers: list[LayerEntry] = []
    groups = [g for g in groups if g.batches]
    plan = visits(model, family, targets, replay=bool(groups))
    first_inputs = first_inputs or (lambda towers, lists: [first_block_inputs(model, towers, b) for b in lists])
    towers = {v.tower: model.get_submodule(v.path.rsplit(".", 1)[0]) for v in plan if v.needs_compute}
    tower_specs = family.towers_of(model.config)
    with eval_mode(model):
        with timings.phase("calibration"):
            joined = [join_batches(g.batches) for g in groups]
            states = (first_inputs(towers, [[j.batch for j in js] for js in joined]) if groups and towers
                      else [{} for _ in groups])
        # a tower's last block that computes feeds no other: its forwards stop at the FFN's input
        last = {v.tower: v.path for v in plan if v.needs_compute}
        bar = tqdm(plan, desc=source.desc, unit="block", disable=not progress, leave=False)
        for visit in bar:
            block = model.get_submodule(visit.path)
            built = None
            if visit.needs_compute:
                before_block(visit.path, block)
                replayed = _replay_groups(visit, block, family, tower_specs[visit.tower],
                                          list(zip(groups, joined, states, strict=True)), timings,
                                          output_needed=visit.path != last[visit.tower])
                if visit.target is not None:
                    built, entry = build_layer(visit, block, replayed, timings)
                    layers.append(entry)
            after_block(visit, block, built)
        bar.close()
    return layers


def _replay_groups(visit: BlockVisit, block: nn.Module, family: Family, tower,
                   replays: list[tuple[ReplayGroup, list[JoinedBatch], dict]], timings: Timings, *,
                   output_needed: bool) -> Replayed:
    """Replay `block` on each group's batches (its joined batches, the inputs its tower's blocks recorded)."""
    target, ffn_input = visit.target, family.ffn_input(block)
    ffn = ffn_input if target is not None else None
    # one module from the FFN's input to its output: padding tokens skip it (`replay_block`)
    whole_ffn = ffn_input if ffn_input is family.ffn_output(block) else None
    replayed = Replayed({}, {})
    for group, group_joined, group_states in replays:
        with timings.phase(group.timing):
            sampler = group.sampler(target) if target is not None else None
            hook = None
            if group.keep_outputs and target is not None:      # the model's own FFN output (the probe: all rows)
                outputs = replayed.outputs.setdefault(group.name, [])
                hook = family.ffn_output(block).register_forward_hook(
                    lambda module, args, out, outputs=outputs: outputs.append(out.detach().reshape(-1, out.shape[-1])))
            try:
                capture = Capture(ffn, sampler, [j.rows for j in group_joined]) if ffn is not None else None
                replay_block(block, group_states[visit.tower], _masks(group_joined, tower), capture,
                             padding_skips=None if group.keep_outputs else whole_ffn,
                             output_needed=output_needed or group.keep_outputs)     # the probe keeps FFN outputs
            finally:
                if hook is not None:
                    hook.remove()
            if sampler is not None:
                replayed.samples[group.name] = sampler
    return replayed


PROBE, CALIBRATION = "probe", "calibration"


def method_groups(tokens: int, seed: int, probe_batches: list[dict] | None,
                  calibration: list[dict] | None) -> list[ReplayGroup]:
    """The replay groups of a one-model conversion: the probe's first rows (every token, for the per-layer
    check) and the calibration batches (`tokens` reservoir-sampled per layer, with a seed of its own from
    `seed`)."""
    def reservoir(target: Target) -> Reservoir:
        return Reservoir(tokens, keyed_generator("calibration", seed, target.tower, target.index))

    return [ReplayGroup(PROBE, probe_batches or [], lambda target: AllRows(), timing="check", keep_outputs=True),
            ReplayGroup(CALIBRATION, calibration or [], reservoir)]


def probe_and_calibration(plan: ConversionPlan, probe_inputs: dict, calibration: list[dict] | None
                          ) -> list[ReplayGroup]:
    """`method_groups` of a conversion's probe (its first rows, when `check.per_layer` asks for the per-layer
    check) and calibration batches: what the in-memory and the streamed conversions replay."""
    return method_groups(plan.calibration.tokens, plan.seed,
                         [layer_probe(probe_inputs)] if plan.check.per_layer else None, calibration)


@dataclass
class MethodLayers:
    """Builds a target's MoE layer with an initialization method from the block's dense FFN (and the
    calibration tokens at its input), and checks it against that FFN on the probe's tokens (`layer_check.py`).
    `layer_dtype`: the dtype the layer is built in (default: the dense block's; the streaming conversion builds
    it in the storage dtype and checks it in the block's wider compute dtype, so no float32 copy of a layer's
    experts exists)."""

    model: nn.Module
    family: Family
    plan: ConversionPlan
    inputs: ConversionInputs           # the method, its arguments, whether it promised the dense function
    layer_dtype: torch.dtype | None = None

    def __call__(self, visit: BlockVisit, block: nn.Module, replayed: Replayed,
                 timings: Timings) -> tuple[MoELayer, LayerEntry]:
        target, plan = visit.target, self.plan
        activations = seen = None
        reservoir = replayed.samples.get(CALIBRATION)
        if reservoir is not None:
            if reservoir.seen == 0:
                raise UpcycleError(f"calibration: layer {target.name} saw no real tokens")
            activations, seen = reservoir.sample(), reservoir.seen
        with timings.phase("upcycle"):
            layer, entry, dense = self._layer(visit, block, activations, seen)
        probe_rows = replayed.samples.get(PROBE)
        if probe_rows is not None:
            with timings.phase("check"):
                outputs = replayed.outputs.get(PROBE)
                reference = torch.cat(outputs) if outputs else None
                x = probe_rows.sample()
                entry.check = layer_check(dense, layer, x, plan.check, promised=self.inputs.promised,
                                          reference_ND=reference if reference is not None and len(reference) == len(x)
                                          else None)
        return layer, entry

    def _layer(self, visit: BlockVisit, block: nn.Module, activations: torch.Tensor | None,
               seen: int | None) -> tuple[MoELayer, LayerEntry, FFNWeights]:
        """The MoE layer the method makes from the block's dense FFN, its report entry, and that FFN."""
        target, plan = visit.target, self.plan
        tcfg = tower_cfg(self.model, self.family, target)
        dense = self.family.extract(block, tcfg)
        init = self.inputs.method(dense.map(lambda w: w.float()), self.inputs.args, num_experts=plan.moe.num_experts,
                           top_k=plan.moe.top_k, generator=keyed_generator(plan.seed, target.tower, target.index),
                           normalize_topk=plan.moe.normalize_topk, activations=activations)
        entry = LayerEntry(target.name, target.path, init.info, *similarity_and_diversity(init.experts))
        layer = upcycle_layer(init, plan.moe, dtype=self.layer_dtype or dense.w_up.dtype,
                              output_dropout=self.family.output_dropout(tcfg), dense=dense)
        kept = getattr(layer.experts, "energy_kept", None)
        if kept is not None:    # delta experts: the least share of an expert's change from the dense FFN kept,
            #                     and the similarity of the experts the layer holds (not the method's, cut to rank)
            entry.method_facts = {**entry.method_facts, "delta_energy_kept": {k: round(v, 6) for k, v in kept.items()}}
            entry.expert_similarity, entry.diversity = similarity_and_diversity(layer.experts.weights())
        clusters = init.token_clusters
        del init            # the method's float32 experts: gone before the check runs beside the layer
        if activations is not None:
            entry.calibration = LayerCalibration(seen, activations.shape[0], RoutingAtInit(
                **layer_routing_stats(layer, activations, clusters)))
        return layer, entry, dense
