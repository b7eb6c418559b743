"""Named data sources for specialization analysis (docs/methods.md §5: "share of each expert's tokens per data source").

The default three exist on every machine upcycle installs on, with no download:
  wikipedia  the held-out split of the embedded English Wikipedia sample (`text.wikipedia_split`): encyclopedic
             prose, never seen by `upcycle train`'s default data
  python     the Python standard library's own `.py` files (tests, `site-packages` and the generated
             `pydoc_data` and `encodings` tables left out): source code
  licenses   the license texts the installed Python distributions ship (`*.dist-info/**/LICENSE*`, `COPYING*`;
             each distinct text once): legal English, a register as far from encyclopedic prose and from code as
             the Pile's FreeLaw domain is in Mixtral's per-domain routing analysis. Chosen over a third
             language because the embedded model reads English, and over news or fiction because the only
             offline samples of those here are a few kilobytes
A user names their own with `--source NAME=FILE` (`text.read_texts`: `.jsonl` 'text' fields or blank-line
separated documents).

`source_rows` turns each source into packed rows of `sequence_length` tokens (documents in a seeded order,
each cut to a window of `MAX_DOCUMENT_CHARS` characters that starts at a seeded line of it, so that one long
file cannot fill a source alone and code is not only module docstrings and imports; each ended by EOS,
concatenated and cut: `packing.pack_documents`) until it holds `tokens` real tokens.
"""

from __future__ import annotations

import hashlib
import os
import random
import sysconfig
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import torch

from ..errors import UpcycleError
from .packing import document_ids, pack_documents
from .text import read_texts, wikipedia_split

DEFAULT_SOURCES = ("wikipedia", "python", "licenses")
MAX_DOCUMENT_CHARS = 1500
_SKIPPED_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "pydoc_data", "encodings",
                 "__pycache__"}


def python_stdlib_texts() -> list[tuple[str, str]]:
    """(path relative to the standard library, text) of its `.py` files, sorted by path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in _SKIPPED_DIRS)
        found += [Path(folder) / f for f in files if f.endswith(".py")]
    out = []
    for path in sorted(found):
        try:
            out.append((str(path.relative_to(root)), path.read_text(encoding="utf-8")))
        except (OSError, UnicodeDecodeError):
            continue                            # a file the interpreter ships in another encoding: not needed
    return out


def license_texts() -> list[tuple[str, str]]:
    """(distribution/file, text) of every distinct license text of the installed distributions, sorted."""
    seen, out = set(), []
    for dist in sorted(metadata.distributions(), key=lambda d: (d.metadata["Name"] or "").lower()):
        for file in sorted(dist.files or [], key=str):
            name = Path(str(file)).name.upper()
            if ".dist-info" not in str(file) or not name.startswith(("LICENSE", "LICENCE", "COPYING")):
                continue
            try:
                text = Path(dist.locate_file(file)).read_text(encoding="utf-8").strip()
            except (OSError, UnicodeDecodeError):
                continue
            digest = hashlib.sha256(text.encode()).hexdigest()
            if text and digest not in seen:
                seen.add(digest)
                out.append((f"{dist.metadata['Name']}/{Path(str(file)).name}", text))
    return out


def default_source_texts(name: str) -> tuple[list[str], str]:
    """(documents, where they come from) of one of DEFAULT_SOURCES."""
    if name == "wikipedia":
        return wikipedia_split()[1], "held-out split of the embedded English Wikipedia sample (gensim wheel)"
    if name == "python":
        root = sysconfig.get_paths()["stdlib"]
        return [text for _, text in python_stdlib_texts()], f"Python standard library .py files in {root}"
    if name == "licenses":
        return [text for _, text in license_texts()], "license texts of the installed Python distributions"
    raise UpcycleError(f"no default source {name!r}; the defaults are {', '.join(DEFAULT_SOURCES)}")


def parse_source(spec: str) -> tuple[str, str]:
    """'NAME=FILE' -> (NAME, FILE); a bare FILE is named after its stem."""
    name, sep, file = spec.partition("=")
    if not sep:
        name, file = Path(spec).stem, spec
    if not name or not file:
        raise UpcycleError(f"--source {spec!r}: give NAME=FILE")
    return name, file


def user_source_texts(file: str) -> tuple[list[str], str]:
    try:
        return read_texts(file), str(file)
    except (FileNotFoundError, ValueError) as e:
        raise UpcycleError(f"source {file}: {e}") from None


@dataclass
class SourceRows:
    """One source's packed rows and what they hold."""

    name: str
    origin: str
    input_ids_NS: torch.Tensor
    attention_mask_NS: torch.Tensor
    documents: int              # documents (whole or cut) the rows hold
    available: int              # documents the source has
    sha256: str                 # of the token ids: the exact input, comparable across runs

    @property
    def tokens(self) -> int:
        return int(self.attention_mask_NS.sum())

    def describe(self) -> dict:
        return {"name": self.name, "origin": self.origin, "tokens": self.tokens, "rows": self.input_ids_NS.shape[0],
                "documents": self.documents, "documents_available": self.available, "sha256": self.sha256}


def _window(text: str, rng: random.Random) -> str:
    """At most MAX_DOCUMENT_CHARS characters of `text`, from the start of a random line (whole text if short)."""
    if len(text) <= MAX_DOCUMENT_CHARS:
        return text
    starts = [0] + [i + 1 for i, c in enumerate(text[: len(text) - MAX_DOCUMENT_CHARS]) if c == "\n"]
    start = rng.choice(starts)
    return text[start:start + MAX_DOCUMENT_CHARS]


def source_rows(name: str, texts: list[str], origin: str, tokenizer, *, tokens: int, sequence_length: int,
                seed: int = 0) -> SourceRows:
    """`tokens` real tokens of the documents `texts` in rows of `sequence_length` (the last row may be partial)."""
    if not texts:
        raise UpcycleError(f"source {name} has no documents")
    rng = random.Random(seed)
    order = list(range(len(texts)))
    rng.shuffle(order)
    chosen, count = [], 0
    for i in order:
        doc = _window(texts[i], rng)
        if not doc.strip():
            continue
        chosen.append(doc)
        count += len(document_ids(tokenizer, doc)) + 1
        if count >= tokens:
            break
    ids, mask = pack_documents(tokenizer, chosen, sequence_length)
    flat_mask = mask.reshape(-1)
    flat_mask[tokens:] = 0                     # exactly `tokens` real tokens (fewer if the source is short)
    rows = -(-int(flat_mask.sum()) // sequence_length)
    ids, mask = ids[:rows], mask[:rows]
    digest = hashlib.sha256(ids[mask.bool()].numpy().tobytes()).hexdigest()
    return SourceRows(name, origin, ids, mask, len(chosen), len(texts), digest)
