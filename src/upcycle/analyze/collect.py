"""One forward pass over the sources' rows, and every metric from it (docs/methods.md §5).

`capture` runs the model on each source's packed rows and keeps, for every MoE layer (upcycle's `MoELayer`, or
a stock Qwen2-MoE / Qwen3-MoE / Mixtral block), its input at each real token (forward pre-hooks; nothing of the
model's forward is changed), with the source of each token; and per source, the next-token NLL and, given the
dense model, the token-level KL(dense || model) of the output distributions at the real tokens (teacher
forcing on the same rows; `upcycle.probe.compare`, the conversion report's own KL).
`snapshot_metrics` turns that into `analysis.layer_metrics` per layer.

An encoder (docs/contrastive.md) predicts no token, so it has no NLL and no output distribution to take a KL
of: its forward is the hidden-state one its task uses (`upcycle.tasks.embedding`), one text per row, each batch
cut to its longest row, and beside the dense model it reports what its task reads instead: the cosine of each
text's sentence embedding (mean-pooled, normalized) to the dense encoder's embedding of the same text
(`embedding_cosine_to_dense`: 1 = the same direction, as a function-preserving conversion gives; retrieval
ranks by these directions), per source, and its minimum over the texts.

Shape suffixes: B rows, S sequence length, D model width, T real tokens, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ..core.layer_inputs import layer_inputs
from ..core.moe import MoELayer, moe_layers
from ..core.stock_moe import as_moe_layer, stock_moe_blocks
from ..data.source_texts import SourceRows
from ..errors import UpcycleError
from ..metrics import TokenSources, layer_metrics
from ..probe import ProbeOutput, compare
from ..tasks.embedding import last_hidden, mean_pool, trim
from ..tasks.kind import is_encoder


def moe_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The model's MoE layers, by name: upcycle's, else a stock class's sparse blocks."""
    return moe_layers(model) or stock_moe_blocks(model)


@dataclass
class Capture:
    inputs: dict[str, list[torch.Tensor]] = field(default_factory=dict)     # layer -> [T_b, D] per batch
    sources: list[torch.Tensor] = field(default_factory=list)               # [T_b] per batch
    nll: dict[str, list[float]] = field(default_factory=dict)               # source -> [sum, count]
    kl: dict[str, list[float]] = field(default_factory=dict)                # source -> [sum, rows]
    max_abs_logit_diff: float = 0.0
    encoder: bool = False
    cosine: dict[str, list[float]] = field(default_factory=dict)            # encoder: source -> [sum, texts]
    min_cosine: float = 1.0


def _embeddings(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """An encoder's unit-norm sentence embeddings [B, D] (mean pooling, as its task computes them)."""
    return F.normalize(mean_pool(last_hidden(model, ids, mask).float(), mask), dim=-1)


def _forward_logits(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, attention_mask=mask).logits.float()


@torch.no_grad()
def capture(model: nn.Module, rows: list[SourceRows], dense: nn.Module | None = None, *, batch_size: int = 8,
            progress=None) -> Capture:
    modules = moe_modules(model)
    if not modules:
        raise UpcycleError(f"{type(model).__name__} has no MoE layer to analyze")
    current_mask: list[torch.Tensor] = []
    # stock MoE blocks keep no record: the batch's own mask says which tokens are real
    with layer_inputs(modules, lambda layer, x: current_mask[0].reshape(-1)) as inputs:
        cap = Capture(inputs=inputs, encoder=is_encoder(model))
        device = next(model.parameters()).device
        for index, source in enumerate(rows):
            nll_sum, nll_count, kl_sum, kl_rows = 0.0, 0, 0.0, 0
            for start in range(0, source.input_ids_NS.shape[0], batch_size):
                ids = source.input_ids_NS[start:start + batch_size]
                mask = source.attention_mask_NS[start:start + batch_size]
                if cap.encoder:
                    ids, mask = trim(ids, mask)
                ids, mask = ids.to(device), mask.to(device)
                current_mask[:] = [mask]
                if cap.encoder:
                    _encoder_batch(cap, model, dense, ids, mask, index, source.name)
                    if progress is not None:
                        progress.update(int(mask.sum()))
                    continue
                logits = _forward_logits(model, ids, mask)
                real = mask.bool()
                cap.sources.append(torch.full((int(real.sum()),), index, dtype=torch.long))
                targets = ids[:, 1:].masked_fill(~real[:, 1:], -100)
                nll_sum += float(F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                                 ignore_index=-100, reduction="sum"))
                nll_count += int((targets != -100).sum())
                if dense is not None:
                    reference = _forward_logits(dense, ids, mask)
                    if reference.shape != logits.shape:
                        raise UpcycleError(f"the dense model's outputs {tuple(reference.shape)} do not match the "
                                           f"model's {tuple(logits.shape)}: is --dense the model it came from?")
                    result = compare(ProbeOutput(reference[real], "logits", True),
                                     ProbeOutput(logits[real], "logits", True))
                    kl_sum += result["kl_to_dense"] * result["compared_rows"]
                    kl_rows += result["compared_rows"]
                    cap.max_abs_logit_diff = max(cap.max_abs_logit_diff, result["max_abs_logit_diff"])
                if progress is not None:
                    progress.update(int(real.sum()))
            if cap.encoder:
                continue
            cap.nll[source.name] = [nll_sum, nll_count]
            if dense is not None:
                cap.kl[source.name] = [kl_sum, kl_rows]
    return cap


