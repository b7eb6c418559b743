"""An upcycle Qwen3-MoE export in torchtitan: its Hugging Face state-dict adapter, its model, the same logits.

    .venv/bin/python benchmarks/interop/torchtitan_check.py [--work DIR] [--json FILE]

torchtitan is where a model that outgrew one machine trains with expert parallelism (docs/large-models.md). Its
Qwen3 MoE loads Hugging Face checkpoints through `Qwen3StateDictAdapter`. This builds torchtitan 0.3.0 into a
cached environment (`$UPCYCLE_CACHE/runtimes/torchtitan-0.3.0`: torch 2.13 for the CPU, triton, which torchtitan
imports, and torchtitan's own requirements), converts a seeded random Qwen3 (runtimes_check.random_qwen3) with
`drop` into 4 experts, top-2, in every block (experts that differ, so a misplaced expert shows), exports it as
`Qwen3MoeForCausalLM`, and runs benchmarks/interop/torchtitan_worker.py there: the adapter's `from_hf` into
`load_state_dict`, a forward on the CPU, and `to_hf` back. The logits are compared with transformers' on the
export and with `upcycle.load` on the upcycle folder.

torchtitan has no Mixtral model (0.3.0: llama3 is dense; deepseek_v3, gpt_oss, kimi, qwen3, qwen3_5 are its
MoE models), so a Mixtral export has no torchtitan road; the JSON says so. Expert parallelism itself needs
several GPUs and is not run here.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

from upcycle.scripts import output_file, output_folder

ROOT = Path(__file__).resolve().parents[2]
TORCHTITAN = "0.3.0"
PROMPTS = ["The capital of France is", "def fibonacci(n):", "In 1984 there were 12,345 apples."]


def titan_env(cache: Path) -> Path:
    venv = cache / "runtimes" / f"torchtitan-{TORCHTITAN}"
    python = venv / "bin" / "python"
    stamp = venv / "upcycle-built.json"
    if stamp.is_file():
        return python
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    pip = [str(venv / "bin" / "pip"), "install", "-q"]
    subprocess.run([*pip, "torch==2.13.0"], check=True)        # the CPU build; then nothing pulls a CUDA one
    subprocess.run([*pip, f"torchtitan=={TORCHTITAN}", "triton"], check=True)
    stamp.write_text(json.dumps({"torchtitan": TORCHTITAN}))
    return python


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=output_folder, default=ROOT / "out" / "runtimes-check" / "torchtitan")
    parser.add_argument("--json", type=output_file, default=None, help="write the result here (default: print it)")
    args = parser.parse_args()
    import transformers
    from runtimes_check import random_qwen3

    import upcycle
    from upcycle.config import ConvertConfig
    from upcycle.config_reader import build
    from upcycle.conversion.pipeline import convert
    from upcycle.data.text import cache_dir
    from upcycle.export.from_folder import export_folder

    python = titan_env(cache_dir())
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    source = random_qwen3(work / "source")
    moe = {"num_experts": 4, "top_k": 2}
    convert(build(ConvertConfig, {"model": source, "method": "drop", "moe": moe, "placement": {"every": 1}}),
            work / "upcycled", overwrite=True, progress=False)
    export_folder(work / "upcycled", work / "stock", export_class="qwen3_moe", overwrite=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(work / "stock")
    sequences = [tokenizer(p)["input_ids"] for p in PROMPTS]
    request = work / "request.json"
    request.write_text(json.dumps({"folder": str(work / "stock"), "sequences": sequences,
                                   "logits": str(work / "titan.npz")}))
    worker = ROOT / "benchmarks" / "interop" / "torchtitan_worker.py"
    ran = subprocess.run([str(python), "-I", str(worker), str(request), str(work / "titan.json")],
                         capture_output=True, text=True)
    if ran.returncode:
        raise SystemExit(f"torchtitan worker failed:\n{ran.stderr[-3000:]}")
    result = json.loads((work / "titan.json").read_text())
    titan = np.load(work / "titan.npz")
    stock = transformers.AutoModelForCausalLM.from_pretrained(work / "stock").eval()
    ours = upcycle.load(work / "upcycled")
    found = {}
    with torch.no_grad():
        for experts in ("bfloat16", "float32"):
            diffs_hf, diffs_up, agree = [], [], []
            for i, ids in enumerate(sequences):
                t = titan[f"{experts}_{i}"]
                hf = stock(input_ids=torch.tensor([ids])).logits[0].numpy()
                up = ours(input_ids=torch.tensor([ids])).logits[0].numpy()
                diffs_hf.append(float(np.abs(t - hf).max()))
                diffs_up.append(float(np.abs(t - up).max()))
                agree.append(float((t.argmax(-1) == hf.argmax(-1)).mean()))
            found[f"experts_{experts}"] = {"max_abs_logit_diff_vs_transformers": max(diffs_hf),
                                           "max_abs_logit_diff_vs_upcycle": max(diffs_up),
                                           "argmax_agree": min(agree)}
    result.update({"ran": True, "source": "seeded random Qwen3 (4 blocks, width 256, SmolLM2's tokenizer), drop "
                   "into 4 experts, top-2, every block, exported as Qwen3MoeForCausalLM",
                   "prompts": len(PROMPTS), **found,
                   "logit_scale": float(max(np.abs(titan[k]).max() for k in titan.files)),
                   "transformers": transformers.__version__,
                   "mixtral": "no torchtitan road: torchtitan 0.3.0 has no Mixtral model",
                   "not_run": "expert parallelism (needs several GPUs)"})
    text = json.dumps(result, indent=1)
    if args.json:
        args.json.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
