"""The runtime check: what upcycle writes, run by the real programs that read it, against `upcycle.load`.

    .venv/bin/python benchmarks/interop/runtimes_check.py                 # every part: 10 min on 2 cores, once built
    .venv/bin/python benchmarks/interop/runtimes_check.py --only llama.cpp
    .venv/bin/python benchmarks/interop/runtimes_check.py --docs          # docs/runtimes.md's table from the JSON

- llama.cpp: llama-cpp-python, built once from its source distribution into a cached environment
  (`$UPCYCLE_CACHE/runtimes/llama-cpp-python-VERSION`, CPU only; the first build took 10 minutes on 2
  cores). For every GGUF arch and weight type upcycle writes, from conversions of the embedded SmolLM2-135M, the
  file is loaded in llama.cpp and its token ids, greedy continuations and logits at every prompt position are
  compared with the upcycle folder loaded by `upcycle.load` and run by transformers. The same source
  distribution gives tests/fixtures/llama_cpp_facts.json (benchmarks/interop/llama_cpp_facts.py), the names and formulas
  the default test run checks without llama.cpp.
- llama.cpp-converter: stock exports of the copy-upcycled SmolLM2 (Qwen2-MoE of raw top-k; `auto` and Qwen2-MoE of
  the default renormalized top-k) through llama.cpp's own convert_hf_to_gguf.py (from the same source
  distribution), then run by llama.cpp as above.
- ONNX Runtime: docs/runtimes.md's recipe on a stock Qwen3-MoE export, against transformers.
- sentence-transformers: `SentenceTransformer(folder)` of a copy-upcycled all-MiniLM-L6-v2 against the dense one,
  and of one converted from a folder sentence-transformers saved itself.
- lm-eval: its `hf` model scores a stock Mixtral export (the `lm_eval` command) and the upcycle folder itself
  (`simple_evaluate` after `import upcycle`) on a local multiple-choice task (its own environment); every choice's
  log-likelihood is compared with the upcycle folder's, computed as lm-eval computes it.
- torchtitan: benchmarks/interop/torchtitan_check.py (its own environment; see there).

Results: benchmarks/results/runtimes/runtimes.json, with every version and the machine. A part that was not run
is recorded as such, with the reason, never left out.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from upcycle.machine import machine
from upcycle.scripts import output_file, output_folder

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results" / "runtimes" / "runtimes.json"
DOCS = ROOT / "docs" / "runtimes.md"
LLAMA_CPP_PYTHON = "0.3.36"
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    if n < 2:",
           "In 1984 there were 12,345 apples and 67 pears.", "Über naïve café — 東京 and emoji 🙂:",
           "Question: What do bees make?\nAnswer:"]
NEW_TOKENS = 20
F32_CACHE = "f32+f32-kv-cache"          # an F32 file run with llama.cpp's K/V cache in F32 (its default is F16)
# case -> how the SmolLM2 conversion is made and exported, and the GGUF weight types written from it
CASES = {
    "llama (mixtral, copy)": {"method": "copy", "export_class": "mixtral",
                              "types": ("f32", "f16", "bf16", "q8_0", "q4_0")},
    # SmolLM2's published tokenizer splits digits first (llama.cpp's "smollm"); the embedded one, rebuilt from a
    # GGUF file by transformers, does not ("gpt-2"): this case gives the folder the published pre-tokenizer
    "llama (mixtral, copy, SmolLM2's own pre-tokenizer)": {"method": "copy", "folder": "copy-smollm-pre",
                                                           "export_class": "mixtral", "digits": True,
                                                           "types": ("f16",)},
    "llama (mixtral, cluster)": {"method": "cluster", "export_class": "mixtral", "types": ("f16",)},
    "qwen2moe (copy, raw top-k)": {"method": "copy", "export_class": "qwen2_moe", "normalize_topk": False,
                                   "types": ("f32", "f16", "bf16", "q8_0", "q4_0")},
    # the same with 8 experts: the figures of a file depend on the model it holds (round 6 found 8 experts' bf16
    # and q4_0 rows below the 4-expert ones), so the table states each row's expert count
    "qwen2moe (copy, raw top-k, 8 experts)": {"method": "copy", "export_class": "qwen2_moe", "normalize_topk": False,
                                              "experts": 8, "folder": "copy-8-experts",
                                              "types": ("f32", "bf16", "q8_0", "q4_0")},
    "qwen2moe (spri, shared expert)": {"method": "spri", "export_class": "qwen2_moe", "normalize_topk": False,
                                       "types": ("f16",)},
    # Qwen3-MoE takes Qwen3 sources only (their q/k norms): a seeded random Qwen3 with SmolLM2's tokenizer
    "qwen3moe (copy, random Qwen3)": {"method": "copy", "export_class": "qwen3_moe", "source": "qwen3",
                                      "types": ("f32", "f16", "bf16", "q8_0", "q4_0")},
}
# Built for x86-64 with AVX2 (every machine here has it), not for the build machine's own CPU: a native build on
# an AMD EPYC stops on an Intel Xeon with 'invalid opcode', and one on a Xeon whose flags list AMX stops there too
# (q8_0 and q4_0 take ggml's AMX kernels, whose tile state this virtual machine's kernel does not grant).
BUILD_FLAGS = ("-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF "
               "-DLLAMA_BUILD_SERVER=OFF -DGGML_OPENMP=ON -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON "
               "-DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF "
               "-DGGML_AMX_BF16=OFF")


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def llama_cpp_env(cache: Path) -> tuple[Path, Path]:
    """(python of the cached llama-cpp-python environment, its source distribution), built on first use and again
    when the build flags change."""
    home = cache / "runtimes"
    venv = home / f"llama-cpp-python-{LLAMA_CPP_PYTHON}"
    sdist = home / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"
    stamp = venv / "upcycle-built.json"
    built = json.loads(stamp.read_text()) if stamp.is_file() else {}
    if built.get("sdist_sha256") == (sha256(sdist) if sdist.is_file() else None) and \
            built.get("build_flags") == BUILD_FLAGS:
        return venv / "bin" / "python", sdist
    home.mkdir(parents=True, exist_ok=True)
    if not sdist.is_file():
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                        f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", str(home)], check=True)
    if venv.exists():
        shutil.rmtree(venv)            # a build that did not finish (no stamp): ours, under the cache
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    print(f"building llama-cpp-python {LLAMA_CPP_PYTHON} from source into {venv} (10 min on 2 cores here)",
          flush=True)
    env = {**os.environ, "CMAKE_ARGS": BUILD_FLAGS, "CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count() or 2)}
    subprocess.run([str(venv / "bin" / "pip"), "install", "-q", str(sdist)], check=True, env=env)
    stamp.write_text(json.dumps({"version": LLAMA_CPP_PYTHON, "sdist_sha256": sha256(sdist),
                                 "build_flags": BUILD_FLAGS}))
    return venv / "bin" / "python", sdist



def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("upcycle", "torch", "transformers", "gguf", "onnxruntime", "onnx", "sentence-transformers"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    git = ["git", "-C", str(ROOT)]
    out["upcycle_commit"] = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True,
                                           text=True).stdout.strip() or None
    # the commit alone says what ran only when nothing of the package or these scripts was changed beside it
    changed = subprocess.run([*git, "status", "--porcelain", "--", "src", "benchmarks/*.py"], capture_output=True,
                             text=True).stdout.strip()
    out["uncommitted_changes"] = changed.splitlines() if changed else []
    return out


def convert_case(case: dict, folder: Path) -> None:
    from upcycle.config import ConvertConfig
    from upcycle.config_reader import build
    from upcycle.conversion.pipeline import convert

    if (folder / "upcycle_report.json").is_file():
        return
    moe = {"num_experts": case.get("experts", 4), "top_k": 2, "normalize_topk": case.get("normalize_topk", True)}
    model = random_qwen3(folder.parent / "source") if case.get("source") == "qwen3" else "default"
    cfg = {"model": model, "method": case["method"], "moe": moe, "placement": {"every": 1},
           "calibration": {"tokens": 8192}}
    convert(build(ConvertConfig, cfg), folder, overwrite=True, progress=False)
    if case.get("digits"):
        spec = json.loads((folder / "tokenizer.json").read_text())
        spec["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": True}, spec["pre_tokenizer"]]}
        (folder / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False))


def case_folder(work: Path, name: str, case: dict) -> Path:
    return work / name.split(" ")[0] / case.get("folder", case["method"])


def random_qwen3(folder: Path) -> str:
    """A seeded random Qwen3 (4 blocks, width 256) with the embedded SmolLM2's tokenizer, as a dense folder.
    Its weights are drawn with std 0.1 rather than 0.02, so that its next-token distributions are peaked
    enough for a greedy continuation to mean something."""
    import transformers

    from upcycle.checkpoint.loading import load_tokenizer
    from upcycle.data.assets import default_model_path

    if not (folder / "config.json").is_file():
        tokenizer = load_tokenizer(default_model_path())
        config = transformers.Qwen3Config(vocab_size=len(tokenizer), hidden_size=256, intermediate_size=768,
                                          num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                          head_dim=64, max_position_embeddings=2048, initializer_range=0.1,
                                          tie_word_embeddings=False, rms_norm_eps=1e-6)
        torch.manual_seed(0)
        transformers.Qwen3ForCausalLM(config).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    return str(folder)


def reference(folder: Path) -> list[dict]:
    """What upcycle + transformers give for every prompt: token ids, logits at every position, greedy ids."""
    import upcycle
    from upcycle.checkpoint.loading import load_tokenizer

    model, tokenizer = upcycle.load(folder), load_tokenizer(folder)
    rows = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = tokenizer(prompt)["input_ids"]
            logits = model(input_ids=torch.tensor([ids])).logits[0].float().numpy()
            greedy, seq = [], list(ids)
            for _ in range(NEW_TOKENS):
                token = int(model(input_ids=torch.tensor([seq])).logits[0, -1].argmax())
                greedy.append(token)
                seq.append(token)
            rows.append({"ids": ids, "logits": logits, "greedy": greedy})
    return rows


def compare(ours: list[dict], theirs: dict, work: Path) -> dict:
    """One GGUF file's llama.cpp results against the reference, prompt by prompt."""
    if not theirs["loaded"]:
        return {"loaded": False, "error": theirs["error"]}
    prompts = []
    for mine, got in zip(ours, theirs["prompts"], strict=True):
        logits = np.load(work / got["logits"])
        same = mine["ids"] == got["ids"]
        diff = float(np.abs(logits - mine["logits"]).max()) if same else None
        agree = next((i for i, (a, b) in enumerate(zip(mine["greedy"], got["greedy"], strict=True)) if a != b),
                     NEW_TOKENS)
        prompts.append({"tokens_identical": same, "logits_finite": bool(np.isfinite(logits).all()),
                        "max_abs_logit_diff": diff,
                        "argmax_agree": float((logits.argmax(-1) == mine["logits"].argmax(-1)).mean()) if same
                        else None,
                        "greedy_identical_tokens": agree})
    return {"loaded": True, "metadata": theirs["metadata"], "prompts": prompts,
            "tokenization_identical": all(p["tokens_identical"] for p in prompts),
            "all_finite": all(p["logits_finite"] for p in prompts),
            "greedy_identical": sum(p["greedy_identical_tokens"] == NEW_TOKENS for p in prompts),
            "max_abs_logit_diff": max(p["max_abs_logit_diff"] for p in prompts if p["max_abs_logit_diff"] is not None)
            if any(p["max_abs_logit_diff"] is not None for p in prompts) else None,
            "logit_scale": float(max(np.abs(m["logits"]).max() for m in ours))}


