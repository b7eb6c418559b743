"""The expert count of an MoE layer changed after conversion: a subset of its experts kept (pruning: REAP, Cerebras,
ICLR 2026, and its frequency and random baselines), or some of its experts duplicated (growth, Expert
Upcycling arXiv:2604.19835).

Both build a new `MoELayer` from the old one's tensors; routing options (top-k, renormalization, capacity, the
score function) and the shared experts stay as they were.

  select_experts(layer, keep)        the experts `keep`, in that order, with their router rows, router bias and
                                     selection bias: a token's logits for the kept experts are what they were
  copy_groups(layer)                 which experts are exact copies of an earlier one (as growth makes them)
  append_experts(layer, experts, rows)  experts from elsewhere (another fine-tune's FFN) with their router rows
  duplicate_experts(layer, sources, offsets)  experts E..E+len(sources)-1 copies of `sources`: each its source's
                                     weights, router bias and selection bias, and its source's router row plus
                                     an offset (`core.router_split`: the source's tokens shared out between it
                                     and its copies); no logit is shifted, so the router reaches the copies as it
                                     reaches the experts they copy (Expert Upcycling's router extension). With
                                     top-k fixed the output is not the same function, which the caller reports
  pruned_router_bias(bias, keep, shift)  select_experts' router bias from the old one alone (a streamed prune and
                                     grow write it)

A folder grown before copies kept their source's logits shifted each copied expert by -log n through the router
bias (its n copies shared its softmax probability, and lost every top-k choice to the unshifted experts); pruning
such exact copies (`copy_groups`) gives the kept ones their share back (`resize.expert_count.choose_experts`).
"""

from __future__ import annotations

import hashlib

import torch

from ..errors import UpcycleError
from .ffn import FFNWeights
from .layer_build import layer_like
from .moe import MoELayer


def _rebuilt(layer: MoELayer, index_E: torch.Tensor, bias_E: torch.Tensor | None) -> MoELayer:
    """A layer of `layer`'s structure and options whose expert e is `layer`'s expert index_E[e] (router row,
    selection bias and weights), with router bias `bias_E` (None: none)."""
    index = index_E.to(layer.router.weight.device)
    picked = layer.experts.weights().map(lambda t: t.index_select(0, index).clone())
    return layer_like(layer, picked, layer.router.weight.detach().index_select(0, index).clone(), bias_E,
                      layer.selection_bias.index_select(0, index))


def select_experts(layer: MoELayer, keep: list[int], logit_shift: list[float] | None = None) -> MoELayer:
    """The layer with only the experts `keep` (module docstring); `logit_shift`: added to each kept expert's logit
    through the router bias (made when the layer has none and a shift is not 0). Refused below top-k or for an
    unknown index."""
    E, k = layer.num_experts, layer.top_k
    if len(set(keep)) != len(keep) or not all(0 <= e < E for e in keep):
        raise UpcycleError(f"experts to keep must be distinct indices below {E}, got {keep}")
    if len(keep) < k:
        raise UpcycleError(f"a layer routing each token to {k} experts keeps at least {k}, not {len(keep)}")
    bias = layer.router.bias.detach() if layer.router.bias is not None else None
    return _rebuilt(layer, torch.tensor(keep, dtype=torch.long),
                    pruned_router_bias(bias, keep, logit_shift, device=layer.router.weight.device))


def pruned_router_bias(bias_E: torch.Tensor | None, keep: list[int], logit_shift: list[float] | None = None,
                       device: torch.device | str = "cpu") -> torch.Tensor | None:
    """The router bias of a layer cut to the experts `keep` (`bias_E`, None: the layer has none), plus
    `logit_shift` in float32 (a bias made of the shift alone when the layer has none and a shift is not 0)."""
    bias = bias_E.index_select(0, torch.tensor(keep, dtype=torch.long, device=bias_E.device)).clone() \
        if bias_E is not None else None
    if logit_shift is not None and any(logit_shift):
        shift = torch.tensor(logit_shift, dtype=torch.float32, device=bias.device if bias is not None else device)
        bias = shift if bias is None else bias + shift
    return bias


