"""One forward pass over the sources' rows, and every metric from it (docs/methods.md §5).

`capture` runs the model on each source's packed rows and keeps, for every MoE layer (upcycle's `MoELayer`, or
a stock Qwen2-MoE / Qwen3-MoE / Mixtral block), its input at each real token (forward pre-hooks; nothing of the
model's forward is changed), with the source of each token; and per source, the next-token NLL and, given the
dense model, the token-level KL(dense || model) of the output distributions at the real tokens (teacher
forcing on the same rows; `conversion.preservation.compare`, the conversion report's own KL).
`snapshot_metrics` turns that into `analysis.layer_metrics` per layer.

Shape suffixes: B rows, S sequence length, D model width, T real tokens, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ..analysis import layer_metrics
from ..conversion.preservation import ProbeOutput, compare
from ..core.moe import MoELayer, moe_layers
from ..core.stock_moe import as_moe_layer, stock_moe_blocks
from ..data.source_texts import SourceRows
from ..errors import UpcycleError


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


def _forward_logits(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, attention_mask=mask).logits.float()


@torch.no_grad()
def capture(model: nn.Module, rows: list[SourceRows], dense: nn.Module | None = None, *, batch_size: int = 8,
            progress=None) -> Capture:
    modules = moe_modules(model)
    if not modules:
        raise UpcycleError(f"{type(model).__name__} has no MoE layer to analyze")
    cap = Capture(inputs={name: [] for name in modules})
    current_mask: list[torch.Tensor] = []

    def keep(name: str):
        def hook(module, args):
            x_BSD = args[0]
            x_TD = x_BSD.reshape(-1, x_BSD.shape[-1])
            mask_T = current_mask[0].reshape(-1).bool()
            cap.inputs[name].append(x_TD[mask_T.to(x_TD.device)].detach().float().cpu())
        return hook

    handles = [m.register_forward_pre_hook(keep(name)) for name, m in modules.items()]
    device = next(model.parameters()).device
    try:
        for index, source in enumerate(rows):
            nll_sum, nll_count, kl_sum, kl_rows = 0.0, 0, 0.0, 0
            for start in range(0, source.input_ids_NS.shape[0], batch_size):
                ids = source.input_ids_NS[start:start + batch_size].to(device)
                mask = source.attention_mask_NS[start:start + batch_size].to(device)
                current_mask[:] = [mask]
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
            cap.nll[source.name] = [nll_sum, nll_count]
            if dense is not None:
                cap.kl[source.name] = [kl_sum, kl_rows]
    finally:
        for handle in handles:
            handle.remove()
    return cap


def _ratio(pairs: dict[str, list[float]]) -> dict:
    per = {name: (s / n if n else None) for name, (s, n) in pairs.items()}
    total = sum(n for _, n in pairs.values())
    return {"all": sum(s for s, _ in pairs.values()) / total if total else None, "per_source": per}


def snapshot_metrics(model: nn.Module, cap: Capture, source_names: list[str], *, output_tokens: int,
                     bins: int, shuffles: int, seed: int, progress=None, expert_source: list[int] | None = None
                     ) -> dict:
    """{'layers': {name: layer_metrics}, 'nll': ..., 'kl_to_dense': ... or None} of one captured forward."""
    sources_T = torch.cat(cap.sources)
    activation = getattr(model.config, "hidden_act", None)
    layers = {}
    for name, module in moe_modules(model).items():
        layer = module if isinstance(module, MoELayer) else as_moe_layer(module, activation)
        x_TD = torch.cat(cap.inputs[name])
        layers[name] = layer_metrics(layer, x_TD, sources_T, source_names, output_tokens=output_tokens, bins=bins,
                                     shuffles=shuffles, seed=seed, expert_source=expert_source)
        cap.inputs[name] = []                  # the layer's inputs are no longer needed
        if progress is not None:
            progress.update(1)
    out = {"layers": layers, "nll": _ratio(cap.nll), "kl_to_dense": _ratio(cap.kl) if cap.kl else None}
    if cap.kl:
        out["max_abs_logit_diff"] = cap.max_abs_logit_diff
    return out
