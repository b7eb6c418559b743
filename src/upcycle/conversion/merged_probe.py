"""The probe through a merge's own blocks as they are written: our model's outputs, for the check of the stock
checkpoint the merge writes directly.

A streamed merge never holds its model whole, and with `export: hf` it never writes it in our layout either, so
our outputs on the probe are taken on the way: the probe's hidden states enter each tower's first block (the
trunk's forward, stopped there, as the calibration replay starts), each block runs on them once its MoE layer is
installed and before it is written and released (`run`), and at the end the model's forward runs with every
block handing back its tower's last output, so the trunk's head (the final norm, the LM head) turns it into the
outputs that the stock model, loaded whole with transformers, is compared with (`output`). The blocks compute in
the compute dtype as the replay does (a layer stored in bfloat16 computes in float32 on float32 inputs), as our
model read back from our layout in that dtype would.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..checkpoint.lazy import materialize_trunk, release
from ..checkpoint.streamed import StreamSource
from ..core.architectures import family_of, find_tower_layers
from ..core.modes import forward_replaced
from ..probe import Probe, ProbeOutput, probe_output
from .calibration import BlockInput


class ProbeThroughBlocks:
    """The probe's hidden states carried through the blocks of `source.model` as they come (`run`), and the
    model's outputs from them at the end (`output`). `first_inputs`: the block source's (`StreamedBlocks`)."""

    def __init__(self, source: StreamSource, probe: Probe,
                 first_inputs: Callable[[dict, list[list[dict]]], list[dict]]) -> None:
        model = source.model
        family = family_of(model.config)
        found = {name: find_tower_layers(model, tower) for name, tower in family.towers_of(model.config).items()}
        self.towers = {name: f[1] for name, f in found.items() if f is not None}
        self.source, self.probe = source, probe
        self.states: dict[str, list[BlockInput]] = first_inputs(self.towers, [[probe.inputs]])[0]
        self.rest: dict[str, tuple | None] = {}       # what a block returns besides its hidden states

    @torch.no_grad()
    def run(self, tower: str, block: nn.Module) -> None:
        """The block (in memory, its layer installed) on the probe's states of its tower."""
        for state in self.states[tower]:
            out = block(*state.args, **state.kwargs)
            state.hidden, self.rest[tower] = (out[0], tuple(out[1:])) if isinstance(out, tuple) else (out, None)

    def output(self) -> ProbeOutput:
        """The model's outputs on the probe: its trunk read, every block giving back its tower's last states."""
        s, model = self.source, self.source.model
        materialize_trunk(model, s.reader, s.names, s.dtype, s.storage, s.device)
        given = {}
        for tower, blocks in self.towers.items():
            (state,) = self.states[tower]
            rest = self.rest.get(tower)
            given |= dict.fromkeys(blocks, state.hidden if rest is None else (state.hidden, *rest))
        try:
            with forward_replaced(list(given), lambda block, forward: lambda *args, **kwargs: given[block]):
                return probe_output(model, self.probe)
        finally:
            release(model)
            s.reader.close()
