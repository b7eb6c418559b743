"""Function preservation: compare the upcycled model with the dense one on a fixed held-out batch.

DESIGN principle 5 and METHODS §5 ("Function preservation and drift"): the conversion records the dense
model's outputs before any weight changes, converts in place (no second model in memory), runs the same batch
again and reports

  max_abs_logit_diff  max |z_dense - z_moe| over every compared output entry
  relative_logit_diff the same divided by max |z_dense|
  kl_to_dense         mean over real tokens of KL(softmax z_dense || softmax z_moe)  (null when the output
                      is not a distribution, e.g. a bare encoder's hidden states)

Which output is compared: a causal LM's `logits` (real tokens only), CLIP's `logits_per_text` (image-text
similarities, so both towers count), a bare encoder's `last_hidden_state` (then KL is undefined).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .config import CheckConfig


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
    """A deterministic batch: `texts` through the model's tokenizer when both exist (and the text is long
    enough), else seeded random ids."""
    cfg = model.config
    generator = torch.Generator().manual_seed(seed)
    inputs, source = {}, "random pixels"
    if hasattr(cfg, "vision_config") or cfg.model_type == "clip_vision_model":
        vision = getattr(cfg, "vision_config", cfg)
        size = vision.image_size
        inputs["pixel_values"] = torch.randn(check.sequences, vision.num_channels, size, size, generator=generator)
    if cfg.model_type == "clip_vision_model":
        return Probe(inputs, source)
    text_cfg = getattr(cfg, "text_config", cfg)
    length = check.tokens
    if (limit := _max_positions(text_cfg)) is not None:
        length = min(length, limit)
    ids, source = None, "random token ids"
    if tokenizer is not None and texts:
        flat = []
        for text in texts:
            flat += tokenizer(text, add_special_tokens=False)["input_ids"]
            if len(flat) >= check.sequences * length:
                break
        if len(flat) >= check.sequences * length:
            ids = torch.tensor(flat[: check.sequences * length]).view(check.sequences, length)
            source = text_source
    if ids is None:
        ids = torch.randint(0, text_cfg.vocab_size, (check.sequences, length), generator=generator)
    inputs.update(input_ids=ids, attention_mask=torch.ones_like(ids))
    return Probe(inputs, source)


@torch.no_grad()
def probe_output(model: nn.Module, probe: Probe) -> ProbeOutput:
    was_training = model.training
    model.eval()
    try:
        out = model(**probe.inputs)
    finally:
        model.train(was_training)
    if getattr(out, "logits_per_text", None) is not None:
        return ProbeOutput(out.logits_per_text.float(), "logits_per_text", True)
    mask = probe.inputs.get("attention_mask")
    if getattr(out, "logits", None) is not None:
        values, name, dist = out.logits, "logits", True
    elif getattr(out, "last_hidden_state", None) is not None:
        values, name, dist = out.last_hidden_state, "last_hidden_state", False
    else:
        values, name, dist = out.pooler_output, "pooler_output", False
    if values.dim() == 3:
        values = values[mask.bool()] if mask is not None and mask.shape == values.shape[:2] else values.flatten(0, 1)
    return ProbeOutput(values.float(), name, dist)


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
            "relative_logit_diff": diff / scale if scale > 0 else diff,
            "compared_rows": dense.values_NC.shape[0]}


def count_parameters(model: nn.Module) -> dict:
    """Total parameters (shared tensors once) and parameters active per token (k of E routed experts)."""
    from .surgery import moe_layers

    total = sum(p.numel() for p in model.parameters())   # parameters() yields tied tensors once
    inactive = 0
    for layer in moe_layers(model).values():
        per_expert = layer.experts.weights().num_params()
        inactive += (layer.num_experts - layer.top_k) * per_expert
    return {"total": total, "active_per_token": total - inactive}
