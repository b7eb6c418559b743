"""Text corpora for upcycle: a small Wikipedia dump and user-supplied text files.

The Wikipedia corpus is the shortened English dump that ships inside the gensim
wheel as test data (about 200 pages).  gensim itself is never imported: its
compiled dependencies are not installed, so the wheel is used purely as a data
package and the dump is located through the import system's metadata.

The dump is parsed with the standard library only (``bz2`` + ``ElementTree``)
and the MediaWiki markup is removed by `wikimarkup.strip_wiki_markup`.
"""

from __future__ import annotations

import bz2
import errno
import hashlib
import importlib.util
import json
import os
import pathlib
import re
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from dataclasses import dataclass

from ..errors import UpcycleError
from ..files import parse_json
from ..outputs.staging import atomic_write
from .wikimarkup import strip_wiki_markup

__all__ = [
    "Article",
    "cache_dir",
    "read_texts",
    "strip_wiki_markup",
    "wikipedia_articles",
    "wikipedia_dump_path",
    "wikipedia_split",
]

_DUMP_RELPATH = (
    "test",
    "test_data",
    "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2",
)
GENSIM_REQUIREMENT = "gensim==4.4.0"     # the wheel that carries the dump (data/assets.py lists it with the others)
_INSTALL_HINT = f"upcycle assets install (or pip install --no-deps {GENSIM_REQUIREMENT})"
_CACHE_NAME = "enwiki-articles.jsonl"
# Articles shorter than this after stripping are stubs, disambiguation pages
# or near-empty leftovers; they add noise rather than prose.
_MIN_ARTICLE_CHARS = 200


# --------------------------------------------------------------------------
# Locations
# --------------------------------------------------------------------------


def wikipedia_dump_path() -> pathlib.Path:
    """Return the path of the shortened enwiki dump shipped in the gensim wheel.

    Raises:
        FileNotFoundError: gensim is not installed or lacks the test data.
    """
    # find_spec on a top-level name only consults the finders; it does not run
    # gensim/__init__.py, which would fail because its deps are not installed.
    try:
        spec = importlib.util.find_spec("gensim")
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        candidate = pathlib.Path(location).joinpath(*_DUMP_RELPATH)
        if candidate.is_file():
            return candidate
    where = ", ".join(locations) if locations else "no gensim package found"
    raise FileNotFoundError(
        f"Wikipedia test dump {_DUMP_RELPATH[-1]} not found ({where}); install the data with: {_INSTALL_HINT}"
    )


def _cache_location() -> tuple[pathlib.Path, str]:
    """(the cache folder, how it was named for a message)."""
    explicit = os.environ.get("UPCYCLE_CACHE")
    xdg = os.environ.get("XDG_CACHE_HOME")
    if explicit:
        return pathlib.Path(explicit).expanduser(), "UPCYCLE_CACHE"
    if xdg:
        return pathlib.Path(xdg).expanduser() / "upcycle", "XDG_CACHE_HOME/upcycle"
    return pathlib.Path.home() / ".cache" / "upcycle", "~/.cache/upcycle"


def check_cache_writable() -> pathlib.Path:
    """The cache folder, refused in one line (creating nothing) when upcycle could not write there: a file in its
    place or on its way (UPCYCLE_CACHE=FILE/sub), or a folder this process may not write (a read-only file
    system, another user's). Asked before work that ends by writing the cache (the embedded model's first
    conversion, a minute long), not after it."""
    path, named = _cache_location()
    if path.exists() and not path.is_dir():
        raise UpcycleError(f"upcycle's cache folder ({named}) is {path}, which is not a folder; point UPCYCLE_CACHE "
                           f"at a folder")
    nearest = path
    while not nearest.exists() and nearest.parent != nearest:
        nearest = nearest.parent
    if not nearest.is_dir():
        raise UpcycleError(f"upcycle's cache folder ({named}) {path} cannot be made: {nearest} is a file; point "
                           f"UPCYCLE_CACHE at a folder you can write")
    if not os.access(nearest, os.W_OK | os.X_OK):
        raise UpcycleError(f"upcycle's cache folder ({named}) {path} cannot be written ({nearest} is read-only "
                           f"for this process); point UPCYCLE_CACHE at a folder you can write")
    return path