def run_llama_cpp(python: Path, files: dict[str, str], f32_cache: list[str], folder: Path) -> dict:
    """llama.cpp's results for GGUF `files` (case -> path) from benchmarks/interop/llama_cpp_worker.py in the built
    environment; its request, result and logits are written into `folder`."""
    request, result = folder / "request.json", folder / "llama_cpp.json"
    request.write_text(json.dumps({"files": files, "f32_cache": f32_cache, "prompts": PROMPTS,
                                   "new_tokens": NEW_TOKENS, "threads": os.cpu_count() or 2}))
    # -I: the worker sees neither the current directory nor PYTHON* variables (it runs nothing of a user's)
    log = subprocess.run([str(python), "-I", str(ROOT / "benchmarks" / "interop" / "llama_cpp_worker.py"), str(request),
                          str(result)], capture_output=True, text=True)
    if log.returncode:
        raise SystemExit(f"the llama.cpp worker failed:\n{log.stderr[-4000:]}")
    return json.loads(result.read_text())


def check_llama_cpp(work: Path, cache: Path) -> dict:
    from upcycle.export.from_folder import export_folder

    python, sdist = llama_cpp_env(cache)
    facts = ROOT / "benchmarks" / "interop" / "llama_cpp_facts.py"
    subprocess.run([sys.executable, str(facts), str(sdist)], check=True)
    results, files, refs = {}, {}, {}
    for name, case in CASES.items():
        folder = case_folder(work, name, case)
        t = time.perf_counter()
        convert_case(case, folder)
        refs[name] = reference(folder)
        for out_type in case["types"]:
            out = work / "gguf" / f"{folder.parent.name}-{folder.name}-{out_type}"
            export_folder(folder, out, export_class=case["export_class"], format="gguf", gguf_type=out_type,
                          overwrite=True)
            files[f"{name} {out_type}"] = str(out / "model.gguf")
            if out_type == "f32":            # and again with llama.cpp's KV cache in F32 instead of its F16
                files[f"{name} {F32_CACHE}"] = str(out / "model.gguf")
        print(f"{name}: converted, referenced and exported in {time.perf_counter() - t:.0f} s", flush=True)
    ran = run_llama_cpp(python, files, [k for k in files if k.endswith(F32_CACHE)], work)
    for name, case in CASES.items():
        report = json.loads((case_folder(work, name, case) / "upcycle_report.json").read_text())
        # how far the conversion itself is from the dense model (qwen2moe's raw top-k moves it: RAW_TOPK)
        results[name] = {"settings": {"method": case["method"], "num_experts": case.get("experts", 4), "top_k": 2,
                                      "every": 1, "normalize_topk": case.get("normalize_topk", True),
                                      "source": "random Qwen3" if case.get("source") == "qwen3" else "SmolLM2-135M"},
                         "conversion_max_abs_logit_diff_to_dense": report["max_abs_logit_diff"],
                         "conversion_kl_to_dense": report["kl_to_dense"], "files": {}}
    for key, theirs in ran["files"].items():
        name, out_type = key.rsplit(" ", 1)
        results[name]["files"][out_type] = compare(refs[name], theirs, work)
    facts = json.loads((ROOT / "tests" / "fixtures" / "llama_cpp_facts.json").read_text())
    return {"llama_cpp_python": ran["llama_cpp_python"], "llama_cpp_commit": facts["source"]["llama_cpp_commit"],
            "sdist_sha256": facts["source"]["sdist_sha256"], "system_info": ran["system_info"],
            "source_model": "the embedded SmolLM2-135M-Instruct (qwen3moe: a random Qwen3), top-2, every block; "
                            "experts per case in its settings",
            "prompts": PROMPTS, "new_tokens": NEW_TOKENS, "cases": results}