def _encoder_batch(cap: Capture, model: nn.Module, dense: nn.Module | None, ids: torch.Tensor,
                   mask: torch.Tensor, index: int, name: str) -> None:
    """One batch of an encoder: the hooks keep the layers' inputs; with the dense model, the embeddings' cosine."""
    embedding_BD = _embeddings(model, ids, mask)
    cap.sources.append(torch.full((int(mask.sum()),), index, dtype=torch.long))
    if dense is None:
        return
    reference_BD = _embeddings(dense, ids, mask)
    if reference_BD.shape != embedding_BD.shape:
        raise UpcycleError(f"the dense model's embeddings {tuple(reference_BD.shape)} do not match the model's "
                           f"{tuple(embedding_BD.shape)}: is --dense the encoder it came from?")
    cosine_B = (embedding_BD * reference_BD).sum(-1).clamp(-1.0, 1.0)
    total = cap.cosine.setdefault(name, [0.0, 0])
    total[0] += float(cosine_B.double().sum())
    total[1] += len(cosine_B)
    cap.min_cosine = min(cap.min_cosine, float(cosine_B.min()))


def _ratio(pairs: dict[str, list[float]]) -> dict:
    per = {name: (s / n if n else None) for name, (s, n) in pairs.items()}
    total = sum(n for _, n in pairs.values())
    return {"all": sum(s for s, _ in pairs.values()) / total if total else None, "per_source": per}


def snapshot_metrics(model: nn.Module, cap: Capture, source_names: list[str], options, *, progress=None,
                     expert_source: list[int] | None = None) -> dict:
    """{'layers': {name: layer_metrics}, 'nll': ..., 'kl_to_dense': ... or None} of one captured forward;
    `options` (the analysis's) gives the metrics' output_tokens, bins, shuffles and seed."""
    sources_T = torch.cat(cap.sources)
    activation = getattr(model.config, "hidden_act", None)
    layers = {}
    for name, module in moe_modules(model).items():
        layer = module if isinstance(module, MoELayer) else as_moe_layer(module, activation)
        x_TD = torch.cat(cap.inputs[name])
        layers[name] = layer_metrics(layer, x_TD, TokenSources(sources_T, source_names, expert_source),
                                     output_tokens=options.output_tokens, bins=options.bins,
                                     shuffles=options.shuffles, seed=options.seed)
        cap.inputs[name] = []                  # the layer's inputs are no longer needed
        if progress is not None:
            progress.update(1)
    if cap.encoder:      # no next-token NLL or KL for an encoder (module docstring): the embeddings' cosine
        out = {"layers": layers, "nll": {"all": None, "per_source": dict.fromkeys(source_names)},
               "kl_to_dense": None,
               "embedding_cosine_to_dense": ({**_ratio(cap.cosine), "min": cap.min_cosine} if cap.cosine else None)}
        return out
    out = {"layers": layers, "nll": _ratio(cap.nll), "kl_to_dense": _ratio(cap.kl) if cap.kl else None}
    if cap.kl:
        out["max_abs_logit_diff"] = cap.max_abs_logit_diff
    return out
