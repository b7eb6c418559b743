"""MixtralForCausalLM: Llama and Mistral decoders with every block MoE, no shared expert, renormalized top-k."""

from __future__ import annotations

from dataclasses import dataclass

from .protocol import StockClass


@dataclass(frozen=True)
class Mixtral(StockClass):
    def block_prefix(self, layer_name: str) -> str:
        return layer_name.replace(".mlp", ".block_sparse_moe")

    def config_keys(self, model, moe_blocks, source) -> dict:
        first = next(iter(moe_blocks.values()))
        return {"intermediate_size": first.experts.intermediate_size, "router_jitter_noise": 0.0,
                "sliding_window": source.get("sliding_window")}


CLASS = Mixtral("mixtral", "MixtralForCausalLM", "MixtralConfig", sources=("llama", "mistral"),
                expert_keys=("w1", "w3", "w2"), every_block=True, always_renormalizes=True, llama_cpp_arch="llama")
