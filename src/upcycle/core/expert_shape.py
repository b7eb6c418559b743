"""One expert's structure (`ExpertShape`): what a full-expert layer (`moe.Experts`) and a delta-expert layer
(`delta_experts.DeltaExperts`) are built to, and what a saved layer spec lists (`STRUCTURE`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .ffn import FFNWeights


@dataclass(frozen=True)
class ExpertShape:
    """One expert's structure, that of the dense FFN it comes from: the model width, the expert's width, the
    activation, whether it is gated, and whether its input and output projections have biases."""

    hidden_size: int
    intermediate_size: int
    activation: str
    gated: bool
    bias_in: bool = False
    bias_down: bool = False

    @classmethod
    def of(cls, weights: FFNWeights) -> ExpertShape:
        """The shape of stacked FFN weights (a method's output, a dense FFN)."""
        return cls(weights.hidden_size, weights.intermediate_size, weights.activation, weights.gated,
                   bias_in=weights.b_up is not None or weights.b_gate is not None, bias_down=weights.b_down is not None)

    def with_width(self, intermediate_size: int) -> ExpertShape:
        return dataclasses.replace(self, intermediate_size=intermediate_size)


# a saved spec's keys for the expert's structure (`moe.MoELayer.spec` adds the layer's own and MoEConfig's)
STRUCTURE = tuple(f.name for f in dataclasses.fields(ExpertShape))
