"""report.html: one self-contained page of an analysis (the analysis.json dict and its PNG figures).

Everything is in the file: the figures as base64 `data:` images, the style inline; no script, no font, no
request to anywhere, so it opens the same offline, from an e-mail attachment or a CI artifact. Sections: what
was analyzed (target, dense source, sources, machine), for a run the metrics over steps, the per-layer summary
table of the last snapshot, the figures with captions, and what each metric means.
"""

from __future__ import annotations

import base64
import html
import math

from .plots import block_index, is_embedding_analysis, layer_means

CSS = """
body { font-family: -apple-system, 'Segoe UI', Helvetica, Arial, sans-serif; margin: 2em auto; max-width: 1040px;
       color: #222; line-height: 1.45; padding: 0 1em; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 1.8em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; font-size: 0.82em; margin: 0.6em 0; }
th, td { border: 1px solid #ddd; padding: 3px 7px; text-align: right; }
th { background: #f3f3f3; } td.name, th.name { text-align: left; }
figure { margin: 1.2em 0; } figure img { max-width: 100%; border: 1px solid #eee; }
figcaption { font-size: 0.88em; color: #555; } code { background: #f5f5f5; padding: 0 3px; }
.note { color: #555; font-size: 0.9em; }
"""

GLOSSARY = (
    ("weight similarity", "mean over expert pairs of the cosine of their vectorized weights, per projection"),
    ("diversity", "SPRI's 1 − mean cosine of the down projections"),
    ("output similarity", "mean over tokens and expert pairs of cos(E_i(x), E_j(x)) on the same tokens"),
    ("entropy / log E", "mean routing entropy H(g(x)) over its maximum; 1 = the router does not choose"),
    ("load CoV", "std/mean of the experts' shares of token-slots; 0 = balanced"),
    ("RC", "relative compactness Tr(Σ_W Σ_B⁺) of the outputs each expert produces; lower = separated"),
    ("NMI", "I(source; top-1 expert) / H(source): 0 = routing ignores the source, 1 = every expert serves one "
            "source; a value at or below the shuffled-source maximum is chance"),
    ("source agreement", "a model merged from several fine-tunes, on their own held-out text: the share of a "
                         "source's tokens whose top-1 expert was made from that source, averaged over the sources"),
    ("KL", "token-level KL(dense ‖ model) of the next-token distributions on the sources, nats per token"),
    ("embedding cosine to dense", "an encoder: mean over texts of the cosine between the model's mean-pooled "
                                  "embedding and the dense encoder's; 1 = the same direction"),
)


def _fmt(x, digits: int = 3) -> str:
    """Three decimals (a rounding-level -2e-16 shows as -0.000); large numbers and the KL column (a copy's
    1e-11 is information) in scientific notation."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    if isinstance(x, Sci):
        return f"{x:.2e}"
    if isinstance(x, float):
        return f"{x:.{digits}g}" if abs(x) >= 1e4 else f"{x:.{digits}f}"
    return html.escape(str(x))


class Sci(float):
    """A number the tables show in scientific notation."""


def _sci(x):
    return None if x is None else Sci(x)


def _table(header: list[str], rows: list[list], name_columns: int = 1) -> str:
    head = "".join(f'<th class="name">{html.escape(h)}</th>' if i < name_columns else f"<th>{html.escape(h)}</th>"
                   for i, h in enumerate(header))
    body = "".join("<tr>" + "".join(f'<td class="name">{_fmt(v)}</td>' if i < name_columns else f"<td>{_fmt(v)}</td>"
                                    for i, v in enumerate(row)) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def layer_rows(snapshot: dict) -> list[list]:
    rows = []
    for name, m in snapshot["layers"].items():
        sim = m["weight_similarity"]
        spec = m.get("specialization")
        rows.append([name, m["num_experts"], m["top_k"], *(sim.get(p, {}).get("mean") for p in ("gate", "up", "down")),
                     sim["all"]["mean"], m["diversity"], m["output_similarity"]["mean"], m["routing_entropy"],
                     m["routing_entropy"] / math.log(m["num_experts"]) if m["num_experts"] > 1 else None,
                     m["load_cov"], m["relative_compactness"], spec["nmi"] if spec else None,
                     spec["nmi_baseline"]["max"] if spec else None, _mean_agreement(spec)])
    return rows


LAYER_HEADER = ["layer", "E", "k", "sim gate", "sim up", "sim down", "sim all", "diversity", "output sim",
                "entropy", "entropy / log E", "load CoV", "RC", "NMI", "NMI shuffled max", "source agreement"]


def _mean_agreement(spec: dict | None) -> float | None:
    """A merged model's router-source agreement, averaged over its sources (None for other models)."""
    values = [v for v in ((spec or {}).get("source_agreement") or {}).values() if v is not None]
    return sum(values) / len(values) if values else None


