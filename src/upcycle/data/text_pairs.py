"""Text pairs for the contrastive sentence-embedding task (docs/contrastive.md): read, check, split by document.

A pair file is JSONL (optionally gzip-compressed, `.jsonl.gz`), one object per line:

    {"query": "...", "document": "...", "source": "wordnet-words", "doc_id": "wordnet:n00217014"}

`query` and `document` are non-empty strings; `source` (optional, default "pairs") names the kind of pair, so
that retrieval and routing can be measured per source; `doc_id` (optional, default the document's text) says
which pairs share a document. Other keys are ignored (provenance a file may carry).

The held-out split is by document, never by pair: every pair of a document, and every document of a group,
lands on the same side. A document's group is the part of its `doc_id` before the first "#" (the sections
"wikipedia:Anarchism#2" and "wikipedia:Anarchism#5" of one article stay together), and a group is held out when
the first 8 bytes of SHA-256(group) as a fraction of 2^64 fall below `held_out`: the assignment of a document
depends on its id alone, not on the order or the size of the file.

The packaged pairs (`PACKAGED`: WordNet 3.0 glosses and sections of the embedded Wikipedia sample, written by
benchmarks/studies/make_pairs.py; provenance and licences in src/upcycle/data/pairs/README.md) are the default data.
"""

from __future__ import annotations

import gzip
import hashlib
import itertools
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ..errors import UpcycleError
from ..files import parse_json
from .text import check_text

PAIRS_FOLDER = Path(__file__).resolve().parent / "pairs"
PACKAGED = PAIRS_FOLDER / "pairs.jsonl.gz"
DEFAULT_SOURCE = "pairs"
HELD_OUT = 0.1              # share of document groups held out
MAX_PAIR_FILE_BYTES = 2**30  # a pair file's text (decompressed): past this it is a mistake, not data
MAX_LINE_BYTES = 2**20       # one pair's line: its texts are cut to the sequence length anyway
MAX_PAIRS = 2_000_000        # pairs held at once (each a few hundred bytes as Python strings)
MAX_LINES = 2 * MAX_PAIRS    # lines read, blank ones included (a file of newlines is read a line at a time)


@dataclass(frozen=True)
class TextPairs:
    """Aligned lists, one entry per pair."""

    queries: list[str]
    documents: list[str]
    sources: list[str]
    doc_ids: list[str]

    def __len__(self) -> int:
        return len(self.queries)

    def subset(self, keep: list[int]) -> TextPairs:
        return TextPairs(*([values[i] for i in keep] for values in
                           (self.queries, self.documents, self.sources, self.doc_ids)))

    def source_names(self) -> list[str]:
        """The distinct sources, in order of first appearance."""
        return list(dict.fromkeys(self.sources))

    def texts_by_source(self) -> dict[str, list[str]]:
        """Per source, its queries and its distinct documents: the texts a per-source routing analysis reads."""
        out: dict[str, list[str]] = {}
        seen: set[tuple[str, str]] = set()
        for query, document, source, doc_id in zip(self.queries, self.documents, self.sources, self.doc_ids,
                                                   strict=True):
            texts = out.setdefault(source, [])
            texts.append(query)
            if (source, doc_id) not in seen:
                seen.add((source, doc_id))
                texts.append(document)
        return out


