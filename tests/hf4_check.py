"""Run inside a virtual environment with transformers 4.x (not upcycle): load every exported folder given
with plain AutoModelForCausalLM, compare its logits with the ones upcycle saved next to it, and generate.
Prints one JSON line per folder. Used by tests/test_export_transformers4.py."""

import json
import sys

import torch
import transformers

for folder in sys.argv[1:]:
    saved = torch.load(f"{folder}/expected_logits.pt")
    model, info = transformers.AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=saved["input_ids"]).logits
    generated = model.generate(saved["input_ids"][:, :4], max_new_tokens=3, do_sample=False)
    print(json.dumps({"folder": folder, "transformers": transformers.__version__, "class": type(model).__name__,
                      "loading_problems": {k: sorted(map(str, v)) for k, v in info.items() if v},
                      "max_abs_diff": (logits - saved["logits"]).abs().max().item(),
                      "generated_shape": list(generated.shape)}))
