"""Whether upcycle wrote an existing output, file by file, so that `--overwrite` replaces only what it can prove
is its own (`claims.check_replaceable`).

An output folder carries the marker `MARKER`: its kind and the relative path of every file upcycle wrote into it
(`files`, written when the folder is finished). A folder that grows while a command runs (a training run, a
comparison) cannot list its files in advance: what may grow in it is a set of path patterns (`GROWN`), and a
subfolder that holds its own marker (a run's model, a comparison's conversions and runs) is judged by that marker.
Every file below the output is checked, at any depth, and never through a link: a link anywhere, a file no
marker lists and no pattern of its kind matches, is the user's, and the whole output is then not upcycle's.

Older outputs: a marker without `files` lists top-level entries only (its subfolders are taken as listed), and a
folder without a marker is recognized by the file that names its kind (`LEGACY_SIGNATURES`) when every file in it
has a name upcycle gives (`LEGACY_FILES`), weight shards only as its index names them.
"""

from __future__ import annotations

import fnmatch
import json
from collections.abc import Iterable, Iterator
from pathlib import Path

from .staging import is_temporary, shared_name

MARKER = ".upcycle-output.json"
MARKER_FORMAT = "upcycle-output"
# Folders written by upcycle before the marker existed, recognised by the file that names their kind.
LEGACY_SIGNATURES = {"upcycle_config.json": "convert", "upcycle_report.json": "export", "run_config.yaml": "train",
                     "study.json": "compare", "analysis.json": "analyze"}
# The top-level entries a folder that grows while a command runs (a training run, a comparison) may hold.
GROWING = {"train": ("run_config.yaml", "log.jsonl", "checkpoints", "model", "inputs.json", "tensorboard", "wandb"),
           "compare": ("study.json", "invocations", "calibration", "conversions", "cells", "comparison.json",
                       "comparison.md", "metric_over_steps.png", "init_diagnostics.png")}
# sentence-transformers' files beside the transformer (checkpoint/sentence_modules.py reads and carries them)
SENTENCE_ROOT_FILES = ("modules.json", "sentence_bert_config.json", "config_sentence_transformers.json")
# The files of a model folder (transformers' save_pretrained, its tokenizer's files, upcycle's own records).
MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json",
               "upcycle_config.json", "upcycle_report.json", "run_config.yaml", "tokenizer.json",
               "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.json", "vocab.txt",
               "merges.txt", "tokenizer.model", "spiece.model", "chat_template.jinja", "chat_template.json",
               "preprocessor_config.json", "processor_config.json", *SENTENCE_ROOT_FILES)
# sentence-transformers' module subfolders as it names them (`{index}_{class}`: 1_Pooling, 2_Dense), with the
# suffixes upcycle carries: how a run's model/ written before it carried its own marker is judged
MODULE_FOLDER_FILES = tuple(f"[0-9]*_*/*.{suffix}" for suffix in ("json", "txt", "safetensors"))
# What grows inside each kind's folder, as paths relative to it (fnmatch: `*` also crosses `/`). A model
# folder's files are MODEL_FILES (a run's model/ written before it carried a marker).
GROWN = {
    "train": ("run_config.yaml", "log.jsonl", "inputs.json", "checkpoints/step-*/model.safetensors",
              "checkpoints/step-*/optimizer.pt", "checkpoints/step-*/teacher.safetensors",
              "checkpoints/step-*/trainer.json", "checkpoints/step-*/rng-*.json", "checkpoints/step-*/manifest.json",
              "checkpoints/step-*/rng-*.safetensors",
              "checkpoints/step-*/*.bin", "checkpoints/step-*/*.pkl",     # Accelerate's format, before upcycle 0.2
              f"checkpoints/{shared_name('step-*')}/*", "tensorboard/*/events.out.tfevents.*",
              "tensorboard/events.out.tfevents.*",
              "wandb/*", "model/model-*-of-*.safetensors",
              *(f"model/{name}" for name in (*MODEL_FILES, *MODULE_FOLDER_FILES))),
    "compare": ("study.json", "comparison.json", "comparison.md", "metric_over_steps.png", "init_diagnostics.png",
                "invocations/*.json", "calibration/*.safetensors", "conversions/*/conversion.json",
                "cells/*/plan.json", "cells/*/cell.json"),
}
LEGACY_FILES = {"convert": MODEL_FILES, "export": MODEL_FILES, "analyze": ()}


