"""The runtime check's committed results and the tools behind them: docs/runtimes.md's table is generated from
benchmarks/results/runtimes/runtimes.json (never edited by hand), the results say llama.cpp loaded every arch
upcycle writes with finite logits, they came from the same llama.cpp as the fast guard's facts, and the facts
reader parses llama.cpp's source as it is written."""

from __future__ import annotations

import importlib
import io
import json
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results" / "runtimes" / "runtimes.json"
FACTS = json.loads((ROOT / "tests" / "fixtures" / "llama_cpp_facts.json").read_text())


def bench(name: str):
    sys.path.insert(0, str(ROOT / "benchmarks" / "interop"))
    return importlib.import_module(name)


def test_the_docs_table_is_the_committed_results():
    check = bench("runtimes_check")
    docs = (ROOT / "docs" / "runtimes.md").read_text()
    table = docs.split(check.BEGIN, 1)[1].split(check.END, 1)[0].strip()
    assert table == check.docs_table(json.loads(RESULTS.read_text()))


def test_llama_cpp_ran_every_type_of_every_arch_and_pre_tokenizer_upcycle_writes():
    from upcycle.export.gguf import ARCHS, FILE_TYPES
    from upcycle.export.gguf_vocab import PRE_TOKENIZERS

    check = bench("runtimes_check")
    llama = json.loads(RESULTS.read_text())["parts"]["llama.cpp"]
    assert (llama["llama_cpp_commit"], llama["sdist_sha256"]) == (FACTS["source"]["llama_cpp_commit"],
                                                                  FACTS["source"]["sdist_sha256"])
    seen, seen_pre = set(), set()
    for case in llama["cases"].values():
        for out_type, result in case["files"].items():
            assert result["loaded"] and result["all_finite"] and result["tokenization_identical"], out_type
            seen.add((result["metadata"]["general.architecture"], out_type))
            seen_pre.add(result["metadata"]["tokenizer.ggml.pre"])
            if out_type in ("f32", "f16", check.F32_CACHE):   # the same model computed
                assert result["greedy_identical"] >= len(result["prompts"]) - 1
            if out_type == "bf16":
                # the same model rounded to 8 bits of mantissa: logits within 5 % of their scale (measured up to
                # 4.998 %, the 8-expert qwen2moe) and the prompts' next-token argmax agreeing at 80 % of positions
                # or more (measured 80 % at the least, the same); a 20-token greedy continuation may take the
                # other side of a near-tie (the random Qwen3's: 3 of 5 identical)
                assert result["max_abs_logit_diff"] <= 0.05 * result["logit_scale"]
                assert min(p["argmax_agree"] for p in result["prompts"]) >= 0.8
    # every type the writer offers, for every arch it writes (docs/runtimes.md's table shows each)
    assert {pair for pair in seen if pair[1] != check.F32_CACHE} == {(arch, t) for arch in set(ARCHS.values())
                                                                      for t in FILE_TYPES}
    assert seen_pre == set(PRE_TOKENIZERS.values())          # each pre-tokenizer name upcycle writes, in llama.cpp