def _lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """(line number, bytes) of each line of the file (decompressed for .gz), read one line at a time: a line over
    MAX_LINE_BYTES, a file past MAX_PAIR_FILE_BYTES (decompressed) or past MAX_LINES, is refused before it is held."""
    if path.exists() and not path.is_file():
        raise UpcycleError(f"text pairs {path}: not a regular file (a folder, a pipe or a device); give a .jsonl or "
                           f".jsonl.gz file")
    if not path.exists():
        raise UpcycleError(f"text pairs {path}: no such file")
    total = 0
    try:
        with (gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")) as f:
            for lineno in itertools.count(1):
                line = f.readline(MAX_LINE_BYTES + 1)
                if not line:
                    return
                if lineno > MAX_LINES:
                    raise UpcycleError(f"text pairs {path}: more than {MAX_LINES:,} lines; split the file")
                if len(line) > MAX_LINE_BYTES:
                    raise UpcycleError(f"text pairs {path}:{lineno}: the line is longer than {MAX_LINE_BYTES:,} "
                                       f"bytes; a pair's texts are cut to the sequence length anyway, so cut them "
                                       f"shorter in the file")
                total += len(line)
                if total > MAX_PAIR_FILE_BYTES:
                    raise UpcycleError(f"text pairs {path}: more than a pair file may hold ({MAX_PAIR_FILE_BYTES:,} "
                                       f"bytes{', decompressed' if path.suffix == '.gz' else ''}); split it")
                yield lineno, line
    except (OSError, EOFError, gzip.BadGzipFile) as e:
        raise UpcycleError(f"text pairs {path}: cannot be read ({e})") from None


def _row(path: Path, lineno: int, line: bytes) -> object:
    where = f"{path}:{lineno}"
    try:
        text = line.decode("utf-8-sig" if lineno == 1 else "utf-8")
    except UnicodeDecodeError as e:
        raise UpcycleError(f"text pairs {where}: not UTF-8 text ({e})") from None
    if not text.strip():
        return None
    return parse_json(text, f"text pairs {where}")


def read_text_pairs(path: str | Path, max_chars: int | None = None) -> TextPairs:
    """Every pair of a JSONL (or .jsonl.gz) file, read and checked line by line (a bad line is an error naming
    it); `max_chars`: each query and document cut to that many characters as it is read (the texts are cut to
    the sequence length anyway). At most MAX_PAIRS pairs."""
    path = Path(path).expanduser()
    if not path.name.endswith((".jsonl", ".jsonl.gz")):
        raise UpcycleError(f"text pairs {path}: expected a .jsonl or .jsonl.gz file of "
                           f'{{"query": ..., "document": ...}} lines')
    queries, documents, sources, doc_ids = [], [], [], []
    for lineno, line in _lines(path):
        row = _row(path, lineno, line)
        if row is None:
            continue
        where = f"{path}:{lineno}"
        if not isinstance(row, dict):
            raise UpcycleError(f'{where}: expected a JSON object {{"query": ..., "document": ...}}, got '
                               f"{type(row).__name__}")
        for key in ("query", "document"):
            value = row.get(key)
            if not isinstance(value, str) or not value.strip():
                raise UpcycleError(f'{where}: "{key}" must be a non-empty string, got {value!r:.60}')
        source, doc_id = row.get("source", DEFAULT_SOURCE), row.get("doc_id", row["document"])
        if not isinstance(source, str) or not source.strip():
            raise UpcycleError(f'{where}: "source" must be a non-empty string, got {source!r:.60}')
        if isinstance(doc_id, bool) or not isinstance(doc_id, (str, int)) or not str(doc_id).strip():
            raise UpcycleError(f'{where}: "doc_id" must be a non-empty string or an integer, got {doc_id!r:.60}')
        try:
            for key, value in (("query", row["query"]), ("document", row["document"]), ("source", source),
                               ("doc_id", str(doc_id))):
                check_text(value, f'{where}: "{key}"')
        except ValueError as e:
            raise UpcycleError(f"text pairs {e}") from None
        if len(queries) == MAX_PAIRS:
            raise UpcycleError(f"text pairs {path}: more than {MAX_PAIRS:,} pairs; split the file")
        queries.append(row["query"][:max_chars])
        documents.append(row["document"][:max_chars])
        sources.append(sys.intern(source))
        doc_ids.append(str(doc_id))
    if not queries:
        raise UpcycleError(f"text pairs {path}: no pairs in the file")
    first_text: dict[str, str] = {}
    for doc_id, document in zip(doc_ids, documents, strict=True):
        # one id, one document: two texts under one id would be scored as the same document
        if first_text.setdefault(doc_id, document) != document:
            raise UpcycleError(f"text pairs {path}: doc_id {doc_id!r:.80} names two different documents")
    return TextPairs(queries, documents, sources, doc_ids)


def text_chars(sequence_length: int) -> int:
    """Characters of a text kept for a row of `sequence_length` tokens: far more than any tokenizer needs for
    that many (a token spans a few characters; 64 each, and a margin), so that cutting the text changes nothing
    the tokenizer makes of it, while a text of hundreds of megabytes is not held or tokenized whole."""
    return 64 * sequence_length + 1024


def group_of(doc_id: str) -> str:
    """The split group of a document: its id up to the first '#'."""
    return doc_id.split("#", 1)[0]


def is_held_out(doc_id: str, held_out: float = HELD_OUT) -> bool:
    digest = hashlib.sha256(group_of(doc_id).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < held_out


def split_by_document(pairs: TextPairs, held_out: float = HELD_OUT) -> tuple[TextPairs, TextPairs]:
    """(train, held-out): whole document groups on each side (see the module docstring)."""
    if not 0 < held_out < 1:
        raise UpcycleError(f"held_out must be in (0, 1), got {held_out}")
    held = {doc_id: is_held_out(doc_id, held_out) for doc_id in dict.fromkeys(pairs.doc_ids)}
    train = [i for i, doc_id in enumerate(pairs.doc_ids) if not held[doc_id]]
    test = [i for i, doc_id in enumerate(pairs.doc_ids) if held[doc_id]]
    return pairs.subset(train), pairs.subset(test)


def packaged_pairs() -> TextPairs:
    if not PACKAGED.is_file():
        raise UpcycleError(f"the packaged text pairs {PACKAGED} are missing from this installation (they are written "
                           f"by benchmarks/studies/make_pairs.py); give a pair file with --data")
    return read_text_pairs(PACKAGED)


def load_text_pairs(data: str | None, eval_data: str | None = None, max_chars: int | None = None
                    ) -> tuple[TextPairs, TextPairs]:
    """(train, held-out) pairs: `data` (None: the packaged pairs) split by document, or, with `eval_data`, all of
    `data` for training and all of `eval_data` held out. Neither side may be empty. `max_chars`: as
    `read_text_pairs`."""
    pairs = packaged_pairs() if data is None else read_text_pairs(data, max_chars)
    if eval_data is not None:
        train, held = pairs, read_text_pairs(eval_data, max_chars)
    else:
        train, held = split_by_document(pairs)
    where = "the packaged pairs" if data is None else data
    if not len(train):
        raise UpcycleError(f"text pairs {where}: every document is held out; give more documents or --eval-data")
    if not len(held):
        raise UpcycleError(f"text pairs {where}: no document falls in the held-out split ({HELD_OUT:.0%} of the "
                           f"document groups); give more documents or --eval-data")
    return train, held
