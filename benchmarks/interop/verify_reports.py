"""Recompute a conversion report's numbers independently of the code that wrote them.

For each upcycle folder given, this reloads the dense source model with plain transformers and the MoE
model with `upcycle.load`, rebuilds the probe batch from the tokenizer directly (the first sequences x
tokens ids of the held-out Wikipedia split), and recomputes
  - max |logit difference| and mean token KL(dense || MoE) with torch.nn.functional.kl_div,
  - total parameters by summing the tensors stored in model.safetensors (less the MoE layers'
    `selection_bias` buffers; tied embeddings are stored once), and active parameters per token
    as total - sum over MoE layers of (E - k) x one expert's parameters,
then compares them with upcycle_report.json.

Run: python benchmarks/interop/verify_reports.py out/smollm2-copy out/smollm2-noise out/smollm2-drop
     -> benchmarks/results/verify_reports.json
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

import upcycle
from upcycle.data.model_names import resolve_model_name
from upcycle.data.text import wikipedia_split
from upcycle.scripts import output_file


def verify(folder: Path) -> dict:
    report = json.loads((folder / "upcycle_report.json").read_text())
    spec = json.loads((folder / "upcycle_config.json").read_text())
    source = resolve_model_name(report["source_model"])
    dense = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(source)
    moe = upcycle.load(folder)

    seqs, length = report["preservation"]["probe_shape"]
    ids = []
    for text in wikipedia_split()[1]:
        ids += tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) >= seqs * length:
            break
    batch = torch.tensor(ids[: seqs * length]).view(seqs, length)
    with torch.no_grad():
        z_dense = dense(input_ids=batch).logits.flatten(0, 1).double()
        z_moe = moe(input_ids=batch).logits.flatten(0, 1).double()
    kl = F.kl_div(z_moe.log_softmax(-1), z_dense.log_softmax(-1), log_target=True, reduction="batchmean").item()
    max_diff = (z_dense - z_moe).abs().max().item()

    with safe_open(folder / "model.safetensors", "pt") as f:
        # parameters only: the stored `selection_bias` of each MoE layer is a buffer (aux-free balancing)
        total = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys() if not k.endswith("selection_bias"))
    inactive = 0
    for layer in spec["layers"]:
        d, f_, gated = layer["hidden_size"], layer["intermediate_size"], layer["gated"]
        per_expert = (3 if gated else 2) * d * f_ + (d if layer["bias_down"] else 0) \
            + ((2 if gated else 1) * f_ if layer["bias_in"] else 0)
        inactive += (layer["num_experts"] - layer["top_k"]) * per_expert
    ours = {"max_abs_logit_diff": max_diff, "kl_to_dense": kl, "total": total, "active_per_token": total - inactive}
    reported = {"max_abs_logit_diff": report["max_abs_logit_diff"], "kl_to_dense": report["kl_to_dense"],
                "total": report["parameters"]["after"]["total"],
                "active_per_token": report["parameters"]["after"]["active_per_token"]}
    agree = (ours["total"] == reported["total"] and ours["active_per_token"] == reported["active_per_token"]
             and abs(ours["max_abs_logit_diff"] - reported["max_abs_logit_diff"]) <= 1e-4
             and abs(ours["kl_to_dense"] - reported["kl_to_dense"]) <= 1e-6 + 1e-3 * abs(reported["kl_to_dense"]))
    return {"folder": str(folder), "method": report["method"], "recomputed": ours, "reported": reported,
            "agree": agree}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("folders", type=Path, nargs="+")
    parser.add_argument("--out", type=output_file,
                        default=Path(__file__).parents[1] / "results" / "verify_reports.json")
    args = parser.parse_args()
    for folder in args.folders:        # each must be an upcycle conversion: it is what the script re-measures
        if not (folder / "upcycle_report.json").is_file() or not (folder / "upcycle_config.json").is_file():
            parser.error(f"{folder} is not a folder `upcycle convert` wrote (no upcycle_report.json and "
                         f"upcycle_config.json)")
    results = [verify(folder) for folder in args.folders]
    for r in results:
        print(f"{r['method']:6s} agree={r['agree']}  recomputed={r['recomputed']}  reported={r['reported']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"command": "python benchmarks/interop/verify_reports.py "
                                    + " ".join(map(str, args.folders)), "results": results}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
