"""The conversion, block by block: replay the dense blocks in order, build each target's MoE layer, check it.

One loop serves the in-memory conversion (the dense model loaded whole) and the streaming one (a model whose
blocks are read from the checkpoint when their turn comes, `lazy.py`), so the two compute the same layers and
the same per-layer reports. For each tower, in block order (the GPTQ-style replay of `calibration.py`):
  1. the block's weights are made available (`before_block`: a no-op in memory, a read in streaming);
  2. the dense block runs on the probe's hidden states and on the calibration batches', each output becoming the
     next block's input; at a target block a hook on its FFN collects the FFN's inputs (the probe's tokens, all
     of them; the calibration's, reservoir-sampled to the budget with a per-layer seed);
  3. at a target, the method turns the dense FFN (+ the calibration activations) into the MoE layer, which is
     checked against the dense FFN on the probe's FFN inputs (`layer_check.py`);
  4. `after_block(path, block, built)` gets the block and the layer built for it (None for other blocks): the
     streaming caller installs it, writes the block and releases it; the in-memory caller keeps the layer and
     installs every layer at the end, so a method failing on any layer leaves the model untouched.
Blocks after the last one that needs the replay (no target, no check, no calibration after them) are visited
without running: `needs_compute` is False for them and `before_block` is not called.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from tqdm.auto import tqdm

from ..analysis.metrics import diversity, expert_similarity
from ..analysis.routing import layer_routing_stats
from ..config import ConvertConfig
from ..core.architectures import Family, find_tower_layers
from ..core.modes import eval_mode
from ..core.moe import MoELayer
from ..core.surgery import Target, layer_generator, tower_cfg
from ..errors import UpcycleError
from ..methods import Method
from .calibration import Reservoir, _first_block_inputs, _replay
from .layer_check import layer_check
from .report import LayerCalibration, LayerEntry, RoutingAtInit


class _AllRows:
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
class BlockVisit:
    path: str
    tower: str
    index: int
    target: Target | None
    needs_compute: bool


@dataclass
class BlockwiseResult:
    layers: list[LayerEntry] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=lambda: {"calibration": 0.0, "upcycle": 0.0, "check": 0.0})


def visits(model: nn.Module, family: Family, targets: list[Target], *, replay: bool) -> list[BlockVisit]:
    """Every block of every tower present, in order; `needs_compute` up to the tower's last target when the
    probe or calibration batches are replayed, else at the targets only."""
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


def _masks(batches: list[dict], tower) -> list[torch.Tensor | None]:
    """Each batch's padding mask for a tower that has one (the architecture table says), else None."""
    return [b.get("attention_mask") if tower.padding_mask else None for b in batches]


@torch.no_grad()
def convert_blocks(model: nn.Module, family: Family, targets: list[Target], method: Method, args: dict,
                   cfg: ConvertConfig, *, promised: bool, probe_batches: list[dict] | None,
                   calibration: list[dict] | None, before_block: Callable[[str, nn.Module], None],
                   after_block: Callable[[BlockVisit, nn.Module, MoELayer | None], None],
                   first_inputs: Callable[[dict, list[dict]], dict] | None = None,
                   layer_dtype: torch.dtype | None = None, progress: bool = True) -> BlockwiseResult:
    """Run the conversion's per-block work (module docstring). `first_inputs(towers, batches)` records the
    inputs of each tower's first block (default: the model's forward, stopped there). `layer_dtype`: the dtype
    the MoE layers are built in (default: the dense block's; the streaming conversion builds them in the storage
    dtype and checks them in the block's wider compute dtype, so no float32 copy of a layer's experts exists)."""
    result = BlockwiseResult()
    plan = visits(model, family, targets, replay=bool(probe_batches or calibration))
    first_inputs = first_inputs or (lambda towers, batches: _first_block_inputs(model, towers, batches))
    towers = {v.tower: model.get_submodule(v.path.rsplit(".", 1)[0]) for v in plan if v.needs_compute}
    with eval_mode(model):
        t = time.perf_counter()
        probe_states = first_inputs(towers, probe_batches) if probe_batches and towers else {}
        calib_states = first_inputs(towers, calibration) if calibration and towers else {}
        result.timings["calibration"] += time.perf_counter() - t
        bar = tqdm(plan, desc="upcycling blocks", unit="block", disable=not progress, leave=False)
        for visit in bar:
            block = model.get_submodule(visit.path)
            built = None
            if visit.needs_compute:
                before_block(visit.path, block)
                built = _visit(visit, block, model, family, method, args, cfg, promised, probe_states,
                               calib_states, probe_batches, calibration, result, layer_dtype)
            after_block(visit, block, built)
        bar.close()
    return result


