"""Qwen3MoeForCausalLM: Qwen3 decoders (their q/k norms are Qwen3's own), dense blocks by `mlp_only_layers`."""

from __future__ import annotations

from dataclasses import dataclass

from .protocol import StockClass


def sparse_layout(model, moe_blocks) -> dict:
    """The keys Qwen-MoE classes share: expert width, top-k normalization, which blocks stay dense."""
    first = next(iter(moe_blocks.values()))
    n_blocks = model.config.num_hidden_layers
    return {"moe_intermediate_size": first.experts.intermediate_size, "norm_topk_prob": first.normalize_topk,
            "decoder_sparse_step": 1, "mlp_only_layers": [i for i in range(n_blocks) if i not in moe_blocks],
            "use_sliding_window": False, "sliding_window": None, "max_window_layers": n_blocks}


@dataclass(frozen=True)
class Qwen3Moe(StockClass):
    def config_keys(self, model, moe_blocks, source) -> dict:
        return {**sparse_layout(model, moe_blocks), "attention_bias": bool(source.get("attention_bias", False))}


CLASS = Qwen3Moe("qwen3_moe", "Qwen3MoeForCausalLM", "Qwen3MoeConfig", sources=("qwen3",), llama_cpp_arch="qwen3moe")
