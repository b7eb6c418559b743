"""Function preservation: compare the upcycled model with the dense one on a fixed held-out batch.

docs/design.md principle 5 and docs/methods.md §5 ("Function preservation and drift"): the conversion records the dense
model's outputs before any weight changes, converts in place (no second model in memory), runs the same batch
(the probe: `upcycle/probe.py`, which also compares the outputs) again and reports

  max_abs_logit_diff  max |z_dense - z_moe| over every compared output entry
  relative_logit_diff the same divided by max |z_dense|
  kl_to_dense         mean over real tokens of KL(softmax z_dense || softmax z_moe)  (null when the output
                      is not a distribution, e.g. a bare encoder's hidden states)

Which inputs the probe holds and which output is compared come from the family's row of the architecture table
(`upcycle.core.architectures`): each tower's input (token ids, or pixels of its image size), and the first of the
family's outputs the model returns, e.g. a causal LM's `logits` (real tokens only), CLIP's `logits_per_text`
(image-text similarities, so both towers count), a bare encoder's `last_hidden_state` (then KL is undefined).

The tolerance is calibrated, not fixed: an MoE layer that reproduces the dense FFN still sums its products in
another order (per-expert token gathers, a fused gate/up matmul, two weighted copies added), so its output
differs from the dense FFN by rounding, and that rounding grows through the depth, the number of converted
layers and the logits' scale, and depends on the dtype and the CPU's kernels. `rounding_noise` measures it
on the same probe: the dense model runs once more with each converted FFN computed in an equivalent
reordered way (its intermediate dimension in two parts split one past the middle, summed second part first, in
the model's dtype), and the check allows `noise_factor` times that difference (at least a few ulps of the largest
output, and any allowance the user adds).
A real break (a wrong weight, a wrong scale) is not rounding and stays orders of magnitude above it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from ..config import CheckConfig
from ..core.ffn import FFNWeights, activation_fn
from ..probe import Probe, ProbeOutput, probe_output

if TYPE_CHECKING:
    from ..core.architectures import Family


class ReorderedFFN(nn.Module):
    """The dense FFN `ffn` (views of the model's own weights) computed with its intermediate dimension split in
    two parts, the second part first: the same function, summed in another order. The split is one past the
    middle: at the middle itself, a matrix product that sums a width such as 512 or 768 in blocks sums the same
    two halves, and a + b = b + a exactly, so the measured noise is 0 and only the ulp floor is left."""

    def __init__(self, ffn: FFNWeights):
        super().__init__()
        self.ffn, self.act = ffn, activation_fn(ffn.activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        F_ = self.ffn.intermediate_size
        split = min(F_, F_ // 2 + 1)
        y = self._part(x, slice(split, F_)) + self._part(x, slice(0, split))
        return y if self.ffn.b_down is None else y + self.ffn.b_down

    def _part(self, x: torch.Tensor, rows: slice) -> torch.Tensor:
        f = self.ffn

        def project(w, b):
            return nn.functional.linear(x, w[rows], None if b is None else b[rows])

        if f.gated:
            h = self.act(project(f.w_gate, f.b_gate)) * project(f.w_up, f.b_up)
        else:
            h = self.act(project(f.w_up, f.b_up))
        return nn.functional.linear(h, f.w_down[:, rows])


@torch.no_grad()
def rounding_noise(model: nn.Module, probe: Probe, reference: ProbeOutput, blocks: list[tuple[nn.Module, object]],
                   family: Family) -> float:
    """max |difference| between `reference` (the dense model's output) and the dense model's output with the
    FFN of every block in `blocks` ((block, tower config) pairs) computed by `ReorderedFFN`. The model is
    restored exactly afterwards (module references only; no weight is copied or changed)."""
    saved = [(m, dict(m._modules)) for block, _ in blocks for m in block.modules()]
    try:
        for block, tower_config in blocks:
            family.install(block, ReorderedFFN(family.extract(block, tower_config)))
        reordered = probe_output(model, probe)
    finally:
        for module, children in saved:
            module._modules.clear()
            module._modules.update(children)
    return (reference.values_NC - reordered.values_NC).abs().max().item()


# The least difference the check allows, in units in the last place of the largest dense output: a
# reordering that happens to round identically on the probe (tiny models) still leaves the MoE its own few ulps.
FLOOR_ULPS = 8


def preservation_tolerance(scale: float, noise: float, dtype: torch.dtype, check: CheckConfig) -> dict:
    """The allowed max |difference| and its parts: `check.noise_factor` x the measured rounding noise, at least
    FLOOR_ULPS x eps(dtype) x max |dense output|, and at least the user's allowances `check.tolerance` and
    `check.relative_tolerance` x max |dense output| (0 by default)."""
    parts = {"rounding_noise": noise, "noise_factor": check.noise_factor,
             "calibrated_tolerance": check.noise_factor * noise,
             "ulp_floor": FLOOR_ULPS * torch.finfo(dtype).eps * scale, "output_scale": scale,
             "user_tolerance": max(check.tolerance, check.relative_tolerance * scale)}
    limit = max(parts["calibrated_tolerance"], parts["ulp_floor"], parts["user_tolerance"])
    return {"allowed_max_abs_logit_diff": limit, **parts}


def count_parameters(model: nn.Module) -> dict:
    """Total parameters (shared tensors once) and parameters active per token (k of E routed experts; a delta
    layer's base is active for every token, its deltas k of E)."""
    from ..core.moe import moe_layers

    total = sum(p.numel() for p in model.parameters())   # parameters() yields tied tensors once
    inactive = 0
    for layer in moe_layers(model).values():
        per_expert = layer.experts.parameters_per_expert()
        inactive += (layer.num_experts - layer.top_k) * per_expert
    return {"total": total, "active_per_token": total - inactive}