def _inputs(analysis: dict) -> str:
    t, i, m = analysis["target"], analysis["inputs"], analysis["machine"]
    dense = f"{html.escape(str(t['dense']))} ({t['dense_from']})" if t["dense"] else "none (no KL to dense)"
    parts = [f"<p><b>Target</b> <code>{html.escape(t['path'])}</code> ({html.escape(t['kind'])}); "
             f"<b>dense source</b> {dense}; {len(analysis['snapshots'])} snapshot(s).</p>"]
    if i.get("command"):
        parts.append(f"<p><b>Command</b> <code>{html.escape(i['command'])}</code></p>")
    parts += [f'<p class="note">{html.escape(n)}</p>' for n in t.get("notes", [])]
    parts.append(_table(["source", "origin", "tokens", "documents", "sha256 of the token ids"],
                        [[s["name"], s["origin"], s["tokens"], s["documents"], s["sha256"][:16]]
                         for s in i["sources"]], name_columns=2))
    seconds = analysis.get("seconds", {})
    parts.append(f'<p class="note">{i["tokens_per_source"]} tokens per source in rows of {i["sequence_length"]}; '
                 f"expert outputs on {i['output_tokens']} tokens per layer; {i['shuffles']} shuffles; seed "
                 f"{i['seed']}. Machine: {html.escape(m['platform'])}, {m['cpus']} CPUs ({m['torch_threads']} torch "
                 f"threads), torch {html.escape(m['torch'])}, upcycle {html.escape(m['upcycle'])}; "
                 f"{_fmt(seconds.get('total'), 1)} s.</p>")
    return "\n".join(parts)


def _steps(analysis: dict) -> str:
    snapshots = [s for s in analysis["snapshots"] if s["step"] is not None]
    if len(snapshots) < 2:
        return ""
    embedding = is_embedding_analysis(snapshots)
    header = ["snapshot", "sim gate", "sim up", "sim down", "diversity", "output sim", "entropy / log E",
              "load CoV", "RC", "NMI", "NMI shuffled max",
              *(["embedding cosine to dense"] if embedding else ["KL to dense", "NLL"])]
    rows = []
    for s in snapshots:
        m = layer_means(s)
        rows.append([s["label"], m["similarity_gate"], m["similarity_up"], m["similarity_down"], m["diversity"],
                     m["output_similarity"], m["entropy_ratio"], m["load_cov"], m["relative_compactness"],
                     m.get("nmi"), m.get("nmi_baseline_max"),
                     *([m["embedding_cosine_to_dense"]] if embedding else [_sci(m["kl_to_dense"]), m["nll"]])])
    return "<h2>Over training (means over the MoE layers)</h2>" + _table(header, rows)


def _per_source(snapshot: dict) -> str:
    cosine = snapshot.get("embedding_cosine_to_dense")
    if cosine:              # an encoder: no next-token NLL or KL, the embeddings' cosine to the dense encoder's
        rows = [[n, v] for n, v in cosine["per_source"].items()] + [["all", cosine["all"]]]
        return _table(["source", "embedding cosine to dense (mean)"], rows)
    names = list(snapshot["nll"]["per_source"])
    kl = snapshot.get("kl_to_dense")
    rows = [[n, snapshot["nll"]["per_source"][n], _sci(kl["per_source"][n]) if kl else None] for n in names]
    rows.append(["all", snapshot["nll"]["all"], _sci(kl["all"]) if kl else None])
    return _table(["source", "next-token NLL (nats)", "KL(dense ‖ model)"], rows)


def render_report(analysis: dict, images: dict[str, bytes], figures: list[tuple[str, str]]) -> str:
    """The whole page; `images` maps each figure's file name to its PNG bytes, `figures` gives the order and
    the captions."""
    last = analysis["snapshots"][-1]
    title = f"upcycle analyze: {analysis['target']['path']}"
    figure_html = "".join(
        f'<figure><img alt="{html.escape(name)}" src="data:image/png;base64,'
        f'{base64.b64encode(images[name]).decode()}"><figcaption><b>{html.escape(name)}</b>: '
        f"{html.escape(caption)}</figcaption></figure>" for name, caption in figures)
    layers = sorted(last["layers"], key=lambda n: (str(type(block_index(n))), block_index(n)))
    ordered = {**last, "layers": {n: last["layers"][n] for n in layers}}
    glossary = "".join(f"<li><b>{html.escape(k)}</b>: {html.escape(v)}</li>" for k, v in GLOSSARY)
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<meta name="viewport" content="width=device-width, initial-scale=1"><style>{CSS}</style></head>
<body>
<h1>{html.escape(title)}</h1>
{_inputs(analysis)}
{_steps(analysis)}
<h2>Per MoE layer: {html.escape(last['label'])}</h2>
{_table(LAYER_HEADER, layer_rows(ordered))}
<h2>Per source: {html.escape(last['label'])}</h2>
{_per_source(last)}
<h2>Figures</h2>
{figure_html}
<h2>What the numbers mean</h2>
<ul class="note">{glossary}</ul>
<p class="note">Every number is in analysis.json next to this file. Metrics: docs/methods.md §5 of the upcycle docs.</p>
</body></html>
"""
