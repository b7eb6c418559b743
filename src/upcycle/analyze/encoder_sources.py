"""The data an encoder (the BERT family, docs/contrastive.md) is analyzed on: one text per row, as the contrastive
task reads it, and by default the texts of held-out pairs, one data source per kind of text.

An encoder never reads packed documents: each query and each document is one row, [CLS] text [SEP], cut at
`sequence_length` (`upcycle.tasks.embedding.tokenize`, the task's own tokenization). `text_rows` makes a
source's rows that way: its texts in a seeded order until they hold `tokens` real tokens (whole texts, so a
source may hold a few more), sorted by length so that a batch cut to its longest row runs little padding.

Default sources (no --source/--data): the held-out pairs the target was trained and scored on (a run: the
held-out split of its `data`, or all of its `eval_data`, from its inputs.json; any other target: the held-out
split of the packaged pairs), or every pair of --pairs FILE. Each pair `source` gives two data sources,
`SOURCE/query` and `SOURCE/document`: a pair source's queries are its own kind of text (WordNet lemmas, usage
examples, headings, sentences), but its documents may be another source's too (the two WordNet sources share
their definitions), and a text labelled with two sources would blur the specialization score. So a document
shared by several sources counts for the first that names it (as `upcycle.tasks.retrieval.relevance` does
for queries), and a source left without texts is dropped.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from pathlib import Path

from ..checkpoint.upcycle_format import MOE_CONFIG, base_config
from ..core.architectures import find_family
from ..data.source_texts import SourceRows
from ..data.text_pairs import TextPairs, load_text_pairs, read_text_pairs
from ..errors import UpcycleError
from ..files import read_json_file
from ..runs.layout import INPUTS
from ..tasks.embedding import tokenize


def is_encoder_folder(folder: str | Path) -> bool:
    """Whether an upcycle folder's base model is an encoder (a family that attends both ways, not configured as
    a decoder: `upcycle.tasks.kind.is_encoder` on the config alone); False for any other folder."""
    if not (Path(folder) / MOE_CONFIG).is_file():
        return False
    config = base_config(folder)
    family = find_family(config)
    return family is not None and family.bidirectional and not getattr(config, "is_decoder", False)


@dataclass(frozen=True)
class PairData:
    """The pairs an encoder's default sources come from."""

    data: str | None            # a pair file; None: the packaged pairs
    eval_data: str | None       # with it, all of it is held out (the run trained on all of `data`)
    whole: bool                 # --pairs FILE: every pair of `data`, no split
    origin: str

    def held_out(self) -> TextPairs:
        if self.whole:
            return read_text_pairs(self.data)
        return load_text_pairs(self.data, self.eval_data)[1]

    def files(self) -> list[tuple[str, str | None]]:
        return [("pair file", self.data), ("held-out pair file", self.eval_data)]


def encoder_pairs(pairs_flag: str | None, kind: str, run: Path) -> PairData:
    """--pairs FILE (every pair), else a run's held-out pairs (its inputs.json), else the packaged ones."""
    if pairs_flag is not None:
        if not Path(pairs_flag).is_file():
            raise UpcycleError(f"--pairs {pairs_flag}: no such file")
        return PairData(pairs_flag, None, True, f"every pair of {pairs_flag}")
    if kind == "run" and (run / INPUTS).is_file():
        try:
            recorded = read_json_file(run / INPUTS, "record of the run's inputs")
        except (OSError, ValueError) as e:
            raise UpcycleError(f"{run / INPUTS} cannot be read ({e})") from None
        data, eval_data = recorded.get("data"), recorded.get("eval_data")
        for path in (data, eval_data):
            if path is not None and not Path(path).is_file():
                raise UpcycleError(f"the run's pair file {path} is gone: give the held-out pairs with --pairs FILE")
        where = (f"all of the run's eval_data {eval_data}" if eval_data else
                 f"the held-out split of the run's data {data or '(the packaged pairs)'}")
        return PairData(data, eval_data, False, where)
    return PairData(None, None, False, "the held-out split of the packaged pairs")


def pair_sources(pairs: TextPairs) -> dict[str, list[str]]:
    """{'SOURCE/query': distinct queries, 'SOURCE/document': distinct documents} in order of first appearance;
    a text already in a source of its role stays in that first one (module docstring), so a source whose texts
    all came earlier is not listed."""
    out: dict[str, list[str]] = {}
    seen: set[tuple[str, str]] = set()
    for query, document, source in zip(pairs.queries, pairs.documents, pairs.sources, strict=True):
        for role, text in (("query", query), ("document", document)):
            if (role, text) not in seen:          # a text seen before belongs to its first source
                seen.add((role, text))
                out.setdefault(f"{source}/{role}", []).append(text)
    return out


def text_rows(name: str, texts: list[str], origin: str, tokenizer, *, tokens: int, sequence_length: int,
              seed: int = 0) -> SourceRows:
    """One text per row (the task's tokenization), texts in a seeded order until `tokens` real tokens."""
    chosen = [t for t in dict.fromkeys(texts) if t.strip()]
    if not chosen:
        raise UpcycleError(f"source {name} has no texts")
    random.Random(seed).shuffle(chosen)
    taken, count = [], 0
    for start in range(0, len(chosen), 256):
        chunk = chosen[start:start + 256]
        lengths = [len(ids) for ids in tokenizer(chunk, truncation=True, max_length=sequence_length)["input_ids"]]
        for text, length in zip(chunk, lengths, strict=True):
            taken.append((length, text))
            count += length
            if count >= tokens:
                break
        if count >= tokens:
            break
    taken.sort(key=lambda item: item[0])        # similar lengths side by side: batches cut to their longest row
    enc = tokenize(tokenizer, [text for _, text in taken], sequence_length)
    ids, mask = enc["input_ids"], enc["attention_mask"]
    digest = hashlib.sha256(ids[mask.bool()].numpy().tobytes()).hexdigest()
    return SourceRows(name, origin, ids, mask, len(taken), len(chosen), digest)


def pair_rows(pairs: PairData, tokenizer, *, tokens: int, sequence_length: int, seed: int) -> list[SourceRows]:
    """The default sources of an encoder (module docstring), each as `text_rows`."""
    return [text_rows(name, texts, f"{pairs.origin}: {name}", tokenizer, tokens=tokens,
                      sequence_length=sequence_length, seed=seed)
            for name, texts in pair_sources(pairs.held_out()).items()]