def write_marker(folder: Path, kind: str, entries: Iterable[str] | None = None) -> None:
    """The record that `folder` is upcycle's output of `kind`. A finished folder (`entries` None) lists every file
    below it; a growing one lists its top-level entries (`GROWING`) and is judged by the patterns of its kind."""
    from ..version import __version__

    record = {"format": MARKER_FORMAT, "kind": kind, "upcycle": __version__}
    if entries is not None:
        record["entries"] = sorted(entries)
    else:
        record["entries"] = sorted(p.name for p in folder.iterdir() if p.name != MARKER)
        record["files"] = sorted(rel for rel, _, marked in _walk(folder) if rel != MARKER and not marked)
    (folder / MARKER).write_text(json.dumps(record, indent=1) + "\n")


def _walk(folder: Path, prefix: str = "") -> Iterator[tuple[str, Path, bool]]:
    """(relative path, path, own marker) of every file and link below `folder`, never following a link, and of
    every subfolder that holds its own marker (not entered: it is judged by its marker); upcycle's temporaries
    are left out."""
    for entry in sorted(folder.iterdir()):
        if is_temporary(entry.name):
            continue
        rel = f"{prefix}{entry.name}"
        if entry.is_dir() and not entry.is_symlink():
            if (entry / MARKER).is_file():
                yield rel, entry, True
            else:
                yield from _walk(entry, rel + "/")
        else:
            yield rel, entry, False


def _read_marker(folder: Path) -> dict | None:
    try:
        record = json.loads((folder / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    return record if isinstance(record, dict) and record.get("format") == MARKER_FORMAT else None


def foreign_files(folder: Path) -> list[str] | None:
    """The files below an output folder that upcycle cannot prove it wrote (relative paths), or None when the
    folder is not an upcycle output at all."""
    return _judge(folder)[1]


def _judge(folder: Path) -> tuple[str | None, list[str] | None]:
    """(the folder's kind, `foreign_files`): one read of its marker and one walk of its tree."""
    record = _read_marker(folder)
    if record is None:
        kind = _legacy_kind(folder)
        if kind not in GROWN:
            return kind, _legacy_foreign(folder, kind)
        record = {"kind": kind, "entries": GROWING[kind]}      # a growing folder: judged by its kind's patterns
    kind = str(record.get("kind"))
    listed = set(record.get("files") or ())
    entries = set(record.get("entries") or ()) | set(GROWING.get(kind, ())) | {MARKER}
    foreign = []
    for rel, path, marked in _walk(folder):
        top = rel.split("/", 1)[0]
        if marked:
            inner = foreign_files(path)
            foreign += [f"{rel}/{f}" for f in inner] if inner is not None else [f"{rel}/"]
        elif path.is_symlink():
            foreign.append(rel)
        elif rel in listed or rel == MARKER or _matches(rel, GROWN.get(kind, ())):
            continue
        elif "files" not in record and top in entries and ("/" not in rel or kind not in GROWN):
            continue                # an older marker's entries (its subfolders taken as listed)
        else:
            foreign.append(rel)
    return kind, foreign


def _matches(rel: str, patterns: Iterable[str]) -> bool:
    return any(fnmatch.fnmatchcase(rel, pattern) for pattern in patterns)


def _legacy_kind(folder: Path) -> str | None:
    names = {p.name for p in folder.iterdir() if not is_temporary(p.name)}
    return next((k for signature, k in LEGACY_SIGNATURES.items() if signature in names), None)


def _legacy_foreign(folder: Path, kind: str | None) -> list[str] | None:
    """A folder written before the marker: its kind's signature file, and nothing that kind does not write."""
    if kind is None:
        return None
    allowed = LEGACY_FILES.get(kind)
    if not allowed:
        return []               # analyze: figures and tables of many names, kept as before
    shards = indexed_shards(folder)
    return [rel for rel, path, _ in _walk(folder)
            if path.is_symlink() or "/" in rel or not (rel in allowed or rel in shards)]


def indexed_shards(folder: Path) -> set[str]:
    """The weight files a folder's index names (a shard it does not name is not part of the model)."""
    try:
        index = json.loads((folder / "model.safetensors.index.json").read_text())
        return {str(v) for v in index["weight_map"].values()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return set()


def own_output(path: Path) -> str | None:
    """Why upcycle may replace the existing output `path` (its kind), or None when it may not: a folder every file
    of which it wrote (`foreign_files`), an empty folder, or a JSON file whose `format` names upcycle."""
    if path.is_symlink():
        return None
    if path.is_file():
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError, UnicodeDecodeError):
            return None
        kind = data.get("format") if isinstance(data, dict) else None
        return kind if isinstance(kind, str) and kind.startswith("upcycle") else None
    if not path.is_dir():
        return None
    if not any(not is_temporary(p.name) for p in path.iterdir()):
        return "empty folder"
    kind, foreign = _judge(path)
    return kind if foreign == [] else None