def copy_groups(layer: MoELayer) -> list[int]:
    """For each expert, the first expert it is an exact copy of (itself when none before it is): the same
    weights, router row, router bias and selection bias, bit for bit, as `duplicate_experts` makes them."""
    tensors = [*layer.experts.weights().tensors().values(), layer.router.weight.detach(),
               layer.selection_bias.unsqueeze(-1)]
    if layer.router.bias is not None:
        tensors.append(layer.router.bias.detach().unsqueeze(-1))

    def digest(e: int) -> bytes:          # a hash of the expert's bytes, read in place (no copy of its weights)
        h = hashlib.sha256()
        for t in tensors:
            h.update(memoryview(t[e].detach().contiguous().cpu().view(torch.uint8).numpy()))
        return h.digest()

    first: dict[bytes, list[int]] = {}
    out = []
    for e in range(layer.num_experts):
        # a hash match is checked tensor by tensor: two experts are copies only when their bytes are equal
        candidates = first.setdefault(digest(e), [])
        same = next((c for c in candidates if all(torch.equal(t[c].view(torch.uint8), t[e].view(torch.uint8))
                                                  for t in tensors)), None)
        if same is None:
            candidates.append(e)
        out.append(e if same is None else same)
    return out


def duplicate_experts(layer: MoELayer, sources: list[int], offsets_ND: torch.Tensor | None = None) -> MoELayer:
    """The layer with copies of the experts `sources` appended (module docstring), copy i's router row its
    source's plus `offsets_ND[i]` (None: plus 0, an exact copy); refused for a sigmoid router, whose top-k this
    split of a softmax router's tokens is not made for."""
    E = layer.num_experts
    check_growable(layer)
    if not all(0 <= e < E for e in sources):
        raise UpcycleError(f"experts to copy must be indices below {E}, got {sources}")
    index = [*range(E), *sources]
    bias = layer.router.bias.detach() if layer.router.bias is not None else None
    grown = _rebuilt(layer, torch.tensor(index, dtype=torch.long), pruned_router_bias(bias, index))
    if offsets_ND is not None:
        with torch.no_grad():
            grown.router.weight[E:] += offsets_ND.to(grown.router.weight)
    return grown


def check_growable(layer: MoELayer) -> None:
    """Refused for a router that does not score with a softmax (a sigmoid router scores each expert on its own;
    its copies' split is not made for it)."""
    if layer.config.score != "softmax":
        raise UpcycleError(f"growing shares a softmax router's tokens between copies; this layer's router "
                           f"scores with {layer.config.score}")


def append_experts(layer: MoELayer, experts: FFNWeights, rows_ND: torch.Tensor,
                   bias_N: torch.Tensor | None = None) -> MoELayer:
    """The layer with `experts` (stacked, of the layer's expert shape) appended after its own, their router rows
    `rows_ND` and router bias `bias_N` (None: 0 where the layer has a bias); selection bias 0."""
    E, n = layer.num_experts, experts.num_experts
    old = layer.experts.weights()
    if experts.intermediate_size != old.intermediate_size or experts.gated != old.gated \
            or experts.activation != old.activation or experts.hidden_size != old.hidden_size:
        raise UpcycleError(f"an expert of width {experts.intermediate_size} ({experts.activation}, gated="
                           f"{experts.gated}) does not fit a layer of experts {old.intermediate_size} wide "
                           f"({old.activation}, gated={old.gated})")
    present, added = old.tensors(), experts.tensors()
    if set(present) != set(added):
        raise UpcycleError(f"the new experts' tensors ({sorted(added)}) are not the layer's ({sorted(present)})")
    device, dtype = old.w_down.device, old.w_down.dtype
    stacked = FFNWeights(**{k: torch.cat([present[k], added[k].to(device, dtype)]) for k in present},
                         activation=old.activation)
    router = torch.cat([layer.router.weight.detach(), rows_ND.to(layer.router.weight)])
    bias = None
    if layer.router.bias is not None or bias_N is not None:
        base = layer.router.bias.detach() if layer.router.bias is not None else torch.zeros(E, device=router.device)
        extra = bias_N.to(router) if bias_N is not None else torch.zeros(n, device=router.device)
        bias = torch.cat([base, extra])
    selection = torch.cat([layer.selection_bias.detach(), torch.zeros(n).to(layer.selection_bias)])
    return layer_like(layer, stacked, router, bias, selection)