# what llama.cpp's requirements-convert_hf_to_gguf.txt adds to torch, transformers and numpy: its llama-arch
# vocabulary tries SentencePiece first (a missing module is a traceback; a missing tokenizer.model falls back to BPE)
CONVERTER_DEPS = ("sentencepiece==0.2.3",)
# runs the converter with its folder and its own dependencies first on the path; argv: deps, folder, script, args
CONVERTER_LAUNCHER = ("import runpy, sys; deps, folder, script = sys.argv[1:4]; sys.path[:0] = [folder, deps]; "
                      "sys.argv = [script, *sys.argv[4:]]; runpy.run_path(script, run_name='__main__')")


def llama_cpp_converter(sdist: Path, cache: Path) -> Path:
    """llama.cpp's own convert_hf_to_gguf.py (with the gguf-py and conversion packages it imports from beside
    it) from the llama-cpp-python source distribution, unpacked once under the cache, with CONVERTER_DEPS
    installed beside it (in deps/)."""
    import tarfile

    root = cache / "runtimes" / f"llama-cpp-converter-{LLAMA_CPP_PYTHON}"
    script = root / "convert_hf_to_gguf.py"
    if not (root / "conversion" / "__init__.py").is_file():
        prefix = f"llama_cpp_python-{LLAMA_CPP_PYTHON}/vendor/llama.cpp/"
        with tarfile.open(sdist) as tar:
            members = [m for m in tar.getmembers() if m.isfile() and m.name.startswith(prefix)
                       and (m.name == prefix + "convert_hf_to_gguf.py"
                            or m.name.startswith((prefix + "gguf-py/", prefix + "conversion/")))]
            for m in members:
                m.name = m.name[len(prefix):]
            tar.extractall(root, members=members, filter="data")
    stamp = root / "deps" / "upcycle-deps.json"
    if not stamp.is_file() or json.loads(stamp.read_text()) != list(CONVERTER_DEPS):
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--target", str(root / "deps"),
                        *CONVERTER_DEPS], check=True)
        stamp.write_text(json.dumps(list(CONVERTER_DEPS)))
    return script


