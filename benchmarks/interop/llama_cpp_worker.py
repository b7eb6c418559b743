"""Run GGUF files in llama.cpp (llama-cpp-python) for benchmarks/interop/runtimes_check.py, in its own environment.

    VENV/bin/python -I benchmarks/interop/llama_cpp_worker.py REQUEST.json RESULT.json

REQUEST: {"files": {case: path}, "f32_cache": [case, ...], "prompts": [...], "new_tokens": N, "threads": T}.
For every file and prompt, RESULT holds llama.cpp's token ids (`add_special` as the file's vocabulary says),
its greedy continuation of N tokens, and the path of an .npy file (beside RESULT) with the prompt's logits at
every position. llama.cpp keeps its attention's K and V cache in F16 by default; the cases named in
"f32_cache" keep it in F32. A file that does not load is recorded with llama.cpp's error, and the other files
still run. Needs only llama_cpp and numpy; nothing of upcycle, so it runs in the cached environment that
benchmarks/interop/runtimes_check.py builds.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
from pathlib import Path

import numpy as np


def run_file(path: str, prompts: list[str], new_tokens: int, threads: int, out: Path, case: str,
             f32_cache: bool) -> dict:
    from llama_cpp import GGML_TYPE_F32, Llama

    cache = {"type_k": GGML_TYPE_F32, "type_v": GGML_TYPE_F32} if f32_cache else {}
    log = io.StringIO()
    try:
        # llama.cpp logs to stderr from C: the Python-level redirect catches llama-cpp-python's own messages,
        # and verbose=True keeps the C log on the real stderr, where runtimes_check.py collects it
        with contextlib.redirect_stderr(log):
            llm = Llama(model_path=path, n_ctx=512, n_batch=512, logits_all=True, verbose=True, seed=0,
                        n_threads=threads, n_threads_batch=threads, **cache)
    except Exception as e:        # llama.cpp refused the file: that is the result
        return {"loaded": False, "error": f"{type(e).__name__}: {e}", "log": log.getvalue()[-2000:]}
    rows = []
    for i, prompt in enumerate(prompts):
        ids = llm.tokenize(prompt.encode("utf-8"), add_bos=True, special=False)   # add_special: as the vocab says
        llm.reset()
        llm.eval(ids)
        logits = np.array(llm.scores[:len(ids)], dtype=np.float32)
        greedy = []
        for _ in range(new_tokens):
            token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
            greedy.append(token)
            llm.eval([token])
        name = f"{case}.{i}.npy".replace(" ", "_").replace("/", "_")
        np.save(out.parent / name, logits)
        rows.append({"ids": [int(t) for t in ids], "greedy": greedy, "logits": name})
    meta = {k: v for k, v in llm.metadata.items() if k in ("general.architecture", "tokenizer.ggml.pre",
                                                              "general.file_type")}
    return {"loaded": True, "prompts": rows, "metadata": meta}


def main() -> None:
    request = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    import llama_cpp

    result = {"llama_cpp_python": llama_cpp.__version__, "system_info": llama_cpp.llama_print_system_info().decode(),
              "files": {}}
    for case, path in request["files"].items():
        print(f"llama.cpp: {case}", file=sys.stderr, flush=True)
        result["files"][case] = run_file(path, request["prompts"], request["new_tokens"], request["threads"], out,
                                         case, case in request.get("f32_cache", ()))
    out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    main()
