"""Load a stock Qwen3-MoE export into torchtitan and run it, for benchmarks/interop/torchtitan_check.py.

    VENV/bin/python -I benchmarks/interop/torchtitan_worker.py REQUEST.json RESULT.json

REQUEST: {"folder": the export, "sequences": [[ids], ...], "logits": .npz path to write (one array each)}.
The model is torchtitan's own Qwen3 MoE (`torchtitan.models.qwen3`, the layers its configs build, sized from
the export's config.json). The weights go through torchtitan's Hugging Face state-dict adapter
(`Qwen3StateDictAdapter.from_hf`) into `load_state_dict`: every parameter; only its load-balancing buffers start
at their zeros. The forward runs on the CPU twice: as torchtitan computes (experts in bfloat16), and with its
experts in float32 (`float32_experts`). RESULT says whether `to_hf` gives back every tensor of the export
unchanged, the road back to a Hugging Face checkpoint after training. Needs torchtitan, torch, safetensors and
numpy; nothing of upcycle.
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file


def titan_config(hf: dict):
    """torchtitan's Qwen3 MoE config for the Hugging Face config `hf`: the layers torchtitan's own Qwen3-MoE
    configs build (`_build_qwen3_moe_layers`), at the export's sizes; its RMSNorm epsilon is a module constant
    (1e-6), set to the export's."""
    import torchtitan.models.qwen3 as qwen3
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear

    qwen3._EPS = hf["rms_norm_eps"]
    dim, head_dim, vocab = hf["hidden_size"], hf["head_dim"], hf["vocab_size"]
    return qwen3.Qwen3Model.Config(
        vocab_size=vocab, dim=dim, norm=qwen3._qwen3_norm(dim),
        enable_weight_tying=bool(hf.get("tie_word_embeddings", False)),
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=qwen3._EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=qwen3._LINEAR_INIT),
        layers=qwen3._build_qwen3_moe_layers(
            fuse_qkv=False, n_layers=hf["num_hidden_layers"], dim=dim, n_heads=hf["num_attention_heads"],
            n_kv_heads=hf["num_key_value_heads"], head_dim=head_dim, moe_hidden_dim=hf["moe_intermediate_size"],
            num_experts=hf["num_experts"], top_k=hf["num_experts_per_tok"], attn_backend="flex",
            moe_comm_backend="standard",
            rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=hf["max_position_embeddings"],
                                   theta=float(hf.get("rope_theta") or hf["rope_parameters"]["rope_theta"]))))


@contextlib.contextmanager
def float32_experts():
    """torchtitan's GroupedExperts casts tokens and expert weights to bfloat16 for its grouped matmuls, always.
    With that cast made a no-op, the same modules compute in float32, which tells a misplaced weight (a large
    difference) from bfloat16's rounding (a small one)."""
    cast = torch.Tensor.bfloat16
    torch.Tensor.bfloat16 = lambda self, *args, **kwargs: self
    try:
        yield
    finally:
        torch.Tensor.bfloat16 = cast


def main() -> None:
    import torchtitan
    from torchtitan.models.qwen3 import Qwen3StateDictAdapter

    request = json.loads(Path(sys.argv[1]).read_text())
    folder = Path(request["folder"])
    hf = json.loads((folder / "config.json").read_text())
    checkpoint = {}
    for file in sorted(folder.glob("*.safetensors")):
        checkpoint.update(load_file(file))
    config = titan_config(hf)
    adapter = Qwen3StateDictAdapter(config, str(folder))
    titan_sd = adapter.from_hf(dict(checkpoint))
    with torch.device("meta"):
        model = config.build()
    model.to_empty(device="cpu")
    model.init_states()                    # every buffer to_empty left unset (rope caches, expert-bias counters)
    missing, unexpected = model.load_state_dict(titan_sd, strict=False)
    buffers = {name for name, _ in model.named_buffers()}
    missing = [m for m in missing if m not in buffers]          # buffers keep init_states' values (zeros)
    if missing or unexpected:
        raise SystemExit(f"torchtitan's model and the adapted state dict differ: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    model.eval()
    logits = {}
    for experts in ("bfloat16", "float32"):
        with torch.no_grad(), (float32_experts() if experts == "float32" else contextlib.nullcontext()):
            for i, ids in enumerate(request["sequences"]):
                # one document per sequence: positions 0..T-1, and the causal mask torchtitan makes from them
                positions = torch.arange(len(ids))[None]
                masks = model.get_attention_masks(positions)
                logits[f"{experts}_{i}"] = model(torch.tensor([ids]), positions, masks)[0].float().numpy()
    np.savez(request["logits"], **logits)
    back = adapter.to_hf(titan_sd)
    round_trip = sorted(back) == sorted(checkpoint) and all(torch.equal(back[k], checkpoint[k]) for k in checkpoint)
    Path(sys.argv[2]).write_text(json.dumps({
        "torchtitan": getattr(torchtitan, "__version__", None) or _version("torchtitan"), "torch": torch.__version__,
        "model": "torchtitan.models.qwen3 (Qwen3Model, _build_qwen3_moe_layers), Qwen3StateDictAdapter",
        "tensors": len(checkpoint), "titan_tensors": len(titan_sd), "round_trip_identical": round_trip,
        "round_trip_missing": sorted(set(checkpoint) - set(back))[:5],
    }, indent=1))


def _version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


if __name__ == "__main__":
    main()