def check_llama_cpp_converter(work: Path, cache: Path) -> dict:
    """The route docs/runtimes.md gives for tokenizers upcycle's GGUF writer refuses: a stock export through
    llama.cpp's own convert_hf_to_gguf.py, then loaded and run by llama.cpp against the upcycle folder in
    transformers. Three exports: Qwen2-MoE of the copy-upcycled SmolLM2 with raw top-k (as llama.cpp's qwen2moe
    computes); `auto` of the default conversion (renormalized top-k, every block), which picks the class llama.cpp
    reads as transformers does; and that conversion named into Qwen2-MoE, which transformers computes and
    llama.cpp's qwen2moe does not (the export's `runtimes_note` says so; recorded beside each route)."""
    from upcycle.export.from_folder import export_folder

    python, sdist = llama_cpp_env(cache)
    script = llama_cpp_converter(sdist, cache)
    routes = {}
    for label, name, export_class in (("qwen2_moe of the raw top-k copy", "qwen2moe (copy, raw top-k)", "qwen2_moe"),
                                      ("auto of the default copy", "llama (mixtral, copy)", "auto"),
                                      ("qwen2_moe of the default copy", "llama (mixtral, copy)", "qwen2_moe")):
        case = CASES[name]
        folder = case_folder(work, name, case)
        convert_case(case, folder)
        tag = f"{name.split(' ')[0]}-{export_class}"
        stock, gguf_file = work / "converter" / f"{tag}-stock", work / "converter" / f"{tag}-f32.gguf"
        entry = export_folder(folder, stock, export_class=export_class, format="hf", overwrite=True)
        gguf_file.parent.mkdir(parents=True, exist_ok=True)
        # -E -s, run in its own folder: the converter sees neither the user's current directory nor PYTHON*
        # variables nor user site-packages, and imports its own packages from its folder and deps/
        done = subprocess.run([sys.executable, "-E", "-s", "-c", CONVERTER_LAUNCHER, str(script.parent / "deps"),
                                str(script.parent), str(script), str(stock), "--outfile", str(gguf_file),
                                "--outtype", "f32"], capture_output=True, text=True, cwd=script.parent)
        if done.returncode:
            routes[label] = {"case": name, "converter_exit": done.returncode, "converter_error": done.stderr[-2000:]}
            continue
        ran = run_llama_cpp(python, {f"{name} converter-f32": str(gguf_file)}, [], gguf_file.parent)
        routes[label] = {
            "case": name, "export_class_written": entry["class"],
            "route": f"upcycle export --export-class {export_class} (hf), then llama.cpp's convert_hf_to_gguf.py "
                     f"--outtype f32",
            "runtimes_note": entry.get("runtimes_note"), "llama_cpp_python": ran["llama_cpp_python"],
            "converter_exit": 0,
            "stock_config_tie_word_embeddings": json.loads((stock / "config.json").read_text())["tie_word_embeddings"],
            "file": compare(reference(folder), ran["files"][f"{name} converter-f32"], gguf_file.parent)}
    return {"routes": routes}


