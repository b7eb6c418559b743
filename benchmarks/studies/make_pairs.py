"""Write the packaged text pairs of the contrastive task: src/upcycle/data/pairs/ (docs/contrastive.md).

    python benchmarks/studies/make_pairs.py [--wordnet DIR] [--out DIR]

Inputs, both offline:
  WordNet 3.0 database files (data.noun, data.verb, data.adj, data.adv) from Debian's `wordnet-base` package
  (`apt-get install wordnet-base`, or `apt-get download wordnet-base && dpkg-deb -x wordnet-base_*.deb root`
  and --wordnet root/usr/share/wordnet). WordNet 3.0 licence (Princeton University): use, copy, modify and
  distribute for any purpose without fee, with its copyright notice on all copies; the notice is written next
  to the pairs (WORDNET-LICENSE).
  The English Wikipedia sample inside the gensim wheel (`upcycle.data.text.wikipedia_dump_path`): CC BY-SA;
  pairs derived from it are CC BY-SA too, attributed to Wikipedia's authors through the article titles.

Kinds of pair (the `source` field), each with the `doc_id` its held-out split goes by (upcycle.data.text_pairs:
a group is the doc_id before '#', so a Wikipedia article's sections stay on one side):
  wordnet-words      a synset's lemmas ("laying waste, ruin, ruination, wrecking") -> its definition
  wordnet-examples   the synset's first usage example ("the pilot reported two kills") -> its definition
                     (both only for the 33 k synsets that have an example, so the two kinds share their
                     documents and the file stays about 3 MB; --all-synsets adds the word pairs of all 117 k)
  wikipedia-headings "Article: Section heading" (the lead: "Article") -> the section's first paragraph
  wikipedia-sentences the first sentence of a paragraph -> the rest of the paragraph
Synsets with the same definition text are one document (the doc_id of the first in file order), so one text
never stands under two ids. The output is deterministic (sorted rows, gzip without a timestamp) and
provenance.json records the inputs' SHA-256 and the counts.
"""

from __future__ import annotations

import argparse
import bz2
import gzip
import hashlib
import json
import re
import shutil
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from upcycle.data.text import wikipedia_dump_path
from upcycle.data.wikimarkup import strip_wiki_markup
from upcycle.scripts import output_folder

ROOT = Path(__file__).resolve().parents[2]

WORDNET_FILES = {"n": "data.noun", "v": "data.verb", "a": "data.adj", "r": "data.adv"}
WORDNET_LICENSE_SOURCE = Path("/usr/share/doc/wordnet-base/copyright")
MIN_PARAGRAPH = 120          # characters: shorter "paragraphs" are list items, captions and leftovers
MAX_DOCUMENT = 1200          # characters of a Wikipedia document kept (cut at a sentence end)
_HEADING = re.compile(r"^(={2,6})\s*(.*?)\s*\1\s*$", re.M)
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9\"'(])")
_ADJ_MARKER = re.compile(r"\((a|p|ip)\)$")


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def parse_gloss(gloss: str) -> tuple[str, list[str]]:
    """(definition, examples) of a WordNet gloss: examples are the double-quoted parts after the definition."""
    examples = [e.strip() for e in re.findall(r'"([^"]+)"', gloss) if e.strip()]
    definition = re.sub(r'"[^"]*"', "", gloss)
    definition = re.sub(r"\s*;\s*(;\s*)*", "; ", definition).strip(" ;")
    return definition, examples


def wordnet_synsets(folder: Path) -> list[tuple[str, list[str], str, list[str]]]:
    """(synset id, lemmas, definition, examples) of every synset, in file order (wndb(5WN): data.* lines)."""
    out = []
    for pos, name in WORDNET_FILES.items():
        for line in (folder / name).read_text(encoding="utf-8").splitlines():
            if line.startswith("  ") or "|" not in line:
                continue                       # the licence header of each file
            fields, gloss = line.split("|", 1)
            parts = fields.split()
            offset, count = parts[0], int(parts[3], 16)
            lemmas = [_ADJ_MARKER.sub("", parts[4 + 2 * i]).replace("_", " ") for i in range(count)]
            definition, examples = parse_gloss(gloss.strip())
            if definition:
                out.append((f"wordnet:{pos}{offset}", list(dict.fromkeys(lemmas)), definition, examples))
    return out


def wordnet_pairs(folder: Path, *, all_synsets: bool = False) -> list[dict]:
    """Both kinds of pair of every synset with a usage example (all synsets' word pairs with `all_synsets`)."""
    pairs, id_of_text = [], {}
    for synset, lemmas, definition, examples in wordnet_synsets(folder):
        if not (examples or all_synsets):
            continue
        doc_id = id_of_text.setdefault(definition, synset)
        pairs.append({"query": ", ".join(lemmas), "document": definition, "source": "wordnet-words",
                      "doc_id": doc_id})
        if examples:
            pairs.append({"query": examples[0], "document": definition, "source": "wordnet-examples",
                          "doc_id": doc_id})
    return pairs


