"""Retrieval metrics of text pairs (docs/contrastive.md): Recall@1/5/10 and MRR, query->document and back.

`retrieval_metrics` is pure: scores [Q, C] and which candidates are relevant [Q, C]. The rank of a query is
1 + the number of non-relevant candidates that score at least as high as its best relevant one: a tie counts
against the model, so a collapsed encoder (every score equal) ranks last instead of first. R@k = share of
queries with rank <= k; MRR = mean of 1 / rank (one relevant item per query is the usual MRR; with several, the
first one found counts). A query without any relevant candidate is refused.

`pair_retrieval` evaluates an encoder on held-out pairs: distinct query texts against distinct document texts;
a document is relevant to a query when some pair joins them, so repeated texts are one candidate rather than
ties that split the ranks (as `upcycle.tasks.evaluate.clip_metrics` does for captions).
Shape suffixes: Q queries, C candidates.
"""

from __future__ import annotations

import torch
from torch import nn

from ..data.text_pairs import TextPairs
from ..errors import UpcycleError
from .embedding import embed_texts

KS = (1, 5, 10)


def ranks(scores_QC: torch.Tensor, relevant_QC: torch.Tensor) -> torch.Tensor:
    """[Q] rank of each query's best relevant candidate (1 = first; ties count against it)."""
    relevant_QC = relevant_QC.to(device=scores_QC.device, dtype=torch.bool)
    if not bool(relevant_QC.any(1).all()):
        raise UpcycleError("retrieval: a query has no relevant candidate")
    scores = scores_QC.double()
    best_Q = scores.masked_fill(~relevant_QC, -torch.inf).amax(1)
    beaten_Q = ((scores >= best_Q[:, None]) & ~relevant_QC).sum(1)
    return (beaten_Q + 1).cpu()


def summarize(rank_Q: torch.Tensor, ks: tuple[int, ...] = KS) -> dict[str, float]:
    """{"R@k" for each k, "MRR"} of a rank vector."""
    rank = rank_Q.double()
    return {**{f"R@{k}": float((rank <= k).double().mean()) for k in ks}, "MRR": float((1.0 / rank).mean())}


def retrieval_metrics(scores_QC: torch.Tensor, relevant_QC: torch.Tensor, ks: tuple[int, ...] = KS,
                      ) -> dict[str, float]:
    """{"R@1", "R@5", "R@10", "MRR"} of scores [Q, C] given the relevant candidates [Q, C] (module docstring)."""
    return summarize(ranks(scores_QC, relevant_QC), ks)


def relevance(pairs: TextPairs) -> tuple[list[str], list[str], list[str], torch.Tensor]:
    """(distinct queries, distinct documents, each query's source, relevant [Q, D]) of pairs."""
    query_index = {q: i for i, q in enumerate(dict.fromkeys(pairs.queries))}
    doc_index = {d: i for i, d in enumerate(dict.fromkeys(pairs.documents))}
    relevant_QD = torch.zeros(len(query_index), len(doc_index), dtype=torch.bool)
    rows = torch.tensor([query_index[q] for q in pairs.queries])
    cols = torch.tensor([doc_index[d] for d in pairs.documents])
    relevant_QD[rows, cols] = True
    source_of = {}
    for query, source in zip(pairs.queries, pairs.sources, strict=True):
        source_of.setdefault(query, source)     # a query text shared by two sources counts for the first
    return list(query_index), list(doc_index), [source_of[q] for q in query_index], relevant_QD


@torch.no_grad()
def pair_retrieval(model: nn.Module, tokenizer, pairs: TextPairs, *, max_length: int, batch_size: int = 64,
                   where: str = "text pairs") -> dict:
    """Query->document and document->query Recall@1/5/10 and MRR of the encoder on `pairs`, and the
    query->document metrics per source (every source's queries against all the documents). `where`: the pairs'
    file, named by a refusal of their tokens."""
    queries, documents, sources, relevant_QD = relevance(pairs)
    query_QE = embed_texts(model, tokenizer, queries, max_length=max_length, batch_size=batch_size,
                           where=f"the queries of {where}")
    doc_DE = embed_texts(model, tokenizer, documents, max_length=max_length, batch_size=batch_size,
                         where=f"the documents of {where}")
    scores_QD = query_QE @ doc_DE.t()
    rank_Q = ranks(scores_QD, relevant_QD)
    per_source = {}
    for name in dict.fromkeys(sources):
        mine = torch.tensor([s == name for s in sources])
        per_source[name] = {"queries": int(mine.sum()), **summarize(rank_Q[mine])}
    return {"pairs": len(pairs), "queries": len(queries), "documents": len(documents),
            "query_to_document": summarize(rank_Q),
            "document_to_query": retrieval_metrics(scores_QD.t(), relevant_QD.t()),
            "per_source": per_source}