def check_onnx(work: Path) -> dict:
    """docs/runtimes.md's ONNX recipe on a stock Qwen3-MoE export of the SmolLM2 copy conversion."""
    import onnxruntime
    import transformers

    from upcycle.export.from_folder import export_folder

    name = "qwen3moe (copy, random Qwen3)"
    folder = case_folder(work, name, CASES[name])
    convert_case(CASES[name], folder)
    stock = work / "stock-qwen3moe"
    export_folder(folder, stock, export_class="qwen3_moe", overwrite=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(stock, experts_implementation="batched_mm").eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(stock)

    class Logits(torch.nn.Module):            # docs/runtimes.md's recipe: ids and mask in, logits out
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask):
            return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits

    ids = torch.ones(1, 8, dtype=torch.long)
    dims = {0: "batch", 1: "sequence"}
    onnx_file = work / "model.onnx"
    torch.onnx.export(Logits(model), (ids, torch.ones_like(ids)), str(onnx_file),
                      input_names=["input_ids", "attention_mask"], output_names=["logits"],
                      dynamic_axes={"input_ids": dims, "attention_mask": dims, "logits": dims}, dynamo=False)
    session = onnxruntime.InferenceSession(str(onnx_file), providers=["CPUExecutionProvider"])
    diffs = []
    with torch.no_grad():
        for prompt in PROMPTS:
            enc = tokenizer(prompt, return_tensors="pt")
            got = session.run(["logits"], {"input_ids": enc["input_ids"].numpy(),
                                           "attention_mask": enc["attention_mask"].numpy()})[0]
            diffs.append(float(np.abs(got - model(**enc).logits.numpy()).max()))
    return {"onnxruntime": onnxruntime.__version__, "export": "Qwen3MoeForCausalLM, experts_implementation "
            "batched_mm, torch.onnx.export (TorchScript exporter)", "max_abs_logit_diff": max(diffs),
            "prompts": len(PROMPTS)}


