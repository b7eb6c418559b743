"""One target's MoE layer in a merge of several sources (`merge.py`): each source's FFN tensors of that block read
(only those), the experts made from them by the conversion's method, the router initialized from the replay
groups' FFN inputs (`methods.source_router`: random, prompts or data), and the layer's facts.

Reported per layer: router-source agreement (the fraction of a source's held-out tokens whose top-1 expert is
one of that source's), on the base model's FFN inputs at that depth; the largest cosine between two sources'
router rows (near 1: the router cannot tell them apart, mergekit-moe's "degenerate gates"); and each expert
against its source's FFN on held-out inputs (0 for copies: the expert is the source's tensors).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from ..checkpoint.streamed import StreamSource
from ..core.ffn import FFNWeights
from ..core.keyed import keyed_generator
from ..core.moe import MoELayer
from ..core.surgery import Target, tower_cfg
from ..methods import ExpertInit, random_router
from ..methods.source_router import centroid_row, expert_groups, source_agreement, source_router
from ..metrics.experts import similarity_and_diversity
from .blockwise import BlockVisit, Replayed
from .inputs import ConversionInputs
from .plan import ConversionPlan
from .report import LayerEntry, Timings
from .sources import Source
from .upcycle_layer import upcycle_layer


def _ffn_modules(family, block) -> dict[str, torch.nn.Module]:
    """The block's FFN modules (where the FFN's input and output are) by their path inside the block."""
    wanted = {id(family.ffn_input(block)), id(family.ffn_output(block))}
    return {name: m for name, m in block.named_modules() if id(m) in wanted}


def read_ffn(family, block, prefix: str, tcfg, reader, stream: StreamSource) -> FFNWeights:
    """A source's FFN of this block from `reader`, in float32 (rounded to the storage dtype first, as the output
    stores it): only the FFN's tensors are read (by `stream`'s names, onto its device), swapped into the
    (materialized) block for the family's extraction and swapped back."""
    names, storage, device = stream.names, stream.storage, stream.device
    saved = {}
    for path, module in _ffn_modules(family, block).items():
        state = module.state_dict()
        saved[path] = state
        loaded = {}
        for name, old in state.items():
            value = reader.get(names[f"{prefix}{path}.{name}"]).to(device or old.device)
            loaded[name] = value.to(storage).to(torch.float32) if value.is_floating_point() else value
        module.load_state_dict(loaded, strict=True, assign=True)
    try:
        return family.extract(block, tcfg).map(lambda t: t.to(torch.float32, copy=True))
    finally:
        for path, module in _ffn_modules(family, block).items():
            module.load_state_dict(saved[path], strict=True, assign=True)


def _stack(parts: list[FFNWeights]) -> FFNWeights:
    keys = parts[0].tensors()
    return dataclasses.replace(parts[0], **{k: torch.cat([p.tensors()[k] for p in parts]) for k in keys})


def merged_experts(plan: ConversionPlan, inputs: ConversionInputs, target: Target, ffns: list[FFNWeights],
                   samples: dict[tuple[int, str], torch.Tensor]) -> tuple[FFNWeights, torch.Tensor, dict]:
    """The routed experts of one target (float32, stacked) from the sources' FFNs, its router rows from the
    groups' FFN-input samples, and its facts."""
    method, args = inputs.method, inputs.args
    s = plan.sources
    counts = [e.count for e in s.experts]
    parts, method_rows, facts = [], [], []
    for i, (entry, ffn) in enumerate(zip(s.experts, ffns, strict=True)):
        init = method(ffn, args, num_experts=entry.count, top_k=min(plan.moe.top_k, entry.count),
                      generator=keyed_generator(plan.seed, "source", i, target.tower, target.index),
                      normalize_topk=plan.moe.normalize_topk, activations=samples.get((i, "calibration")))
        parts.append(init.experts)
        method_rows.append(init.router_ED)
        facts.append(init.info)
    experts = _stack(parts)
    D = experts.hidden_size
    if s.router == "random":
        router = random_router(sum(counts), D, s.router_std, keyed_generator(plan.seed, target.tower, target.index))
        rows = None
    else:
        kind = "calibration" if s.router == "data" else "prompts"
        rows = torch.stack([centroid_row(samples[(i, kind)], samples.get((i, "negative_prompts"))
                                         if s.router == "prompts" else None) for i in range(len(counts))])
        router = source_router(rows, counts)
        # experts made from one source share its row; the method's own (small random) rows break the tie
        start = 0
        for n, extra in zip(counts, method_rows, strict=True):
            if n > 1:
                router[start:start + n] += extra.to(router.device)
            start += n
    info = {"method_facts": facts if any(facts) else None}
    if rows is not None:
        cos = rows.double() @ rows.double().T
        eye = torch.eye(len(rows), dtype=cos.dtype, device=cos.device)      # the rows may be on the GPU
        info["router_rows_max_cosine"] = (float((cos - 2 * eye).max())
                                          if len(rows) > 1 else None)
    return experts, router, info