def test_llama_cpps_own_converter_route_computes_what_the_export_says():
    """The route docs/runtimes.md gives for tokenizers upcycle's GGUF writer refuses: a stock export through
    llama.cpp's convert_hf_to_gguf.py (the committed run). The Qwen2-MoE export of the raw top-k conversion (tied
    embeddings, exported untied) and the `auto` export of the default conversion (Mixtral) load and compute in
    llama.cpp as the upcycle folder does in transformers (the bound: the f32 file of upcycle's own writer with
    llama.cpp's F16 KV cache, 0.070 on logits of scale 33, with 50 % margin), with no note; the default conversion
    named into Qwen2-MoE is what llama.cpp computes otherwise, and its export said so."""
    routes = json.loads(RESULTS.read_text())["parts"]["llama.cpp-converter"]["routes"]
    for label, arch, written in (("qwen2_moe of the raw top-k copy", "qwen2moe", "Qwen2MoeForCausalLM"),
                                 ("auto of the default copy", "llama", "MixtralForCausalLM"),
                                 ("qwen2_moe of the default copy", "qwen2moe", "Qwen2MoeForCausalLM")):
        route = routes[label]
        result = route["file"]
        assert route["converter_exit"] == 0 and route["export_class_written"] == written, label
        assert result["loaded"] and result["all_finite"] and result["tokenization_identical"], label
        assert result["metadata"]["general.architecture"] == arch, label
        if label == "qwen2_moe of the default copy":
            assert "llama.cpp's qwen2moe uses top-k weights raw" in route["runtimes_note"]
            assert result["greedy_identical"] < len(result["prompts"]) and result["max_abs_logit_diff"] > 1
        else:
            assert route["runtimes_note"] is None, label
            assert result["greedy_identical"] == len(result["prompts"]) and result["max_abs_logit_diff"] < 0.105
    assert routes["qwen2_moe of the raw top-k copy"]["stock_config_tie_word_embeddings"] is False


def test_the_facts_reader_parses_llama_cpps_source(tmp_path, monkeypatch):
    """A miniature of llama.cpp's files in a source distribution: the names with their pre-tokenizer types, the
    regexes of a case group, the archs, norm_w and the shared gate's expression."""
    facts = bench("llama_cpp_facts")
    vocab = '''
        } else if (
                tokenizer_pre == "gpt-2"   ||
                tokenizer_pre == "phi-2") {
            pre_type = LLAMA_VOCAB_PRE_TYPE_GPT2;
        } else if (
            tokenizer_pre == "smollm") {
            pre_type = LLAMA_VOCAB_PRE_TYPE_SMOLLM;
            clean_spaces = false;
        switch (vocab.get_pre_type()) {
            case LLAMA_VOCAB_PRE_TYPE_SMOLLM:
            case LLAMA_VOCAB_PRE_TYPE_CODESHELL:
                regex_exprs = {
                    "\\\\p{N}",
                    "'s|'t| ?\\\\p{L}+",
                };
                break;
    '''
    files = {"CHANGELOG.md": "## [9.9.9]\n- feat: update llama.cpp to ggml-org/llama.cpp@abc1234\n## [9.9.8]\n",
             "vendor/llama.cpp/src/llama-vocab.cpp": vocab,
             "vendor/llama.cpp/src/llama-arch.cpp": '{ LLM_ARCH_LLAMA, "llama" },\n{ LLM_ARCH_QWEN2MOE, "qwen2moe" },',
             "vendor/llama.cpp/src/models/llama.cpp": "build_moe_ffn(cur, a,\n  LLM_FFN_SILU, true,\n  il);",
             "vendor/llama.cpp/src/models/qwen2moe.cpp": "build_moe_ffn(cur,\n LLM_FFN_SILU, false, x);\n"
             "ggml_tensor * cur_gate = ggml_div(ctx0, ggml_silu(ctx0, cur_gate_inp), cur_gate_inp);",
             "vendor/llama.cpp/src/models/qwen3moe.cpp": "build_moe_ffn(cur, LLM_FFN_SILU, true, x);"}
    sdist = tmp_path / "llama_cpp_python-9.9.9.tar.gz"
    with tarfile.open(sdist, "w:gz") as archive:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"llama_cpp_python-9.9.9/{name}")
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    out = tmp_path / "facts.json"
    monkeypatch.setattr(sys, "argv", ["llama_cpp_facts.py", str(sdist), "--out", str(out)])
    facts.main()
    got = json.loads(out.read_text())
    assert got["pre_tokenizers"] == {"gpt-2": "GPT2", "phi-2": "GPT2", "smollm": "SMOLLM"}
    assert got["pre_type_regexes"] == {"SMOLLM": ["\\p{N}", "'s|'t| ?\\p{L}+"],
                                       "CODESHELL": ["\\p{N}", "'s|'t| ?\\p{L}+"]}
    assert got["archs"] == ["llama", "qwen2moe"]
    assert got["moe_renormalizes"] == {"llama": True, "qwen2moe": False, "qwen3moe": True}
    assert got["shared_expert_gate"] == {"qwen2moe": "silu(z)/z"}
    assert got["source"]["version"] == "9.9.9" and got["source"]["llama_cpp_commit"] == "abc1234"