def _visit(visit, block, model, family, method, args, cfg, promised, probe_states, calib_states, probe_batches,
           calibration, result: BlockwiseResult, layer_dtype: torch.dtype | None) -> MoELayer | None:
    target = visit.target
    ffn = family.ffn_input(block) if target is not None else None
    probe_rows = _AllRows() if target is not None and probe_states else None
    reservoir = None
    if target is not None and calibration:
        key = zlib.crc32(f"calibration:{cfg.seed}:{target.tower}:{target.index}".encode())
        reservoir = Reservoir(cfg.calibration.tokens, torch.Generator().manual_seed(key))
    tower = family.towers_of(model.config)[visit.tower]
    t = time.perf_counter()
    if probe_states:
        outputs: list[torch.Tensor] = []      # the model's own FFN output (the probe has no padding: all rows)
        hook = (family.ffn_output(block).register_forward_hook(
            lambda module, args, out: outputs.append(out.detach().reshape(-1, out.shape[-1])))
            if target is not None else None)
        try:
            _replay(block, probe_states[visit.tower], _masks(probe_batches, tower), ffn, probe_rows)
        finally:
            if hook is not None:
                hook.remove()
    tc = time.perf_counter()
    if calib_states:
        _replay(block, calib_states[visit.tower], _masks(calibration, tower), ffn, reservoir)
    result.timings["calibration"] += time.perf_counter() - tc
    result.timings["check"] += tc - t
    if target is None:
        return None
    activations, seen = None, None
    if reservoir is not None:
        if reservoir.seen == 0:
            raise UpcycleError(f"calibration: layer {target.name} saw no real tokens")
        activations, seen = reservoir.sample(), reservoir.seen
    t = time.perf_counter()
    tcfg = tower_cfg(model, family, target)
    dense = family.extract(block, tcfg)
    init = method(dense.map(lambda w: w.float()), args, num_experts=cfg.moe.num_experts, top_k=cfg.moe.top_k,
                  generator=layer_generator(cfg.seed, target), normalize_topk=cfg.moe.normalize_topk,
                  activations=activations)
    entry = LayerEntry(target.name, target.path, init.info, expert_similarity(init.experts),
                       diversity(init.experts))
    with torch.device(dense.w_up.device):       # where the block is (the GPU with --device cuda)
        layer = MoELayer.from_init(init.experts, init.router_ED, config=cfg.moe, shared=init.shared,
                                   router_bias_E=init.router_bias_E, dtype=layer_dtype or dense.w_up.dtype,
                                   output_dropout=family.output_dropout(tcfg))
    clusters = init.token_clusters
    del init            # the method's float32 experts: gone before the check runs beside the layer
    if activations is not None:
        entry.calibration = LayerCalibration(seen, activations.shape[0], RoutingAtInit(
            **layer_routing_stats(layer, activations, clusters)))
    result.timings["upcycle"] += time.perf_counter() - t
    if probe_rows is not None:
        t = time.perf_counter()
        reference = torch.cat(outputs) if outputs else None
        x = probe_rows.sample()
        entry.check = layer_check(dense, layer, x, cfg.check, promised=promised,
                                  reference_ND=reference if reference is not None and len(reference) == len(x)
                                  else None)
        result.timings["check"] += time.perf_counter() - t
    result.layers.append(entry)
    return layer
