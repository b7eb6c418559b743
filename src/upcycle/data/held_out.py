"""The one rule for a merge source's held-out documents when its recipe gives no `eval_data`: a seeded random
share of the source's documents. The merge measures router-source agreement on them and records the rule
(share and seed) in its report, so that `upcycle analyze` reads back the same documents."""

from __future__ import annotations

import torch


def held_out_split(docs: list[str], share: float, seed: int) -> tuple[list[str], list[str]]:
    """(calibration documents, held-out documents): a seeded random `share` of `docs` held out (at least one;
    none when `share` is 0 or there is a single document)."""
    if share <= 0 or len(docs) < 2:
        return list(docs), []
    order = torch.randperm(len(docs), generator=torch.Generator().manual_seed(seed)).tolist()
    n_held = max(1, round(share * len(docs)))
    return [docs[i] for i in order[n_held:]], [docs[i] for i in order[:n_held]]