def wiki_pages(dump: Path):
    """(title, raw wikitext) of each main-namespace, non-redirect page of a MediaWiki XML dump."""
    with bz2.open(dump, "rb") as stream:
        for _, elem in ET.iterparse(stream):
            if elem.tag.rsplit("}", 1)[-1] != "page":
                continue
            values = {c.tag.rsplit("}", 1)[-1]: c for c in elem}
            title = values["title"].text or ""
            ns = (values["ns"].text or "").strip() if "ns" in values else "0"
            texts = [p.text or "" for p in elem.iter() if p.tag.rsplit("}", 1)[-1] == "text"]
            text = texts[-1] if texts else ""
            if ns == "0" and "redirect" not in values and not text.lstrip().lower().startswith("#redirect"):
                yield title, text
            elem.clear()


def cut(text: str, limit: int = MAX_DOCUMENT) -> str:
    """`text` up to `limit` characters, ended at its last sentence end when it is cut."""
    if len(text) <= limit:
        return text
    head = text[:limit]
    ends = [m.start() for m in _SENTENCE_END.finditer(head)]
    return head[:ends[-1]].strip() if ends else head.strip()


def paragraphs(wikitext: str) -> list[str]:
    plain = strip_wiki_markup(wikitext)
    return [" ".join(p.split()) for p in re.split(r"\n\s*\n", plain) if len(p.strip()) >= MIN_PARAGRAPH]


def wikipedia_pairs(dump: Path) -> list[dict]:
    pairs = []
    for title, text in wiki_pages(dump):
        heads = list(_HEADING.finditer(text))
        sections = [("", text[:heads[0].start()] if heads else text)]
        sections += [(m.group(2), text[m.end():heads[i + 1].start() if i + 1 < len(heads) else len(text)])
                     for i, m in enumerate(heads)]
        p = 0
        for s, (heading, body) in enumerate(sections):
            heading = strip_wiki_markup(heading).strip()
            found = paragraphs(body)
            if not found:
                continue
            pairs.append({"query": f"{title}: {heading}" if heading else title, "document": cut(found[0]),
                          "source": "wikipedia-headings", "doc_id": f"wikipedia:{title}#s{s}"})
            for paragraph in found:
                sentences = _SENTENCE_END.split(paragraph, maxsplit=1)
                if len(sentences) == 2 and len(sentences[1]) >= MIN_PARAGRAPH // 2:
                    pairs.append({"query": sentences[0], "document": cut(sentences[1]),
                                  "source": "wikipedia-sentences", "doc_id": f"wikipedia:{title}#p{p}"})
                    p += 1
    return pairs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wordnet", default="/usr/share/wordnet", help="folder of WordNet 3.0's data.* files")
    parser.add_argument("--license", default=str(WORDNET_LICENSE_SOURCE),
                        help="the wordnet-base package's copyright file (its licence text is copied)")
    parser.add_argument("--out", type=output_folder, default=str(ROOT / "src" / "upcycle" / "data" / "pairs"))
    parser.add_argument("--all-synsets", action="store_true", help="word pairs of every synset (about 7 MB)")
    args = parser.parse_args(argv)
    wordnet, out = Path(args.wordnet), Path(args.out)
    missing = [n for n in WORDNET_FILES.values() if not (wordnet / n).is_file()]
    if missing or not Path(args.license).is_file():
        print(f"WordNet files missing in {wordnet} ({', '.join(missing) or args.license}): install wordnet-base "
              f"(see this script's docstring)", file=sys.stderr)
        return 2
    dump = wikipedia_dump_path()
    rows = wordnet_pairs(wordnet, all_synsets=args.all_synsets) + wikipedia_pairs(dump)
    rows.sort(key=lambda r: (r["source"], r["doc_id"], r["query"]))
    seen, unique = set(), []
    for row in rows:
        key = (row["query"], row["document"])
        if key not in seen:
            seen.add(key)
            unique.append(row)
    out.mkdir(parents=True, exist_ok=True)
    payload = "".join(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n" for r in unique).encode()
    tmp = out / ".pairs.jsonl.gz.tmp"
    with open(tmp, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=9, mtime=0, filename="") as gz:
        gz.write(payload)
    tmp.replace(out / "pairs.jsonl.gz")
    shutil.copyfile(args.license, out / "WORDNET-LICENSE")
    counts: dict[str, int] = {}
    for row in unique:
        counts[row["source"]] = counts.get(row["source"], 0) + 1
    provenance = {
        "file": "pairs.jsonl.gz", "pairs": len(unique), "per_source": counts, "all_synsets": args.all_synsets,
        "documents": len({r["doc_id"] for r in unique}), "sha256_uncompressed": hashlib.sha256(payload).hexdigest(),
        "inputs": {"wordnet": {"what": "WordNet 3.0 (Debian wordnet-base)", "licence": "WordNet 3.0 licence "
                               "(Princeton University), see WORDNET-LICENSE",
                               "files": {n: sha256(wordnet / n) for n in WORDNET_FILES.values()}},
                   "wikipedia": {"what": f"gensim wheel test data {dump.name}", "licence": "CC BY-SA (Wikipedia)",
                                 "sha256": sha256(dump)}},
        "written_by": "benchmarks/studies/make_pairs.py"}
    (out / "provenance.json").write_text(json.dumps(provenance, indent=1) + "\n")
    print(json.dumps({k: provenance[k] for k in ("pairs", "per_source", "documents")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
