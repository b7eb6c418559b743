"""sentence-transformers' modules of a source folder, carried into every folder upcycle writes from it.

A sentence-transformers model is a transformers folder plus `modules.json`, the modules applied after the
transformer (all-MiniLM-L6-v2: mean pooling, then L2 normalization), each configured in its own subfolder
(`1_Pooling/config.json`), and `sentence_bert_config.json` (the transformer's maximum length). Without them,
`SentenceTransformer(folder)` falls back to mean pooling alone, and a model trained with normalized embeddings
gives vectors of norm about 5 instead of 1. So `load_tokenizer` reads them with the tokenizer (they describe how
text becomes an embedding, as the tokenizer does) and `save_tokenizer` writes them beside it: a converted folder,
a trained run's `model/`, an export.

Only what cannot run code is carried: the files of sentence-transformers' own module classes, as JSON, text or
safetensors (a Dense projection's weights), never a pickle, a link or another class (whose module sentence-
transformers would import). The transformer module must be the folder itself (`path` ""): upcycle writes that
part. A source whose modules cannot be carried is converted all the same, with a warning that says what is lost.
"""

from __future__ import annotations

import os
import stat
import warnings
from pathlib import Path

from ..files import parse_json
from ..outputs.ownership import LEGACY_SIGNATURES, MARKER, MODEL_FILES, OUTPUT_ENTRIES, SENTENCE_ROOT_FILES

ROOT_FILES = SENTENCE_ROOT_FILES        # named where ownership counts them as a model folder's files
MODULES_FILE = ROOT_FILES[0]            # modules.json
CARRIED_SUFFIXES = (".json", ".txt", ".safetensors")
OWN_CLASSES = "sentence_transformers."
# the transformer module as each sentence-transformers version names it (6.2 saves
# `sentence_transformers.base.modules.transformer.Transformer`): one of its own classes called Transformer
TRANSFORMER_CLASS_NAME = "Transformer"
MAX_BYTES = 256 << 20          # a Dense projection is a few MB; anything near this is not a module's config
MAX_ROOT_FILE_BYTES = 1 << 20  # modules.json and its siblings: a few hundred bytes
MAX_MODULES = 64               # sentence-transformers models chain a handful (Transformer, Pooling, Dense, Normalize)


class NotCarried(ValueError):
    """Why a source's sentence-transformers modules cannot be carried."""


def _regular_file(path: Path) -> bool:
    """A plain file, not a link (or a link's target) and not a device or pipe."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def _module_files(folder: Path, module: dict) -> dict[str, bytes]:
    """The files of one entry of modules.json, by their path relative to the folder."""
    kind, sub = module.get("type"), module.get("path")
    if not isinstance(kind, str) or not kind.startswith(OWN_CLASSES):
        raise NotCarried(f"module {kind!r} is not one of sentence-transformers' own")
    if not isinstance(sub, str):
        raise NotCarried(f"module {kind} has no path")
    if kind.rsplit(".", 1)[-1] == TRANSFORMER_CLASS_NAME:
        if sub != "":
            raise NotCarried(f"its transformer lives in the subfolder {sub!r}, not the folder upcycle writes")
        return {}
    if sub in ("", ".", "..") or "/" in sub or "\\" in sub:
        raise NotCarried(f"module {kind} has the path {sub!r}, not a subfolder's name")
    if sub.startswith(".") or sub in _written_names():
        raise NotCarried(f"module {kind} has the path {sub!r}, the name of a file upcycle writes beside the model")
    directory = folder / sub
    if not directory.exists():                 # Normalize has nothing to store, and some folders omit it
        return {}
    if directory.is_symlink() or not directory.is_dir():
        raise NotCarried(f"{sub} is not a plain folder")
    files = {}
    for entry in sorted(directory.iterdir()):
        if entry.is_symlink():
            raise NotCarried(f"{sub}/{entry.name} is a symbolic link (upcycle never reads through a link)")
        if not _regular_file(entry) or not entry.name.endswith(CARRIED_SUFFIXES):
            raise NotCarried(f"{sub}/{entry.name} is not a JSON, text or safetensors file")
        files[f"{sub}/{entry.name}"] = _read_bounded(entry, MAX_BYTES - _held(files))
    return files


def _held(files: dict[str, bytes]) -> int:
    return sum(map(len, files.values()))


def _read_bounded(path: Path, room: int) -> bytes:
    """The file's bytes, refused by its size before it is read when it would pass `room`."""
    size = os.lstat(path).st_size
    if size > room:
        raise NotCarried(f"its module files hold more than {MAX_BYTES >> 20} MiB ({path.name}: {size:,} bytes)")
    return path.read_bytes()


def _written_names() -> set[str]:
    """The names upcycle gives the files and folders of its outputs (ownership's lists), and the GGUF file."""
    return {*MODEL_FILES, MARKER, *LEGACY_SIGNATURES, *OUTPUT_ENTRIES,
            "model.gguf"}


def read_sentence_modules(folder: str | os.PathLike) -> dict[str, bytes] | None:
    """The sentence-transformers files of `folder` by relative path, or None when it has none or they cannot be
    carried (with a warning naming why)."""
    folder = Path(folder)
    if not (folder / MODULES_FILE).exists():
        return None
    try:
        files, parsed = {}, {}
        for name in ROOT_FILES:
            if (folder / name).exists():
                if not _regular_file(folder / name):
                    raise NotCarried(f"{name} is not a plain file")
                if os.lstat(folder / name).st_size > MAX_ROOT_FILE_BYTES:
                    raise NotCarried(f"{name} holds more than {MAX_ROOT_FILE_BYTES >> 20} MiB")
                files[name] = (folder / name).read_bytes()
                parsed[name] = parse_json(files[name], name)   # each is JSON; a malformed one is not carried
        modules = parsed[MODULES_FILE]
        if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
            raise NotCarried(f"{MODULES_FILE} is not a list of modules")
        if len(modules) > MAX_MODULES:
            raise NotCarried(f"{MODULES_FILE} lists {len(modules):,} modules (sentence-transformers models chain "
                             f"a handful; at most {MAX_MODULES} are carried)")
        for module in modules:
            files.update(_module_files(folder, module))
        if _held(files) > MAX_BYTES:
            raise NotCarried(f"its module files hold more than {MAX_BYTES >> 20} MiB")
    except (NotCarried, OSError, ValueError) as e:
        warnings.warn(f"{folder}: its sentence-transformers modules are not carried into what upcycle writes "
                      f"({e}); SentenceTransformer on the output will use mean pooling alone", stacklevel=2)
        return None
    return files


def write_sentence_modules(files: dict[str, bytes], directory: str | os.PathLike) -> None:
    """Write `files` (read_sentence_modules') into `directory`, a folder upcycle is writing."""
    directory = Path(directory)
    for name, data in files.items():
        path = directory / name
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(data)
