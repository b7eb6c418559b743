"""`granular`: fine-grained upcycling with virtual groups (He et al., arXiv 2410.07524; docs/methods.md §2.7).

The dense FFN is split along its intermediate dimension into G shards of width F/G (rows of W_gate/W_up and
the matching columns of W_down), so that sum_g shard_g(x) = FFN(x); the set of shards is replicated R times,
giving E = R * G experts laid out replica-major (expert e = r * G + g). Top-k counts shards, so it is the
replica-level k times G (e.g. 16 experts top-8 = 4 replicas x 4 shards, 2 replicas per token).
Virtual groups: the G shards of one replica share one router row, so their probabilities are equal and
top-k takes whole replicas.

The scale that restores the dense output is folded into W_down (and b_down), depending on the routing:
  renormalized top-k: each selected shard weighs p_r / (G sum_sel p), so the layer gives FFN(x) / G:
      fold s = G; the router rows are random (any router reproduces the dense FFN).
  raw softmax weights (softmax-then-top-k): each selected shard weighs its softmax probability. With a
      uniform router (zero rows: our choice, the only router for which a constant fold is exact) that is
      1/E, and the k selected shards are k/G whole replicas, so the layer gives (1/E) (k/G) FFN(x):
      fold s = E G / k. (Ties among equal probabilities are broken by torch.topk, which takes the lowest
      indices, i.e. whole replicas in our replica-major layout; the test checks it.)
b_down belongs to no shard: each shard carries b_down / G, so the G shards of a replica add up to b_down.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import torch

from ..config import Range
from ..core.ffn import FFNWeights
from ..errors import UpcycleError
from .registry import ExpertInit, LayerInputs, LayerLayout, random_router, register


def _layout(width: int, granularity: int) -> LayerLayout:
    """Experts F/G wide; a G that does not divide F is refused here too, so a dry run says so."""
    if width % granularity:
        raise UpcycleError(f"granular: granularity {granularity} must divide the FFN width {width}")
    return LayerLayout(width // granularity)


def _counts(E: int, top_k: int, G: int) -> None:
    """Every replica is G shards and a token takes whole replicas: E and top-k multiples of G."""
    if E % G or top_k % G:
        raise UpcycleError(f"granular: num_experts ({E}) and top_k ({top_k}) must be multiples of granularity {G}")


@dataclass(frozen=True)
class GranularArgs:
    """The arguments of `granular` (`--set method_args.NAME=VALUE`): their types, allowed values and defaults."""

    granularity: Annotated[int, Range(1)] = 4
    router_std: float = 0.02


@register("granular", paper="He et al. 2024, Upcycling Large Language Models into Mixture of Experts, "
                             "arXiv:2410.07524 (fine-grained experts, virtual groups)",
          preserves_function=lambda args, normalize_topk, dropless: dropless,
          layout=lambda width, args: _layout(width, args["granularity"]),
          counts=lambda num_experts, top_k, args: _counts(num_experts, top_k, args["granularity"]),
          no_deltas="its experts are slices of the dense FFN's width, narrower than it: no base of their shape")
def granular(ffn: FFNWeights, layer: LayerInputs, args: GranularArgs) -> ExpertInit:
    """Shards of the dense FFN (F/granularity wide), replicated; virtual-group router; output scale folded in."""
    num_experts, top_k = layer.num_experts, layer.top_k
    generator, normalize_topk = layer.generator, layer.normalize_topk
    granularity, router_std = args.granularity, args.router_std
    G, F, E = granularity, ffn.intermediate_size, num_experts
    if F % G:                   # G >= 1 is declared; the width is known only here
        raise UpcycleError(f"granular: granularity {G} must divide the FFN width {F}")
    _counts(E, top_k, G)
    replicas, width = E // G, F // G
    scale = float(G) if normalize_topk else E * G / top_k

    def shards(t: torch.Tensor | None, dim: int) -> torch.Tensor | None:
        if t is None:
            return None
        return torch.stack(t.split(width, dim=dim))            # [G, ...]

    sharded = FFNWeights(
        w_up=shards(ffn.w_up, 0), w_gate=shards(ffn.w_gate, 0), b_up=shards(ffn.b_up, 0),
        b_gate=shards(ffn.b_gate, 0), w_down=shards(ffn.w_down, 1) * scale,
        b_down=None if ffn.b_down is None else (ffn.b_down * scale / G).expand(G, -1).clone(),
        activation=ffn.activation)
    experts = sharded.map(lambda t: t.repeat(replicas, *([1] * (t.dim() - 1))).contiguous())
    if normalize_topk:
        router = random_router(replicas, ffn.hidden_size, router_std, generator).repeat_interleave(G, dim=0)
    else:
        router = torch.zeros(E, ffn.hidden_size)
    return ExpertInit(experts=experts, router_ED=router,
                      info={"granularity": G, "replicas": replicas, "shard_width": width, "folded_scale": scale})
