"""The probe: the fixed, deterministic batch every check runs through two models, and the comparison of their
outputs (docs/methods.md §5, "Function preservation and drift"; the conversion's preservation check, the stock
export's check against the upcycled model, the analysis's KL to the dense model).

  max_abs_logit_diff  max |z_a - z_b| over every compared output entry
  relative_logit_diff the same divided by max |z_a|
  kl_to_dense         mean over real tokens of KL(softmax z_a || softmax z_b)  (null when the output is not a
                      distribution, e.g. a bare encoder's hidden states)

Which inputs the probe holds and which output is compared come from the family's row of the architecture table
(`upcycle.core.architectures`). A model can run whole, from a stock folder loaded with plain transformers, or a
block at a time from its checkpoint (`lazy_probe_output`), so no check needs a second model in memory.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .checkpoint.lazy import blocks_on_demand, materialize_trunk
from .checkpoint.streamed import StreamSource
from .config import CheckConfig
from .core.architectures import PIXELS, TOKEN_IDS, family_of, tower_config
from .core.modes import eval_mode
from .data.packing import document_ids
from .data.token_ids import check_token_ids, embedding_rows
from .errors import UpcycleError


@dataclass(frozen=True)
class Probe:
    inputs: dict[str, torch.Tensor]
    source: str          # where the token ids came from


@dataclass(frozen=True)
class ProbeOutput:
    values_NC: torch.Tensor   # rows compared (real tokens / texts), float32
    name: str                 # which model output
    is_distribution: bool     # softmax over C is a probability distribution


def max_positions(config) -> int | None:
    """The longest sequence a model's position table holds (None: no table, rotary positions)."""
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
    if (limit := max_positions(text_cfg)) is not None:
        length = min(length, limit)
    ids, source = None, "random token ids"
    if tokenizer is not None and texts:
        flat = text_ids(tokenizer, texts, check.sequences * length)
        if len(flat) < check.sequences * length:
            # random ids in its place would check another thing than the user asked for, and say so only in JSON
            raise UpcycleError(f"the probe text ({text_source}) holds {len(flat):,} tokens; the probe needs "
                               f"check.sequences x check.tokens = {check.sequences} x {length} = "
                               f"{check.sequences * length:,}: give more text or lower check.tokens")
        ids = torch.tensor(flat[: check.sequences * length]).view(check.sequences, length)
        check_token_ids(ids, embedding_rows(text_cfg), f"the probe text ({text_source}) as tokenized")
        source = text_source
    if ids is None:
        ids = torch.randint(0, text_cfg.vocab_size, (check.sequences, length), generator=generator)
    inputs.update(input_ids=ids, attention_mask=torch.ones_like(ids))
    return Probe(inputs, source)


def text_ids(tokenizer, texts: list[str], count: int) -> list[int]:
    """The token ids of `texts`, document after document, until there are at least `count` (or the texts end)."""
    flat: list[int] = []
    for text in texts:
        flat += document_ids(tokenizer, text)
        if len(flat) >= count:
            break
    return flat


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


@torch.no_grad()
def stock_probe_output(directory: Path, probe: Probe, dtype: torch.dtype, outputs: tuple) -> ProbeOutput:
    """The probe through the written stock checkpoint, loaded whole with plain transformers (only run when
    the output fits in memory: check.end_to_end)."""
    from transformers import AutoModelForCausalLM

    stock = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, trust_remote_code=False).eval()
    return probe_output(stock, probe, outputs)


@torch.no_grad()
def lazy_probe_output(source: StreamSource, probe: Probe,
                      around: Callable[[nn.Module], contextlib.AbstractContextManager] | None = None) -> ProbeOutput:
    """The probe through the whole model, each block read from disk for its forward and released after it;
    `around(model)`: a context held over the forward, entered after the blocks' read hooks are in place (the
    conversion's rounding-noise run swaps FFNs in there)."""
    model = source.model
    materialize_trunk(model, source.reader, source.names, source.dtype, source.storage, source.device)
    with blocks_on_demand(model, source.reader, source.names, source.dtype, source.storage, source.device), \
            (around(model) if around else contextlib.nullcontext()):
        return probe_output(model, probe)