def cache_dir(create: bool = True) -> pathlib.Path:
    """Return (and, with `create`, create) the cache folder.

    ``$UPCYCLE_CACHE`` wins, then ``$XDG_CACHE_HOME/upcycle``, then
    ``~/.cache/upcycle``.  Empty variables count as unset, as the XDG spec asks.
    """
    path, named = _cache_location()
    # said at the first use, before any work: a file there would otherwise fail minutes later, at the first write
    if path.exists() and not path.is_dir():
        raise UpcycleError(f"upcycle's cache folder ({named}) is {path}, which is not a folder; point UPCYCLE_CACHE "
                           f"at a folder")
    if create:
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UpcycleError(f"upcycle's cache folder ({named}) {path} cannot be made ({e.strerror or e}); point "
                               f"UPCYCLE_CACHE at a folder you can write") from None
    return path


# --------------------------------------------------------------------------
# Dump parsing
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class Article:
    """One Wikipedia article as plain text."""

    title: str
    text: str


def _local(tag: str) -> str:
    """Tag name without its ``{namespace}``: export schema versions differ."""
    return tag.rsplit("}", 1)[-1]


def _iter_articles(path: pathlib.Path) -> Iterator[Article]:
    with bz2.open(path, "rb") as stream:
        root = None
        for event, elem in ET.iterparse(stream, events=("start", "end")):
            if root is None:
                root = elem
            if event != "end" or _local(elem.tag) != "page":
                continue
            title, ns, text, redirect = "", "0", "", False
            for child in elem:
                name = _local(child.tag)
                if name == "title":
                    title = child.text or ""
                elif name == "ns":
                    ns = (child.text or "").strip()
                elif name == "redirect":
                    redirect = True
                elif name == "revision":
                    # With full history the last revision is the current one.
                    for part in child:
                        if _local(part.tag) == "text":
                            text = part.text or ""
            # Processed pages are dropped from the tree so memory stays flat
            # however long the dump is.
            elem.clear()
            root.clear()
            if redirect or ns != "0":
                continue
            if text.lstrip()[:9].lower() == "#redirect":
                continue
            plain = strip_wiki_markup(text)
            if len(plain) >= _MIN_ARTICLE_CHARS:
                yield Article(title=title, text=plain)


def wikipedia_articles(path: str | os.PathLike | None = None) -> list[Article]:
    """Parse a MediaWiki XML ``.bz2`` dump into plain-text articles.

    Redirects, pages outside the main namespace and articles shorter than 200
    characters after stripping are skipped; dump order is kept.  ``path``
    defaults to :func:`wikipedia_dump_path`.
    """
    dump = pathlib.Path(path) if path is not None else wikipedia_dump_path()
    return list(_iter_articles(dump))


def _articles_cache_path(path: str | os.PathLike | None) -> pathlib.Path:
    if path is None:
        return cache_dir() / _CACHE_NAME
    # Another dump must not read (or overwrite) the bundled dump's cache.
    digest = hashlib.sha256(str(pathlib.Path(path).resolve()).encode()).hexdigest()
    return cache_dir() / f"enwiki-articles-{digest[:12]}.jsonl"


def _read_article_cache(cache: pathlib.Path) -> list[Article] | None:
    try:
        with cache.open(encoding="utf-8") as handle:
            rows = [parse_json(line, str(cache)) for line in handle if line.strip()]
        articles = [Article(title=row["title"], text=row["text"]) for row in rows]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError):
        # A damaged cache is only a lost shortcut: rebuild it from the dump.
        return None
    return articles or None