def check_sentence_transformers(work: Path) -> dict:
    from sentence_transformers import SentenceTransformer, __version__

    from upcycle.config import CheckConfig, ConvertConfig, MoEConfig
    from upcycle.conversion.pipeline import convert
    from upcycle.data.assets import minilm_path

    folder = work / "minilm-copy"
    convert(ConvertConfig(model="minilm", method="copy", moe=MoEConfig(num_experts=4, top_k=2),
                          check=CheckConfig(tokens=32)), folder, overwrite=True, progress=False)
    dense_model = SentenceTransformer(str(minilm_path()), device="cpu")
    dense = dense_model.encode(PROMPTS)
    moe_model = SentenceTransformer(str(folder), device="cpu")
    moe = moe_model.encode(PROMPTS)
    # a folder this sentence-transformers saved itself (its own module names), converted the same way
    saved, saved_moe = work / "minilm-saved-by-st", work / "minilm-saved-by-st-copy"
    dense_model.save(str(saved))
    convert(ConvertConfig(model=str(saved), method="copy", moe=MoEConfig(num_experts=4, top_k=2),
                          check=CheckConfig(tokens=32)), saved_moe, overwrite=True, progress=False)
    from_saved = SentenceTransformer(str(saved_moe), device="cpu")
    from_saved_embeddings = from_saved.encode(PROMPTS)
    return {"sentence_transformers": __version__, "modules": [type(m).__name__ for m in moe_model],
            "max_abs_embedding_diff": float(np.abs(dense - moe).max()),
            "norms": [float(x) for x in np.linalg.norm(moe, axis=1)],
            "saved_by_sentence_transformers": {
                "module_types": [m["type"] for m in json.loads((saved / "modules.json").read_text())],
                "modules_after_conversion": [type(m).__name__ for m in from_saved],
                "max_abs_embedding_diff": float(np.abs(dense - from_saved_embeddings).max()),
                "norms": [float(x) for x in np.linalg.norm(from_saved_embeddings, axis=1)]}}


def check_torchtitan(work: Path) -> dict:
    """benchmarks/interop/torchtitan_check.py, which builds its own environment under the upcycle cache."""
    log = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "interop" / "torchtitan_check.py"), "--work",
                          str(work / "torchtitan"), "--json", str(work / "torchtitan.json")],
                         capture_output=True, text=True)
    if log.returncode:
        return {"ran": False, "why": log.stderr.strip().splitlines()[-1] if log.stderr.strip() else "failed"}
    return json.loads((work / "torchtitan.json").read_text())


LM_EVAL = "0.4.13"
# a local multiple-choice task (no hub): lm-eval scores each choice by the log-likelihood of " choice"
LM_EVAL_ITEMS = [("The capital of France is", ["Paris", "Rome", "Berlin", "Madrid"], 0),
                 ("Bees make", ["honey", "steel", "glass", "paper"], 0),
                 ("Two plus two equals", ["four", "five", "three", "six"], 0),
                 ("The opposite of hot is", ["cold", "warm", "red", "fast"], 0),
                 ("Water freezes at zero degrees", ["Celsius", "Kelvin", "Fahrenheit", "Rankine"], 0),
                 ("def add(a, b):\n    return", ["a + b", "a - b", "a * b", "None"], 0)]
LM_EVAL_TASK = """task: upcycle_local
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""


# lm-eval from Python after `import upcycle` (docs/runtimes.md), on the upcycle folder itself: argv is upcycle's
# src/, the folder, the task folder; prints each item's choices' log-likelihoods and the accuracy as JSON
LM_EVAL_FROM_PYTHON = """
import json, sys
sys.path.insert(0, sys.argv[1])
import upcycle  # noqa: F401  (registers upcycle folders with transformers' Auto classes)
import lm_eval
from lm_eval.tasks import TaskManager

results = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={sys.argv[2]},dtype=float32",
                                  tasks=["upcycle_local"], task_manager=TaskManager(include_path=sys.argv[3]),
                                  device="cpu", batch_size=1, log_samples=True)
samples = sorted(results["samples"]["upcycle_local"], key=lambda s: s["doc_id"])
print(json.dumps({"acc": results["results"]["upcycle_local"]["acc,none"],
                  "loglikelihoods": [[float(r[0][0]) for r in s["resps"]] for s in samples]}))
