"""A Hugging Face fast tokenizer as the GGUF vocabulary llama.cpp reads (`tokenizer.ggml.*`).

Only byte-level BPE tokenizers (llama.cpp's "gpt2" vocabulary model: SmolLM, Llama 3, Qwen and GPT-2 style) are
written, and only when their pre-tokenizer is one whose llama.cpp regexes are known to equal it (PRE_TOKENIZERS):
llama.cpp splits text with its own regexes named by `tokenizer.ggml.pre`, refuses a name it does not know, and
tokenizes differently under a wrong one. The names are llama.cpp's own (`tokenizer_pre == "..."` in its
src/llama-vocab.cpp); tests/fixtures/llama_cpp_facts.json holds them as read from the llama.cpp that
benchmarks/interop/runtimes_check.py runs, and tests/commands/test_export_gguf.py checks these against it.
llama.cpp's convert_hf_to_gguf.py recognises many more tokenizers by hashing their output on a test text; for a
tokenizer refused here, run it on the stock transformers export (docs/runtimes.md).
"""

from __future__ import annotations

from ..errors import UpcycleError
from ..files import parse_json

# HF pre-tokenizer (as the JSON of tokenizer.json, reduced by `_shape`) -> llama.cpp's `tokenizer.ggml.pre`.
# "gpt-2": GPT-2's regex alone; "smollm": every digit split off first, then GPT-2's regex (llama.cpp's
# LLAMA_VOCAB_PRE_TYPE_SMOLLM uses the regexes "\p{N}" and GPT-2's, the HF Digits(individual_digits) + ByteLevel).
PRE_TOKENIZERS = {
    ("ByteLevel",): "gpt-2",
    ("Digits(individual)", "ByteLevel"): "smollm",
}
# gguf.TokenType values (llama.cpp's llama_token_type)
NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5


def _shape(pre: dict | None) -> tuple[str, ...]:
    """The pre-tokenizer as a tuple of step names; a ByteLevel that does not use GPT-2's regex is not ByteLevel."""
    steps = pre.get("pretokenizers", []) if pre and pre.get("type") == "Sequence" else [pre] if pre else []
    out = []
    for step in steps:
        kind = step.get("type")
        if kind == "ByteLevel" and not step.get("use_regex", True):
            kind = "ByteLevel(no regex)"
        elif kind == "ByteLevel" and step.get("add_prefix_space"):
            kind = "ByteLevel(prefix space)"
        elif kind == "Digits":
            kind = "Digits(individual)" if step.get("individual_digits") else "Digits"
        out.append(kind)
    return tuple(out)


def gguf_vocab(tokenizer, vocab_size: int) -> dict:
    """The `tokenizer.ggml.*` values of `tokenizer` for a model with `vocab_size` embedding rows (ids the
    tokenizer lacks are padded with unused tokens, as llama.cpp's converter does), or an UpcycleError."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise UpcycleError("GGUF export needs a fast (tokenizer.json) tokenizer; this one has none")
    spec = parse_json(backend.to_str(), "the tokenizer's definition (tokenizer.json)")
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or (spec.get("decoder") or {}).get("type") != "ByteLevel":
        raise UpcycleError(f"GGUF export writes byte-level BPE tokenizers only (this one is {model.get('type')}); "
                           "run llama.cpp's convert_hf_to_gguf.py on the stock export instead (docs/runtimes.md)")
    shape = _shape(spec.get("pre_tokenizer"))
    if shape not in PRE_TOKENIZERS:
        raise UpcycleError(f"the tokenizer's pre-tokenizer {list(shape)} has no llama.cpp counterpart known to "
                           f"upcycle ({sorted(PRE_TOKENIZERS.values())}); run llama.cpp's convert_hf_to_gguf.py on "
                           "the stock export instead (docs/runtimes.md)")
    vocab = dict(model["vocab"])
    added = {t["content"]: t for t in spec.get("added_tokens", [])}
    for content, token in added.items():
        vocab[content] = token["id"]
    if max(vocab.values()) >= vocab_size:
        raise UpcycleError(f"the tokenizer has ids up to {max(vocab.values())}, beyond the model's {vocab_size} "
                           "embedding rows")
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    types = [UNUSED] * vocab_size
    for content, i in vocab.items():
        tokens[i] = content
        types[i] = (CONTROL if added[content].get("special") else USER_DEFINED) if content in added else NORMAL
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]

    def token_id(name: str) -> int | None:
        token = getattr(tokenizer, name, None)
        return vocab.get(str(token)) if token is not None else None

    bos, eos = token_id("bos_token"), token_id("eos_token")
    # what the tokenizer adds around a text (its post-processor), measured rather than read from flags that
    # transformers 4.x and 5.x keep differently
    ids = tokenizer("a")["input_ids"]
    return {"model": "gpt2", "pre": PRE_TOKENIZERS[shape], "tokens": tokens, "token_type": types, "merges": merges,
            "bos_token_id": bos, "eos_token_id": eos,
            "unknown_token_id": token_id("unk_token"), "padding_token_id": token_id("pad_token"),
            "add_bos_token": bos is not None and ids[:1] == [bos],
            "add_eos_token": eos is not None and len(ids) > 1 and ids[-1:] == [eos],
            "chat_template": tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else None}
