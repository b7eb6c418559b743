"""Finished cells -> one row per (method, EESD setting), seeds aggregated: comparison.json and comparison.md.

A row's held-out metric is given right after conversion (the trainer's evaluation before its first step) and
after training, each as the mean over seeds ± the sample standard deviation over seeds (n - 1; nothing after
the mean for one seed), with the per-seed values in the JSON. Causal LMs are scored by held-out perplexity
(lower is better), CLIP by zero-shot accuracy (higher is better) with image->text and text->image Recall@1/5
in a second table, encoders (the contrastive task, docs/contrastive.md) by query->document MRR on the held-out
pairs (higher is better) with query->document and document->query Recall@1 in the second table.
"""

from __future__ import annotations

import statistics

from .request import DENSE, eesd_label

# task -> [(key, label, path into an evaluation dict)]; the first is the table's held-out metric
METRICS = {
    "causal_lm": [("perplexity", "perplexity", ("perplexity",))],
    "clip": [("zero_shot", "zero-shot accuracy", ("zero_shot", "accuracy")),
             ("i2t_r1", "I→T R@1", ("image_to_text", "R@1")), ("i2t_r5", "I→T R@5", ("image_to_text", "R@5")),
             ("t2i_r1", "T→I R@1", ("text_to_image", "R@1")), ("t2i_r5", "T→I R@5", ("text_to_image", "R@5"))],
    "contrastive": [("qd_mrr", "Q→D MRR", ("query_to_document", "MRR")),
                    ("qd_r1", "Q→D R@1", ("query_to_document", "R@1")),
                    ("dq_r1", "D→Q R@1", ("document_to_query", "R@1"))],
}
HIGHER_IS_BETTER = {"perplexity": False, "zero_shot": True, "i2t_r1": True, "i2t_r5": True, "t2i_r1": True,
                    "t2i_r5": True, "qd_mrr": True, "qd_r1": True, "dq_r1": True}


def metric(evaluation: dict | None, path: tuple[str, ...]) -> float | None:
    value = evaluation
    for key in path:
        if not isinstance(value, dict) or key not in value:
            return None
        value = value[key]
    return value


def spread(values: list[float | None]) -> dict:
    """{'mean', 'std' (sample, None for fewer than 2), 'min', 'max', 'values'} of the values that exist."""
    real = [v for v in values if v is not None]
    if not real:
        return {"mean": None, "std": None, "min": None, "max": None, "values": values}
    return {"mean": statistics.fmean(real), "std": statistics.stdev(real) if len(real) > 1 else None,
            "min": min(real), "max": max(real), "values": values}


def row_key(cell: dict) -> tuple[str, str]:
    return cell["method"], "–" if cell["method"] == DENSE else eesd_label(cell["eesd"])


def _order(methods: tuple[str, ...], key: tuple[str, str]) -> tuple:
    method, eesd = key
    rank = -1 if method == DENSE else (methods.index(method) if method in methods else len(methods))
    return rank, method, eesd != "none", eesd


def rows(cells: list[dict], task: str, methods: tuple[str, ...]) -> list[dict]:
    """One row per (method, EESD) over the cells' seeds, in the order: dense, then `methods`, then the rest."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for cell in sorted(cells, key=lambda c: c["seed"]):
        groups.setdefault(row_key(cell), []).append(cell)
    out = []
    for key in sorted(groups, key=lambda k: _order(methods, k)):
        members = groups[key]
        row = {"method": key[0], "eesd": key[1], "seeds": [c["seed"] for c in members], "metrics": {}}
        for name, _, path in METRICS[task]:
            row["metrics"][name] = {
                "after_conversion": spread([metric(_eval_at(c, 0), path) for c in members]),
                "after_training": spread([metric(_last_eval(c), path) for c in members])}
        first = members[0]
        row["parameters"] = first["parameters"]
        row["conversion_seconds"] = spread([c["conversion"]["seconds"] if c["conversion"] else None for c in members])
        row["train_tokens"] = first["train"]["tokens"]
        row["train_tokens_per_s"] = spread([c["train"]["tokens_per_s"] for c in members])
        for stage in ("init", "end"):
            for scalar in ("expert_similarity", "routing_entropy", "entropy_ratio", "output_similarity", "load_cov"):
                row.setdefault(stage, {})[scalar] = spread([
                    (c["diagnostics"][stage] or {}).get("mean", {}).get(scalar) for c in members])
        row["cells"] = [c["name"] for c in members]
        out.append(row)
    return out


def _eval_at(cell: dict, step: int) -> dict | None:
    return next((e for e in cell["evals"] if e["step"] == step), None)


def _last_eval(cell: dict) -> dict | None:
    return max(cell["evals"], key=lambda e: e["step"]) if cell["evals"] else None


def fmt(s: dict, digits: int) -> str:
    if s["mean"] is None:
        return "–"
    text = f"{s['mean']:.{digits}f}"
    return text if s["std"] is None else f"{text} ± {s['std']:.{digits}f}"


def _digits(task: str, name: str) -> int:
    return 2 if name == "perplexity" else 3


def markdown(table: list[dict], task: str) -> str:
    """The comparison table (and, for CLIP, the retrieval table) as Markdown."""
    (main, label, _), *others = METRICS[task]
    d = _digits(task, main)
    arrow = "lower is better" if not HIGHER_IS_BETTER[main] else "higher is better"
    lines = [f"{label[0].upper()}{label[1:]} on held-out data ({arrow}) right after conversion → after training: "
             "mean ± sample std over seeds. "
             "Similarity: mean pairwise cosine of the experts' weights; entropy: mean routing entropy / log E; "
             "both means over the MoE layers on held-out inputs, at init → after training.", "",
             f"| method | EESD | seeds | {label}: after conversion → after training | parameters total / active | "
             "conversion s | train tokens/s | expert similarity init → end | routing entropy / log E init → end |",
             "|---|---|---|---|---|---:|---:|---|---|"]
    for row in table:
        m = row["metrics"][main]
        p = row["parameters"]
        conv = "–" if row["conversion_seconds"]["mean"] is None else f"{row['conversion_seconds']['mean']:.1f}"
        lines.append(
            f"| {row['method']} | {row['eesd']} | {','.join(map(str, row['seeds']))} | "
            f"{fmt(m['after_conversion'], d)} → **{fmt(m['after_training'], d)}** | "
            f"{p['total']:,} / {p['active_per_token']:,} | {conv} | "
            f"{row['train_tokens_per_s']['mean']:,.0f} | "
            f"{fmt(row['init']['expert_similarity'], 3)} → {fmt(row['end']['expert_similarity'], 3)} | "
            f"{fmt(row['init']['entropy_ratio'], 3)} → {fmt(row['end']['entropy_ratio'], 3)} |")
    if others:
        lines += ["", "Retrieval on the held-out pairs, right after conversion → after training (mean ± std over "
                  "seeds):",
                  "", "| method | EESD | " + " | ".join(lbl for _, lbl, _ in others) + " |",
                  "|---|---|" + "---|" * len(others)]
        for row in table:
            cells = [f"{fmt(row['metrics'][n]['after_conversion'], 3)} → {fmt(row['metrics'][n]['after_training'], 3)}"
                     for n, _, _ in others]
            lines.append(f"| {row['method']} | {row['eesd']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
