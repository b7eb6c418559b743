"""The per-layer preservation check: each MoE layer against the dense FFN it replaces .

The end-to-end check (`preservation.py`) compares the two models' outputs, so it needs both models to run; this
one needs one block. On the probe's hidden states at that block (the FFN's inputs, captured by the layer-by-layer
replay), it compares the MoE layer's output with what the model's own FFN module computed on them (the family's
`ffn_output`), and reports the largest difference, absolute and relative to the largest dense output. For methods
that promise the dense function (copy, granular, spri with rho=0, dropless, normalized top-k) the difference must
stay within what rounding explains: the extracted FFN computed in two summation orders (`ReorderedFFN`) on the
same inputs gives this layer's rounding noise in this dtype, and the allowance is `check.noise_factor` times it,
at least a few units in the last place of the largest output (`preservation_tolerance`, the end-to-end rule).
Because the noise comes from the extraction and the reference from the model's own module, an architecture row
that extracts the wrong FFN (another activation, swapped projections) fails here, where the end-to-end check,
whose allowance is measured with the same extraction, lets it pass. For the other methods the difference is
the layer's drift at initialization, reported and never refused.
"""

from __future__ import annotations

import torch

from ..config import CheckConfig
from ..core.ffn import FFNWeights
from ..core.modes import eval_mode
from ..core.moe import MoELayer
from .preservation import ReorderedFFN, preservation_tolerance
from .report import LayerCheck

# Tokens of the probe the per-layer check replays (its first rows): enough to see a broken expert, and the
# replay through every block up to the last MoE layer costs a forward of them (slow in bfloat16 on a CPU).
LAYER_CHECK_TOKENS = 256


def layer_probe(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The first rows of the probe batch holding about LAYER_CHECK_TOKENS tokens (at least one row)."""
    first = next(iter(inputs.values()))
    per_row = first.shape[1] if "input_ids" in inputs and first.dim() == 2 else 1
    rows = max(1, LAYER_CHECK_TOKENS // max(per_row, 1))
    return {k: v[:rows] for k, v in inputs.items()}


@torch.no_grad()
def layer_check(dense: FFNWeights, layer: MoELayer, x_ND: torch.Tensor, check: CheckConfig, *,
                promised: bool, reference_ND: torch.Tensor | None = None) -> LayerCheck:
    """The layer's entry of the report: max |MoE - dense| on `x_ND` (the FFN's inputs, compute dtype), relative
    to max |dense|, and for a promised method the allowance and whether it passed."""
    if x_ND.shape[0] == 0:
        return LayerCheck(None, None, 0)
    y_dense = dense(x_ND)
    # the model's own FFN output on these inputs when the replay recorded it: then a row of the architecture
    # table that extracts the wrong FFN fails here (the rounding noise below comes from the extraction itself)
    y_ref = reference_ND if reference_ND is not None else y_dense
    with eval_mode(layer):
        y_moe = layer(x_ND)
    diff = (y_moe.float() - y_ref.float()).abs().max().item()
    scale = y_ref.float().abs().max().item()
    result = LayerCheck(diff, diff / scale if scale > 0 else diff, x_ND.shape[0])
    if promised:
        noise = (ReorderedFFN(dense)(x_ND).float() - y_dense.float()).abs().max().item()
        allowed = preservation_tolerance(scale, noise, x_ND.dtype, check)["allowed_max_abs_logit_diff"]
        result.allowed_max_abs_diff, result.rounding_noise, result.passed = allowed, noise, diff <= allowed
    return result