"""


def lm_eval_env(cache: Path) -> Path:
    venv = cache / "runtimes" / f"lm-eval-{LM_EVAL}"
    stamp = venv / "upcycle-built.json"
    if not stamp.is_file():
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
        pip = [str(venv / "bin" / "pip"), "install", "-q"]
        subprocess.run([*pip, "torch==2.13.0"], check=True)           # the CPU build, before anything pulls CUDA
        subprocess.run([*pip, f"lm-eval=={LM_EVAL}", f"transformers=={transformers_version()}", "accelerate"],
                       check=True)                            # accelerate: lm-eval's `hf` model imports it
        stamp.write_text(json.dumps({"lm_eval": LM_EVAL}))
    return venv / "bin" / "python"


def transformers_version() -> str:
    import transformers

    return transformers.__version__


def continuation_loglikelihood(model, tokenizer, context: str, continuation: str) -> float:
    """log p(continuation | context) as lm-eval's `hf` model computes it: the pair encoded whole and split at
    the context's length, no special tokens, summed over the continuation's tokens."""
    whole = tokenizer(context + continuation, add_special_tokens=False)["input_ids"]
    n = len(tokenizer(context, add_special_tokens=False)["input_ids"])
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([whole[:-1]])).logits[0].double().log_softmax(-1)
    return float(sum(logits[i - 1, whole[i]] for i in range(n, len(whole))))


def check_lm_eval(work: Path, cache: Path) -> dict:
    """lm-eval's `hf` model on a stock Mixtral export of the SmolLM2 copy conversion, with a local task; every
    choice's log-likelihood against upcycle.load's."""
    import upcycle
    from upcycle.checkpoint.loading import load_tokenizer
    from upcycle.export.from_folder import export_folder

    python = lm_eval_env(cache)
    case = CASES["llama (mixtral, copy)"]
    folder = case_folder(work, "llama (mixtral, copy)", case)
    convert_case(case, folder)
    stock = work / "stock-mixtral"
    export_folder(folder, stock, export_class="mixtral", overwrite=True)
    task_dir = work / "lm-eval-task"
    task_dir.mkdir(exist_ok=True)
    data = task_dir / "items.jsonl"
    data.write_text("".join(json.dumps({"context": c, "choices": ch, "answer": a}) + "\n"
                            for c, ch, a in LM_EVAL_ITEMS))
    (task_dir / "upcycle_local.yaml").write_text(LM_EVAL_TASK.format(data=data))
    out = work / "lm-eval-out"
    if out.exists():
        shutil.rmtree(out)                   # a previous run's samples (our own work folder)
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    ran = subprocess.run([str(python), "-I", "-m", "lm_eval", "--model", "hf", "--model_args",
                          f"pretrained={stock},dtype=float32", "--tasks", "upcycle_local", "--include_path",
                          str(task_dir), "--device", "cpu", "--batch_size", "1", "--log_samples", "--output_path",
                          str(out)], capture_output=True, text=True, env=env, cwd=work)
    if ran.returncode:
        raise SystemExit(f"lm-eval failed:\n{ran.stderr[-3000:]}")
    samples = [json.loads(line) for f in sorted(out.rglob("samples_upcycle_local_*.jsonl"))
               for line in f.read_text().splitlines()]
    model, tokenizer = upcycle.load(folder), load_tokenizer(folder)
    diffs, agree = [], 0
    for sample in samples:
        context, choices, _ = LM_EVAL_ITEMS[sample["doc_id"]]
        theirs = [float(r[0][0]) for r in sample["resps"]]
        ours = [continuation_loglikelihood(model, tokenizer, context, " " + c) for c in choices]
        diffs.append(max(abs(a - b) for a, b in zip(theirs, ours, strict=True)))
        agree += int(np.argmax(theirs) == np.argmax(ours))
    results = json.loads(next(out.rglob("results_*.json")).read_text())
    # the upcycle folder itself, through lm-eval's Python API after `import upcycle`
    script = work / "lm_eval_from_python.py"
    script.write_text(LM_EVAL_FROM_PYTHON)
    ran = subprocess.run([str(python), "-I", str(script), str(ROOT / "src"), str(folder), str(task_dir)],
                         capture_output=True, text=True, env=env, cwd=work)
    if ran.returncode:
        raise SystemExit(f"lm-eval from Python on the upcycle folder failed:\n{ran.stderr[-3000:]}")
    direct = json.loads(ran.stdout.strip().splitlines()[-1])
    direct_diffs = [abs(a - continuation_loglikelihood(model, tokenizer, LM_EVAL_ITEMS[i][0], " " + c))
                    for i, theirs in enumerate(direct["loglikelihoods"])
                    for a, c in zip(theirs, LM_EVAL_ITEMS[i][1], strict=True)]
    return {"lm_eval": LM_EVAL, "model": "hf (MixtralForCausalLM stock export, float32)",
            "items": len(samples), "choices": sum(len(i[1]) for i in LM_EVAL_ITEMS),
            "max_abs_loglikelihood_diff": max(diffs), "same_choice": agree,
            "acc": results["results"]["upcycle_local"]["acc,none"],
            "upcycle_folder_from_python": {"call": "import upcycle; lm_eval.simple_evaluate(model='hf', "
                                                   "model_args='pretrained=FOLDER,dtype=float32', ...)",
                                           "max_abs_loglikelihood_diff": max(direct_diffs), "acc": direct["acc"]}}


PARTS = {"llama.cpp": check_llama_cpp, "llama.cpp-converter": check_llama_cpp_converter, "onnx": check_onnx,
         "sentence-transformers": check_sentence_transformers,
         "lm-eval": check_lm_eval, "torchtitan": check_torchtitan}
NOT_RUN = {"vLLM": "not run: it needs an environment of its own (it pins torch and transformers) and a GPU"}


def docs_table(data: dict) -> str:
    """docs/runtimes.md's table of llama.cpp results, from the JSON: the settings every row was made with, one row
    per file (its case's expert count, the next-token argmax agreement over the prompts' positions), and per type
    the range over every row, which is what the prose may claim."""
    llama = data["parts"].get("llama.cpp", {})
    cases = llama.get("cases", {})
    prompts, new_tokens = len(llama.get("prompts", [])), llama.get("new_tokens")
    lines = [f"Made with llama-cpp-python {llama.get('llama_cpp_python')} (llama.cpp {llama.get('llama_cpp_commit')}),"
             f" {llama.get('date')}: top-2 routing on every block, {prompts} prompts, {new_tokens} greedy tokens; "
             f"each row's expert count is its own. Another model (another expert count, another source) gives other"
             f" figures.", "",
             "| GGUF file (arch, conversion) | experts | type | loads | tokens identical | greedy 20 identical | "
             "argmax agree (min-max over prompts) | max logit diff (logits up to) | finite |",
             "|---|---|---|---|---|---|---|---|---|"]
    ranges: dict[str, list[dict]] = {}
    for name, case in cases.items():
        experts = case.get("settings", {}).get("num_experts", 4)
        for out_type, r in case["files"].items():
            if not r["loaded"]:
                lines.append(f"| {name} | {experts} | {out_type} | no: {r['error']} | | | | | |")
                continue
            n = len(r["prompts"])
            agree = [p["argmax_agree"] for p in r["prompts"]]
            ranges.setdefault(out_type, []).append({"greedy": r["greedy_identical"], "n": n, "agree": agree,
                                                     "diff": r["max_abs_logit_diff"]})
            label = "f32, K/V cache F32" if out_type == F32_CACHE else out_type
            lines.append(f"| {name} | {experts} | {label} | yes | {'yes' if r['tokenization_identical'] else 'NO'} | "
                         f"{r['greedy_identical']}/{n} prompts | {min(agree):.0%}-{max(agree):.0%} | "
                         f"{r['max_abs_logit_diff']:.2g} ({r['logit_scale']:.0f}) | "
                         f"{'yes' if r['all_finite'] else 'NO'} |")
    lines += ["", "Per type, over every row above:", "",
              "| type | rows | greedy 20 identical | argmax agree | max logit diff |", "|---|---|---|---|---|"]
    for out_type, rows in ranges.items():
        label = "f32, K/V cache F32" if out_type == F32_CACHE else out_type
        greedy = [r["greedy"] for r in rows]
        agree = [a for r in rows for a in r["agree"]]
        diff = [r["diff"] for r in rows]
        lines.append(f"| {label} | {len(rows)} | {min(greedy)} to {max(greedy)} of {rows[0]['n']} | "
                     f"{min(agree):.0%} to {max(agree):.0%} | {min(diff):.2g} to {max(diff):.2g} |")
    return "\n".join(lines)


BEGIN, END = "<!-- runtimes table: benchmarks/interop/runtimes_check.py --docs -->", "<!-- end of runtimes table -->"


def write_docs(data: dict) -> None:
    text = DOCS.read_text()
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    DOCS.write_text(f"{head}{BEGIN}\n{docs_table(data)}\n{END}{tail}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default=",".join(PARTS), help=f"comma-separated parts of {list(PARTS)}")
    parser.add_argument("--work", type=output_folder, default=ROOT / "out" / "runtimes-check")
    parser.add_argument("--out", type=output_file, default=RESULTS)
    parser.add_argument("--docs", action="store_true", help="only regenerate docs/runtimes.md's table")
    args = parser.parse_args()
    unknown = [part for part in args.only.split(",") if part not in PARTS]
    if unknown:
        parser.error(f"--only takes parts of {list(PARTS)}, got {', '.join(map(repr, unknown))}")
    if args.docs:
        write_docs(json.loads(args.out.read_text()))
        return
    from upcycle.data.text import cache_dir

    os.environ["HF_HUB_OFFLINE"] = "1"
    args.work.mkdir(parents=True, exist_ok=True)
    data = json.loads(args.out.read_text()) if args.out.is_file() else {"parts": {}}
    data.update({"machine": machine(), "versions": versions(), "not_run": NOT_RUN})
    for part in args.only.split(","):
        t = time.perf_counter()
        kwargs = {"cache": cache_dir()} if part in ("llama.cpp", "llama.cpp-converter", "lm-eval") else {}
        data["parts"][part] = {**PARTS[part](args.work, **kwargs), "seconds": round(time.perf_counter() - t)}
        data["parts"][part]["date"] = time.strftime("%Y-%m-%d")
        print(f"{part}: done in {data['parts'][part]['seconds']} s", flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(data, indent=1) + "\n")       # after each part: a later failure keeps it
    if args.out == RESULTS:                  # the docs quote the committed results, not a trial elsewhere
        write_docs(data)


if __name__ == "__main__":
    main()
