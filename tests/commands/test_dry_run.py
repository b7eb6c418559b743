"""`upcycle convert --dry-run`: the plan from config.json alone, at any size."""

from __future__ import annotations

import json

import torch
import transformers

from upcycle.cli import main

LLAMA3_70B = dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                  num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rms_norm_eps=1e-5,
                  rope_theta=500000.0, tie_word_embeddings=False, architectures=["LlamaForCausalLM"])


def _dry_run(folder, capsys, *flags) -> dict:
    assert main(["convert", str(folder), "--dry-run", *flags]) == 0
    out = capsys.readouterr().out
    return json.loads(out[out.index("\n{") + 1:])


def test_a_70b_config_plans_the_parameters_a_meta_model_has(tmp_path, capsys):
    """Every block MoE with 8 copies is exactly Mixtral's shape: the plan's counts equal a MixtralForCausalLM
    instantiated on the meta device from the same sizes (no weight anywhere)."""
    transformers.LlamaConfig(**LLAMA3_70B).save_pretrained(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["config.json"]
    plan = _dry_run(tmp_path, capsys, "--every", "1", "--num-experts", "8", "--top-k", "2", "--dtype", "bfloat16")
    with torch.device("meta"):
        mixtral = transformers.MixtralForCausalLM(transformers.MixtralConfig(
            **{k: v for k, v in LLAMA3_70B.items() if k != "architectures"}, num_local_experts=8,
            num_experts_per_tok=2))
    total = sum(p.numel() for p in mixtral.parameters())
    per_expert = 3 * LLAMA3_70B["hidden_size"] * LLAMA3_70B["intermediate_size"]
    assert plan["parameters"]["after"]["total"] == total
    assert plan["parameters"]["after"]["active_per_token"] == total - 80 * 6 * per_expert
    dense = plan["parameters"]["before"]["total"]
    assert 70.5e9 < dense < 70.6e9 and plan["parameters"]["before"]["active_per_token"] == dense
    # routers stay float32 in a bfloat16 output
    router = 80 * 8 * LLAMA3_70B["hidden_size"]
    assert plan["output_bytes"]["bfloat16"] == 2 * (total - router) + 4 * router + 80 * 8 * 4   # + selection bias
    assert plan["num_moe_layers"] == 80


def test_dry_run_every_other_block_and_its_refusals(tmp_path, capsys):
    transformers.LlamaConfig(**LLAMA3_70B).save_pretrained(tmp_path)
    plan = _dry_run(tmp_path, capsys, "--every", "2", "--method", "granular", "--set", "method_args.granularity=4",
                    "--num-experts", "16", "--top-k", "8")
    assert plan["num_moe_layers"] == 40 and plan["moe_layers"][0] == "text.1"
    per_layer = 3 * 8192 * 28672
    # granular: 16 experts a quarter as wide = 4 x the dense FFN per layer, 8 of 16 active = the dense FFN x 2
    added = plan["parameters"]["after"]["total"] - plan["parameters"]["before"]["total"]
    assert added == 40 * (3 * per_layer + 16 * 8192)          # 4x the FFN - the FFN, plus the router
    assert main(["convert", str(tmp_path), "--dry-run", "--set", "method_args.granularity=5", "--method",
                 "granular", "--num-experts", "10", "--top-k", "5"]) == 2
    assert "granularity 5 must divide the FFN width 28672" in capsys.readouterr().err
