"""Run inside a virtual environment with transformers 4.x (not upcycle): load every exported folder given
with plain AutoModelForCausalLM, compare its logits with the ones upcycle saved next to it, and generate; where
the folder has a tokenizer, load it with AutoTokenizer, compare its ids with the ones upcycle's transformers
produced, run generate(**tokenizer(text, return_tensors="pt")) (4.x refuses token_type_ids there) against the
upcycled model's greedy tokens, and run pipeline("text-generation"). Prints one JSON line per folder, with every
warning raised while loading. Used by tests/commands/test_export_transformers4.py."""

import json
import os
import sys
import warnings

import torch
import transformers

for folder in sys.argv[1:]:
    saved = torch.load(f"{folder}/expected_logits.pt")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, info = transformers.AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=saved["input_ids"]).logits
    generated = model.generate(saved["input_ids"][:, :4], max_new_tokens=3, do_sample=False)
    result = {"folder": folder, "transformers": transformers.__version__, "class": type(model).__name__,
              "loading_problems": {k: sorted(map(str, v)) for k, v in info.items() if v},
              "load_warnings": sorted({str(w.message) for w in caught}),
              "max_abs_diff": (logits - saved["logits"]).abs().max().item(),
              "generated_shape": list(generated.shape)}
    if os.path.exists(f"{folder}/tokenizer_config.json"):
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
        text = saved["text"]
        generator = transformers.pipeline("text-generation", model=folder)
        inputs = tokenizer(text, return_tensors="pt")
        from_tokenizer = model.generate(**inputs, max_new_tokens=3, do_sample=False)
        result |= {"tokenizer_class": type(tokenizer).__name__,
                   "ids_match": tokenizer(text)["input_ids"] == saved["text_ids"],
                   "tokenizer_outputs": sorted(inputs), "model_max_length": tokenizer.model_max_length,
                   "generate_from_tokenizer_matches": from_tokenizer[0].tolist() == saved["greedy"],
                   "pipeline_text": generator(text, max_new_tokens=3, do_sample=False)[0]["generated_text"]}
    print(json.dumps(result))