def _write_article_cache(cache: pathlib.Path, articles: list[Article]) -> None:
    # atomic: a crash or a concurrent reader never sees half a file
    def write(tmp: pathlib.Path) -> None:
        with open(tmp, "w", encoding="utf-8", newline="\n") as handle:
            for article in articles:
                handle.write(json.dumps({"title": article.title, "text": article.text}, ensure_ascii=False) + "\n")

    try:
        atomic_write(cache, write)
    except OSError as e:        # a read-only or full cache: only the shortcut is lost, as with a damaged one
        import warnings

        warnings.warn(f"the parsed Wikipedia articles were not cached in {cache.parent} ({e.strerror or e}); "
                      f"they are parsed again next time", stacklevel=2)


def wikipedia_split(
    heldout_every: int = 10, path: str | os.PathLike | None = None
) -> tuple[list[str], list[str]]:
    """Split the dump's articles into ``(train_texts, heldout_texts)``.

    Article ``i`` (0-based, dump order after filtering) is held out when
    ``i % heldout_every == heldout_every - 1``.  Splitting whole articles keeps
    held-out text unseen during training.  Parsed articles are cached as JSONL
    in :func:`cache_dir` and reused on later calls.
    """
    if heldout_every < 2:
        raise ValueError(f"heldout_every must be >= 2, got {heldout_every}")
    cache = _articles_cache_path(path)
    articles = _read_article_cache(cache)
    if articles is None:
        articles = wikipedia_articles(path)
        _write_article_cache(cache, articles)
    train: list[str] = []
    heldout: list[str] = []
    for i, article in enumerate(articles):
        target = heldout if i % heldout_every == heldout_every - 1 else train
        target.append(article.text)
    return train, heldout


# --------------------------------------------------------------------------
# User text files
# --------------------------------------------------------------------------

_BLANK_LINES = re.compile(r"\n(?:[ \t]*\n)+")


def jsonl_rows(content: str, file: str | os.PathLike) -> Iterator[tuple[int, object]]:
    """(line number, parsed value) of each non-blank line of JSONL `content`; ValueError on invalid JSON."""
    # split("\n") rather than splitlines(): JSON may legally contain raw
    # U+2028 and similar characters that splitlines() would break on.
    for lineno, line in enumerate(content.split("\n"), start=1):
        if not line.strip():
            continue
        yield lineno, parse_json(line, f"{file}:{lineno}")


def check_text(value: str, where: str) -> str:
    """`value` as text a tokenizer reads: refused (ValueError naming `where`) when it holds a lone surrogate, which
    JSON can spell (an escaped "\\ud800") but is no character of any text."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = value[e.start:e.end].encode("unicode_escape").decode()
        raise ValueError(f"{where} holds {bad}, a lone surrogate: not a character of any text") from None
    return value


def read_texts(path: str | os.PathLike) -> list[str]:
    """Read documents from a user text file.

    ``.jsonl``: one JSON object per non-empty line, its string ``text`` field
    is a document.  Anything else: UTF-8 text, documents separated by blank
    lines.  Whitespace-only documents are dropped.

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: not a regular file, a malformed JSONL line, undecodable bytes, or no text.
    """
    file = pathlib.Path(path)
    if file.exists() and not file.is_file():
        # a folder is a mistake; a pipe or a device (/dev/zero) would block or never end
        raise ValueError(f"{file} is not a regular file (a folder, a pipe or a device); give a .txt or .jsonl file")
    try:
        # utf-8-sig: editors on Windows often prepend a BOM to UTF-8 files.
        content = file.read_text(encoding="utf-8-sig")
    except FileNotFoundError:
        raise FileNotFoundError(errno.ENOENT, "text file not found", str(file)) from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"{file}: not valid UTF-8 ({exc})") from exc

    if file.suffix.lower() == ".jsonl":
        texts = []
        for lineno, row in jsonl_rows(content, file):
            text = row.get("text") if isinstance(row, dict) else None
            if not isinstance(text, str):
                raise ValueError(f'{file}:{lineno}: expected a JSON object with a string "text" field')
            check_text(text, f'{file}:{lineno}: "text"')
            if text.strip():
                texts.append(text)
    else:
        texts = [doc.strip() for doc in _BLANK_LINES.split(content) if doc.strip()]

    if not texts:
        raise ValueError(f"{file}: contains no text")
    return texts
