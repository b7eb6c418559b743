"""Qwen2MoeForCausalLM: Llama, Mistral and Qwen2 decoders, dense blocks by `mlp_only_layers`, a shared expert.

Qwen2-MoE gates its shared expert by sigmoid(shared_expert_gate x). The gate weight is written as SHARED_GATE in
every entry, so that sigmoid(gate x) rounds to exactly 0.5, and the shared expert's down projection is written x2
(with several shared experts, their concatenation: their outputs add up). Not zero: llama.cpp computes this
sigmoid as silu(z) / z (src/models/qwen2moe.cpp), which is 0 / 0 = NaN at z = 0 in every block; at z = 1e-20 x it
is 0.5 there too. In float16 (smallest subnormal 6e-8) the value rounds to zero, which the GGUF writer repairs.
With no shared expert, Qwen2-MoE (whose blocks always have one) gets a shared expert of width 1 with all weights
zero: its output is exactly zero, and so is every gradient of it and of its gate (h = act(0) * 0, a fixed point of
training), so it stays a no-op. Width 0 would be the same function, but every load in transformers 5 then warns
"Initializing zero-element tensors is a no-op" and peft wraps empty tensors (peft's LoRA, targeted by projection
name, still wraps the width-1 projections; their adapters' gradients are exactly zero too). The cost is
4 x hidden_size parameters per MoE block. Its q/k/v projections always carry biases: zeros when the source has none.
"""

from __future__ import annotations

from dataclasses import dataclass

from .protocol import StockClass
from .qwen3_moe import sparse_layout

# the shared expert's gate weight, every entry: sigmoid(SHARED_GATE * sum(x)) = 0.5 exactly in float32 and
# bfloat16 while |sum(x)| < 1e13 (0.5 + z/4 rounds to 0.5 for |z| < 2**-24), and nonzero for llama.cpp's silu(z)/z
SHARED_GATE = 1e-20


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


@dataclass(frozen=True)
class Qwen2Moe(StockClass):
    def config_keys(self, model, moe_blocks, source) -> dict:
        shared = next(iter(moe_blocks.values())).shared_experts
        return {**sparse_layout(model, moe_blocks), "qkv_bias": True, "shared_expert_intermediate_size":
                shared.num_experts * shared.intermediate_size if shared is not None else 1}

    def block_tensors(self, model, layer_name, layer):
        import torch

        s = layer.shared_experts.weights() if layer.shared_experts is not None else None
        D = layer.experts.hidden_size
        gate = torch.cat(list(s.w_gate)) if s is not None else torch.zeros(1, D, dtype=model.dtype)
        up = torch.cat(list(s.w_up)) if s is not None else torch.zeros(1, D, dtype=model.dtype)
        down = torch.cat(list(s.w_down), dim=1) * 2 if s is not None else torch.zeros(D, 1, dtype=model.dtype)
        tensors = {f"{layer_name}.shared_expert.gate_proj.weight": gate.contiguous(),
                   f"{layer_name}.shared_expert.up_proj.weight": up.contiguous(),
                   f"{layer_name}.shared_expert.down_proj.weight": down.contiguous(),
                   f"{layer_name}.shared_expert_gate.weight": torch.full((1, D), SHARED_GATE, dtype=model.dtype)}
        folded = ([{"layer": layer_name, "scale": 2.0, "into": "shared_expert.down_proj",
                    "why": f"sigmoid(shared_expert_gate x) = 0.5 for the gate weight {SHARED_GATE}"}]
                  if s is not None else [])
        return tensors, folded

    def model_tensors(self, model, prefix):
        import torch

        widths = {"q_proj": model.config.num_attention_heads, "k_proj": model.config.num_key_value_heads,
                  "v_proj": model.config.num_key_value_heads}
        out = {}
        for i in range(model.config.num_hidden_layers):
            for proj, heads in widths.items():
                key = f"model.layers.{i}.self_attn.{proj}.bias"
                if key.startswith(prefix):
                    out[key] = torch.zeros(heads * head_dim(model.config), dtype=model.dtype)
        return out


# untied_head: published Qwen2-MoE checkpoints have their own head, and llama.cpp's converter leaves a tied one
# out while its qwen2moe graph requires `output.weight`: a tied source's export is written untied (the head a copy
# of the embeddings, the same function) so that the converter's file loads
CLASS = Qwen2Moe("qwen2_moe", "Qwen2MoeForCausalLM", "Qwen2MoeConfig", sources=("llama", "mistral", "qwen2"),
                 shared_experts=True, untied_head=True, llama_cpp_arch="qwen2moe", llama_cpp_renormalizes=False)
