"""What llama.cpp itself accepts and computes, read from its source, for the GGUF export's fast guard.

    python benchmarks/interop/llama_cpp_facts.py SDIST [--out tests/fixtures/llama_cpp_facts.json]

SDIST is llama-cpp-python's source distribution (`pip download --no-deps --no-binary :all:
llama-cpp-python==VERSION`), the one `benchmarks/interop/runtimes_check.py` builds and runs. The script reads, from the
llama.cpp it vendors, without unpacking or building anything:

- the `tokenizer.ggml.pre` names llama.cpp knows, each with its pre-tokenizer type, and each type's regexes
  (src/llama-vocab.cpp; an unknown name is refused when the file loads);
- the arch names (src/llama-arch.cpp);
- whether each MoE arch upcycle writes renormalizes its top-k weights (the `norm_w` argument of `build_moe_ffn`
  in src/models/ARCH.cpp);
- how qwen2moe computes its shared expert's gate (src/models/qwen2moe.cpp).

The JSON records the package version, the llama.cpp commit its changelog names, the archive's SHA-256 and the file
each fact came from. tests/commands/test_export_gguf.py checks what upcycle writes against it on every run, without
llama.cpp; the runtime check is what runs llama.cpp itself.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import tarfile
from pathlib import Path

from upcycle.scripts import output_file

ARCHS = ("llama", "qwen2moe", "qwen3moe")           # the archs upcycle writes (src/upcycle/export/gguf.py)
OUT = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "llama_cpp_facts.json"


def read_member(archive: tarfile.TarFile, root: str, path: str) -> str:
    member = archive.extractfile(f"{root}/{path}")
    if member is None:
        raise SystemExit(f"{path} is not a file in the archive")
    return member.read().decode("utf-8")


def pre_tokenizer_names(vocab_cpp: str) -> dict[str, str]:
    """`tokenizer_pre == "NAME"` conditions, each with the LLAMA_VOCAB_PRE_TYPE_* its branch assigns."""
    names: dict[str, str] = {}
    pending: list[str] = []
    for line in vocab_cpp.splitlines():
        pending += re.findall(r'tokenizer_pre\s*==\s*"([^"]+)"', line)
        assigned = re.search(r"pre_type\s*=\s*LLAMA_VOCAB_PRE_TYPE_(\w+)", line)
        if assigned and pending:
            names.update({name: assigned.group(1) for name in pending})
            pending = []
    return names


def pre_type_regexes(vocab_cpp: str) -> dict[str, list[str]]:
    """Each pre-tokenizer type's regex list: the `case LLAMA_VOCAB_PRE_TYPE_*:` labels of a group, then its
    `regex_exprs = { ... };` (C string literals, unescaped here)."""
    out: dict[str, list[str]] = {}
    for block in re.finditer(r"((?:\s*case LLAMA_VOCAB_PRE_TYPE_\w+:)+)\s*regex_exprs\s*=\s*\{(.*?)\};",
                             vocab_cpp, re.S):
        labels = re.findall(r"LLAMA_VOCAB_PRE_TYPE_(\w+)", block.group(1))
        literals = [json.loads(f'"{s}"') for s in re.findall(r'"((?:[^"\\]|\\.)*)"', block.group(2))]
        out.update({label: literals for label in labels})
    return out


def moe_renormalizes(model_cpp: str) -> bool:
    """The `norm_w` argument of the arch's `build_moe_ffn` call (the boolean after the activation)."""
    found = re.findall(r"build_moe_ffn\(.*?LLM_FFN_\w+,\s*(true|false)", model_cpp, re.S)
    if len(found) != 1:
        raise SystemExit(f"expected one build_moe_ffn call with a literal norm_w, found {found}")
    return found[0] == "true"


def shared_gate(qwen2moe_cpp: str) -> str:
    """qwen2moe's shared-expert gate, as the expression that makes `cur_gate` from `cur_gate_inp` (z)."""
    line = re.search(r"cur_gate\s*=\s*(.*?);", qwen2moe_cpp)
    if line is None:
        raise SystemExit("no `cur_gate = ...;` in qwen2moe.cpp")
    expr = re.sub(r"\s+", "", line.group(1))
    known = {"ggml_div(ctx0,ggml_silu(ctx0,cur_gate_inp),cur_gate_inp)": "silu(z)/z",
             "ggml_sigmoid(ctx0,cur_gate_inp)": "sigmoid(z)"}
    return known.get(expr, expr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sdist", type=Path, help="llama_cpp_python-VERSION.tar.gz")
    parser.add_argument("--out", type=output_file, default=OUT)
    args = parser.parse_args()
    digest = hashlib.sha256(args.sdist.read_bytes()).hexdigest()
    with tarfile.open(args.sdist) as archive:
        root = archive.getnames()[0].split("/")[0]                       # llama_cpp_python-VERSION
        version = root.rsplit("-", 1)[1]
        changelog = read_member(archive, root, "CHANGELOG.md")
        section = changelog.split(f"## [{version}]", 1)[1].split("\n## [", 1)[0]
        commit = re.search(r"llama\.cpp@([0-9a-f]+)", section)
        llama = "vendor/llama.cpp"
        vocab = read_member(archive, root, f"{llama}/src/llama-vocab.cpp")
        arch_cpp = read_member(archive, root, f"{llama}/src/llama-arch.cpp")
        models = {arch: read_member(archive, root, f"{llama}/src/models/{arch}.cpp") for arch in ARCHS}
    facts = {
        "source": {"package": "llama-cpp-python", "version": version, "sdist_sha256": digest,
                   "llama_cpp_commit": commit.group(1) if commit else None,
                   "files": {"pre_tokenizers": f"{llama}/src/llama-vocab.cpp",
                             "archs": f"{llama}/src/llama-arch.cpp",
                             "moe_renormalizes": f"{llama}/src/models/ARCH.cpp",
                             "shared_expert_gate": f"{llama}/src/models/qwen2moe.cpp"}},
        "pre_tokenizers": dict(sorted(pre_tokenizer_names(vocab).items())),
        "pre_type_regexes": dict(sorted(pre_type_regexes(vocab).items())),
        "archs": sorted(set(re.findall(r'\{\s*LLM_ARCH_\w+,\s*"([^"]+)"\s*\}', arch_cpp))),
        "moe_renormalizes": {arch: moe_renormalizes(text) for arch, text in models.items()},
        "shared_expert_gate": {"qwen2moe": shared_gate(models["qwen2moe"])},
    }
    args.out.write_text(json.dumps(facts, indent=1) + "\n")
    print(f"{args.out}: {len(facts['pre_tokenizers'])} pre-tokenizer names, {len(facts['archs'])} archs, "
          f"llama.cpp {facts['source']['llama_cpp_commit']} (llama-cpp-python {version})")


if __name__ == "__main__":
    main()