def _same_function(a: FFNWeights, b: FFNWeights) -> bool:
    """Whether two FFNs are one function: the same activation and every tensor equal (a copied expert)."""
    ta, tb = a.tensors(), b.tensors()
    return (a.activation == b.activation and ta.keys() == tb.keys()
            and all(x.shape == tb[k].shape and x.dtype == tb[k].dtype and torch.equal(x, tb[k]) for k, x in ta.items()))


@torch.no_grad()
def layer_agreement(layer: MoELayer, ffns: list[FFNWeights], samples: dict[tuple[int, str], torch.Tensor],
                    names: list[str], counts: list[int]) -> dict:
    """Per source with held-out tokens: router-source agreement and the share of its tokens each source's
    experts get as top-1; and each expert against its source's FFN on those tokens (max |difference|)."""
    groups_E = expert_groups(counts)
    weights = layer.experts.weights()
    agreement, shares, expert_diff = {}, {}, {}
    start = 0
    for i, name in enumerate(names):
        x = samples.get((i, "held_out"))
        if x is not None:
            x = x.to(layer.router.weight.device)
            ids = layer.route(x).topk_ids_TK
            agreement[name] = source_agreement(ids, groups_E, i)
            top1 = groups_E.to(ids.device)[ids[:, 0]]
            shares[name] = [float((top1 == j).double().mean()) for j in range(len(names))]
            probe, reference = x[:256].float(), None
            diffs = []
            for e in range(start, start + counts[i]):
                expert = weights.expert(e).map(lambda t: t.float())
                if _same_function(expert, ffns[i]):     # the same weights compute the same outputs, bit for bit
                    diffs.append(0.0)
                    continue
                reference = ffns[i](probe) if reference is None else reference
                diffs.append(float((expert(probe) - reference).abs().max()))
            expert_diff[name] = max(diffs)
        start += counts[i]
    return {"agreement": agreement, "top1_share_by_source": shares, "expert_vs_source_max_abs_diff": expert_diff}


@dataclass
class SourceLayers:
    """Builds a target's MoE layer from the sources' FFNs of that block (read from their checkpoints, only those
    tensors) and the replay groups' FFN inputs (`blockwise.LayerBuilder`), with the layer's agreement facts."""

    plan: ConversionPlan
    inputs: ConversionInputs        # the method and its arguments
    model: nn.Module
    base: Source
    sources: list[Source]
    stream: StreamSource            # the names of the checkpoints' tensors, the storage dtype and the device

    def __call__(self, visit: BlockVisit, block: nn.Module, replayed: Replayed,
                 timings: Timings) -> tuple[MoELayer, LayerEntry]:
        with timings.phase("upcycle"):
            plan, target, family = self.plan, visit.target, self.plan.family
            samples = {key: r.sample() for key, r in replayed.samples.items() if r.seen}
            prefix, tcfg = visit.path + ".", tower_cfg(self.model, family, target)
            ffns = [read_ffn(family, block, prefix, tcfg, src.reader, self.stream) for src in self.sources]
            shared = (read_ffn(family, block, prefix, tcfg, self.base.reader, self.stream)
                      if plan.sources.shared_expert else None)
            experts, router, info = merged_experts(plan, self.inputs, target, ffns, samples)
            init = ExpertInit(experts, router,
                              shared=shared.map(lambda t: t.unsqueeze(0)) if shared is not None else None)
            layer = upcycle_layer(init, plan.moe, dtype=self.stream.storage,
                                  output_dropout=family.output_dropout(tcfg))
            names_of = [f"{i}:{e.model}" for i, e in enumerate(plan.sources.experts)]
            facts = info.pop("method_facts")
            entry = LayerEntry(target.name, target.path, facts, *similarity_and_diversity(experts),
                               sources={**info, **layer_agreement(layer, ffns, samples, names_of,
                                                                  [e.count for e in plan.sources.experts]),
                                        "tokens": {f"{names_of[i]}/{kind}": int(x.shape[0])
                                                   for (i, kind), x in samples.items()}})
            for src in self.sources:
                src.reader.close()
        return layer, entry
