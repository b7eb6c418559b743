"""Function preservation: compare the upcycled model with the dense one on a fixed held-out batch.

docs/design.md principle 5 and docs/methods.md §5 ("Function preservation and drift"): the conversion records the dense
model's outputs before any weight changes, converts in place (no second model in memory), runs the same batch
again and reports

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
reordered way (its intermediate dimension in two halves, summed second half first, in the model's dtype),
and the check allows `noise_factor` times that difference (at least a few ulps of the largest output, and
any allowance the user adds).
A real break (a wrong weight, a wrong scale) is not rounding and stays orders of magnitude above it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..config import CheckConfig
from ..core.architectures import PIXELS, TOKEN_IDS, family_of, tower_config
from ..core.ffn import FFNWeights, activation_fn
from ..core.modes import eval_mode
from ..data.packing import document_ids
from ..errors import UpcycleError

if TYPE_CHECKING:
    from ..core.architectures import Family


@dataclass(frozen=True)
class Probe:
    inputs: dict[str, torch.Tensor]
    source: str          # where the token ids came from


@dataclass(frozen=True)
class ProbeOutput:
    values_NC: torch.Tensor   # rows compared (real tokens / texts), float32
    name: str                 # which model output
    is_distribution: bool     # softmax over C is a probability distribution


def _max_positions(config) -> int | None:
    for key in ("max_position_embeddings", "n_positions"):
        if isinstance(getattr(config, key, None), int):
            return getattr(config, key)
    return None


def make_probe(model: nn.Module, tokenizer, texts: list[str] | None, check: CheckConfig, seed: int,
               text_source: str = "held-out text") -> Probe:
    """A deterministic batch holding what each tower of the model reads (its row of the architecture table):
    seeded random pixels of the tower's image size, and token ids: `texts` through the model's tokenizer when both
    exist (text too short for the batch is an error), else seeded random ids."""
    cfg = model.config
    towers = family_of(cfg).towers_of(cfg).values()
    generator = torch.Generator().manual_seed(seed)
    inputs, source = {}, "random pixels"
    # pixels are drawn before token ids, so a seed gives the probe it always gave
    for tower in (t for t in towers if t.input == PIXELS):
        vision = tower_config(cfg, tower)
        size = vision.image_size
        inputs[PIXELS] = torch.randn(check.sequences, vision.num_channels, size, size, generator=generator)
    text_tower = next((t for t in towers if t.input == TOKEN_IDS), None)
    if text_tower is None:
        return Probe(inputs, source)
    text_cfg = tower_config(cfg, text_tower)
    length = check.tokens
    if (limit := _max_positions(text_cfg)) is not None:
        length = min(length, limit)
    ids, source = None, "random token ids"
    if tokenizer is not None and texts:
        flat = []
        for text in texts:
            flat += document_ids(tokenizer, text)
            if len(flat) >= check.sequences * length:
                break
        if len(flat) < check.sequences * length:
            # random ids in its place would check another thing than the user asked for, and say so only in JSON
            raise UpcycleError(f"the probe text ({text_source}) holds {len(flat):,} tokens; the probe needs "
                               f"check.sequences x check.tokens = {check.sequences} x {length} = "
                               f"{check.sequences * length:,}: give more text or lower check.tokens")
        ids = torch.tensor(flat[: check.sequences * length]).view(check.sequences, length)
        source = text_source
    if ids is None:
        ids = torch.randint(0, text_cfg.vocab_size, (check.sequences, length), generator=generator)
    inputs.update(input_ids=ids, attention_mask=torch.ones_like(ids))
    return Probe(inputs, source)


def input_device(model: nn.Module) -> torch.device:
    """Where the model's inputs go: its input embedding's device (with --device cuda, the GPU), else its first
    parameter that holds data (a lazily read model keeps blocks not yet read on the meta device)."""
    try:
        weight = getattr(model.get_input_embeddings(), "weight", None)
    except (AttributeError, NotImplementedError):    # models without one input embedding (CLIP's two towers)
        weight = None
    if weight is not None and not weight.is_meta:
        return weight.device
    return next(p for p in model.parameters() if not p.is_meta).device


@torch.no_grad()
def probe_output(model: nn.Module, probe: Probe, outputs: tuple | None = None) -> ProbeOutput:
    """The output the family's row names (the first of its `outputs` the model returns), its rows at real tokens;
    `outputs` for a model outside the table (a stock MoE export compared with its dense source)."""
    device = input_device(model)
    with eval_mode(model):
        out = model(**{k: v.to(device) for k, v in probe.inputs.items()})
    outputs = outputs or family_of(model.config).outputs
    name, dist = next(((n, d) for n, d in outputs if getattr(out, n, None) is not None), (None, False))
    if name is None:
        raise UpcycleError(f"{type(model).__name__} returns none of the outputs its architecture row compares "
                           f"({', '.join(n for n, _ in outputs)})")
    values = getattr(out, name)
    mask = probe.inputs.get("attention_mask")
    if values.dim() == 3:
        values = (values[mask.to(values.device).bool()] if mask is not None and mask.shape == values.shape[:2]
                  else values.flatten(0, 1))
    return ProbeOutput(values.float().cpu(), name, dist)     # compared on the CPU: outputs of two devices


def compare(dense: ProbeOutput, moe: ProbeOutput) -> dict:
    """max |difference| and mean token KL(dense || upcycled)."""
    diff = (dense.values_NC - moe.values_NC).abs().max().item()
    kl = None
    if dense.is_distribution:
        # float64 in row chunks: a [rows, vocab] float64 temporary per term would cost GBs on a 50K vocabulary
        total, rows = 0.0, dense.values_NC.shape[0]
        for p_chunk, q_chunk in zip(dense.values_NC.split(64), moe.values_NC.split(64), strict=True):
            logp, logq = p_chunk.double().log_softmax(-1), q_chunk.double().log_softmax(-1)
            total += float((logp.exp() * (logp - logq)).sum())
        kl = total / rows
    scale = dense.values_NC.abs().max().item()
    return {"compared_output": dense.name, "max_abs_logit_diff": diff, "kl_to_dense": kl,
            "relative_logit_diff": diff / scale if scale > 0 else diff, "output_scale": scale,
            "compared_rows": dense.values_NC.shape[0]}


class ReorderedFFN(nn.Module):
    """The dense FFN `ffn` (views of the model's own weights) computed with its intermediate dimension split in
    two halves, the second half first: the same function, summed in another order."""

    def __init__(self, ffn: FFNWeights):
        super().__init__()
        self.ffn, self.act = ffn, activation_fn(ffn.activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        F_ = self.ffn.intermediate_size
        y = self._part(x, slice(F_ // 2, F_)) + self._part(x, slice(0, F_ // 2))
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
    """Total parameters (shared tensors once) and parameters active per token (k of E routed experts)."""
    from ..core.moe import moe_layers

    total = sum(p.numel() for p in model.parameters())   # parameters() yields tied tensors once
    inactive = 0
    for layer in moe_layers(model).values():
        per_expert = layer.experts.weights().num_params()
        inactive += (layer.num_experts - layer.top_k) * per_expert
    return {"total": total, "active_per_token": total - inactive}


@torch.no_grad()
def stock_probe_output(directory: Path, probe: Probe, dtype: torch.dtype, outputs: tuple) -> ProbeOutput:
    """The probe through the written stock checkpoint, loaded whole with plain transformers (only run when
    the output fits in memory: check.end_to_end)."""
    from transformers import AutoModelForCausalLM

    stock = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, trust_remote_code=False).eval()
    return probe_output(stock, probe, outputs)