def test_the_other_clients_agree_with_upcycle():
    """ONNX Runtime, sentence-transformers, lm-eval and torchtitan, as the committed results recorded them; the
    bounds are the ones the docs state (docs/runtimes.md, docs/large-models.md)."""
    parts = json.loads(RESULTS.read_text())["parts"]
    assert parts["onnx"]["max_abs_logit_diff"] < 1e-4
    st = parts["sentence-transformers"]
    assert st["max_abs_embedding_diff"] < 1e-5 and st["modules"] == ["Transformer", "Pooling", "Normalize"]
    lm = parts["lm-eval"]
    assert lm["items"] == lm["same_choice"] and lm["max_abs_loglikelihood_diff"] < 1e-3
    titan = parts["torchtitan"]
    assert titan["ran"] and titan["round_trip_identical"]
    assert titan["experts_float32"]["max_abs_logit_diff_vs_transformers"] < 1e-4


def test_the_prose_under_the_llama_cpp_table_claims_what_every_committed_row_shows():
    """docs/runtimes.md's "What this shows" states bounds for every row of the committed run (round 6 found its
    claims held for 4 experts and not for 8): each bound the prose gives is checked here against every row, and
    the prose is checked to still give it."""
    docs = (ROOT / "docs" / "runtimes.md").read_text()
    llama = json.loads(RESULTS.read_text())["parts"]["llama.cpp"]
    rows = [(case.get("settings", {}), t, r) for case in llama["cases"].values() for t, r in case["files"].items()]
    assert {s["num_experts"] for s, _, _ in rows} == {4, 8}          # the table states both, row by row

    def of(kind: str) -> list[dict]:
        return [r for _, t, r in rows if t == kind]

    claims = {
        "F32 is the model to 4e-4 once llama.cpp's cache is F32":
            all(r["max_abs_logit_diff"] <= 4e-4 and r["greedy_identical"] == len(r["prompts"])
                for r in of("f32+f32-kv-cache")),
        "moves F32 files' logits by up to 0.14": max(r["max_abs_logit_diff"] for r in of("f32")) <= 0.14,
        "at most one prompt of five continues differently in F16":
            all(r["greedy_identical"] >= len(r["prompts"]) - 1 for r in of("f16")),
        "most two in BF16": all(r["greedy_identical"] >= len(r["prompts"]) - 2 for r in of("bf16")),
        "argmax agrees at 80 % of positions or more":
            all(p["argmax_agree"] >= 0.8 for r in of("bf16") for p in r["prompts"]),
        "logits move by at most\n  5 % of their scale":
            all(r["max_abs_logit_diff"] <= 0.05 * r["logit_scale"] for r in of("bf16")),
        "Q8_0 keeps at most 3 of 5 continuations": max(r["greedy_identical"] for r in of("q8_0")) <= 3,
        "moves logits by up to 6.1": max(r["max_abs_logit_diff"] for r in of("q8_0")) <= 6.1,
        "keeps at most 2, moves logits by up to\n  33": max(r["greedy_identical"] for r in of("q4_0")) <= 2
            and max(r["max_abs_logit_diff"] for r in of("q4_0")) <= 33,
        "falls to 0 % on one prompt": min(p["argmax_agree"] for r in of("q4_0") for p in r["prompts"]) == 0,
    }
    for claim, holds in claims.items():
        assert claim in docs, claim
        assert holds, claim
