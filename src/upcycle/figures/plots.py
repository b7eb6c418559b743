"""PNG figures of an analysis (the dict `upcycle analyze` writes as analysis.json), one style for all of them.

  layers.png          per MoE layer: weight similarity per projection and diversity, output similarity, routing
                      entropy / log E, load CoV, relative compactness, specialization (NMI) against its baseline
  similarity.png      E x E matrices (gate, up, down weights; outputs) of up to three layers (first, middle, last)
  utilization.png     layers x experts: share of token-slots, and mean router probability when chosen
  specialization.png  E x sources share matrices of the same layers (which sources each expert serves)
  router_probs.png    per-expert histograms of the router probability (DPSL's figures), same layers
  simplex.png         for three experts: each token's router probabilities on the 2-simplex
  steps.png           for a training run: the layer means of the metrics over the steps
  training.png        for a training run: its log's curves (loss, regularizers, held-out metric, learning rate,
                      per-layer routing entropy and load CoV, tokens/s, gradient norm; `upcycle.analyze.curves`)

Figures read only the dict, so they can be redrawn from a saved analysis.json. matplotlib is imported here
alone (the metrics do not need it).
"""

from __future__ import annotations

import math
from pathlib import Path

STYLE = {"figure.dpi": 100, "savefig.dpi": 100, "font.size": 9, "axes.titlesize": 9.5, "axes.labelsize": 9,
         "legend.fontsize": 8, "axes.grid": True, "grid.alpha": 0.3, "axes.spines.top": False,
         "axes.spines.right": False}
WIDTH = 10.0                                  # inches at 100 dpi: 1000 px, a page's width
PROJECTION_COLORS = {"gate": "#1f77b4", "up": "#ff7f0e", "down": "#2ca02c", "all": "#444444"}
MATRIX_CMAP = "viridis"
SHARE_CMAP = "magma"


def _margins(fig, *, left: float = 0.55, right: float = 0.2, top: float = 0.4, bottom: float = 0.5,
             wspace: float = 0.3, hspace: float = 0.5) -> None:
    """Fixed margins in inches (a layout engine would draw every figure twice to measure its text: half the
    time of writing the figures)."""
    w, h = fig.get_size_inches()
    fig.subplots_adjust(left=left / w, right=1 - right / w, top=1 - top / h, bottom=bottom / h, wspace=wspace,
                        hspace=hspace)


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def block_index(name: str) -> int | str:
    """The block number in a layer name (model.layers.7.mlp -> 7), else the name."""
    numbers = [part for part in name.split(".") if part.isdigit()]
    return int(numbers[-1]) if numbers else name


def picked_layers(names: list[str]) -> list[str]:
    """Up to three layers to draw in detail: all of them, or the first, middle and last."""
    return list(names) if len(names) <= 3 else [names[0], names[len(names) // 2], names[-1]]


def _value(x):
    return math.nan if x is None else x


def _layer_axis(ax, layers: dict) -> list:
    xs = [block_index(n) for n in layers]
    if not all(isinstance(x, int) for x in xs):
        xs = list(range(len(layers)))
    ax.set_xlabel("block")
    return xs


def layer_title(name: str) -> str:
    index = block_index(name)
    return f"block {index}" if isinstance(index, int) else name


def _annotate(ax, image, matrix, fmt: str = "{:.2f}") -> None:
    """The value in each cell, dark on light cells and light on dark ones (small matrices only)."""
    for i, row in enumerate(matrix):
        for j, value in enumerate(row):
            if value is None or (isinstance(value, float) and math.isnan(value)):
                continue
            r, g, b, _ = image.cmap(image.norm(value))
            ax.text(j, i, fmt.format(value), ha="center", va="center", fontsize=7,
                    color="black" if 0.299 * r + 0.587 * g + 0.114 * b > 0.5 else "white")


def _matrix(ax, matrix, title: str, cmap: str = MATRIX_CMAP, vmin=None, vmax=None, xlabels=None,
            annotate: bool = False):
    """An expert x expert heat map (a caller names other axes with ax.set_xlabel / set_ylabel)."""
    image = ax.imshow(matrix, cmap=cmap, vmin=vmin, vmax=vmax, aspect="auto")
    ax.set_title(title)
    ax.set_ylabel("expert")
    ax.set_xlabel("expert")
    ax.grid(False)
    if xlabels is not None:
        ax.set_xticks(range(len(xlabels)), xlabels, rotation=30, ha="right")
    if annotate:
        _annotate(ax, image, matrix)
    return image


def layers_figure(snapshot: dict, path: Path) -> None:
    plt = _plt()
    layers = snapshot["layers"]
    with plt.rc_context(STYLE):
        fig, axes = plt.subplots(2, 3, figsize=(WIDTH, 5.6))
        _margins(fig, wspace=0.25, hspace=0.45)
        ax = axes[0, 0]
        xs = _layer_axis(ax, layers)
        for proj, color in PROJECTION_COLORS.items():
            values = [_value(m["weight_similarity"].get(proj, {}).get("mean")) for m in layers.values()]
            if not all(math.isnan(v) for v in values):
                ax.plot(xs, values, "o-", ms=3, color=color, label=f"similarity {proj}")
        ax.plot(xs, [_value(m["diversity"]) for m in layers.values()], "s--", ms=3, color="#d62728",
                label="diversity (1 - cos down)")
        ax.set(title="expert weights", ylim=(-0.05, 1.05))
        ax.legend(loc="best")
        ax = axes[0, 1]
        _layer_axis(ax, layers)
        ax.plot(xs, [_value(m["output_similarity"]["mean"]) for m in layers.values()], "o-", ms=3, color="#9467bd")
        ax.set(title="expert output similarity (mean cos)", ylim=(-0.05, 1.05))
        ax = axes[0, 2]
        _layer_axis(ax, layers)
        ax.plot(xs, [m["routing_entropy"] / math.log(m["num_experts"]) if m["num_experts"] > 1 else math.nan
                     for m in layers.values()], "o-", ms=3, color="#17becf")
        ax.set(title="routing entropy / log E (1 = uniform)", ylim=(-0.05, 1.05))
        ax = axes[1, 0]
        _layer_axis(ax, layers)
        ax.plot(xs, [m["load_cov"] for m in layers.values()], "o-", ms=3, color="#8c564b")
        ax.set(title="load CoV (0 = balanced)")
        ax = axes[1, 1]
        _layer_axis(ax, layers)
        rc = [_value(m["relative_compactness"]) for m in layers.values()]
        ax.plot(xs, rc, "o-", ms=3, color="#e377c2")
        if any(v > 0 for v in rc if not math.isnan(v)):
            ax.set_yscale("log")
        ax.set(title="relative compactness Tr(Σ_W Σ_B⁺) (lower = separated)")
        ax = axes[1, 2]
        _layer_axis(ax, layers)
        if all("specialization" in m for m in layers.values()):
            spec = [m["specialization"] for m in layers.values()]
            ax.plot(xs, [s["nmi"] for s in spec], "o-", ms=3, color="#bcbd22", label="I(source; top-1) / H(source)")
            ax.fill_between(xs, 0, [s["nmi_baseline"]["max"] for s in spec], color="#7f7f7f", alpha=0.35,
                            label="shuffled sources (max)")
            ax.legend(loc="best")
        ax.set(title="specialization by source", ylim=(0, None))
        fig.savefig(path)
        plt.close(fig)


def similarity_figure(snapshot: dict, path: Path) -> None:
    """One colour scale for every panel, from the lowest off-diagonal cosine (rounded down to 0.1, at most 0.9)
    to 1, so that the panels compare at a glance; each title carries the mean over the pairs."""
    plt = _plt()
    names = picked_layers(list(snapshot["layers"]))
    kinds = ["gate", "up", "down", "output"]
    entries = {(name, kind): (snapshot["layers"][name]["output_similarity"] if kind == "output"
                              else snapshot["layers"][name]["weight_similarity"].get(kind))
               for name in names for kind in kinds}
    off = [v for e in entries.values() if e is not None for i, row in enumerate(e["matrix"])
           for j, v in enumerate(row) if i != j]
    low = min(0.9, math.floor(10 * min(off)) / 10) if off else 0.0
    with plt.rc_context(STYLE):
        fig, axes = plt.subplots(len(names), 4, figsize=(WIDTH, 2.4 * len(names) + 0.3), squeeze=False)
        _margins(fig, left=0.8, wspace=0.45, hspace=0.6)
        image = None
        for row, name in enumerate(names):
            for col, kind in enumerate(kinds):
                ax, entry = axes[row, col], entries[(name, kind)]
                if entry is None:
                    ax.set_axis_off()
                    continue
                what = "outputs" if kind == "output" else f"{kind} weights"
                mean = "" if entry["mean"] is None else f" (mean {entry['mean']:.3f})"
                image = _matrix(ax, entry["matrix"], what + mean, vmin=low, vmax=1.0,
                                annotate=len(entry["matrix"]) <= 4)
                if col == 0:
                    ax.set_ylabel(f"{layer_title(name)}\nexpert")
        if image is not None:
            fig.colorbar(image, ax=axes, shrink=0.6, label="cosine similarity")
        fig.savefig(path)
        plt.close(fig)


def utilization_figure(snapshot: dict, path: Path) -> None:
    plt = _plt()
    layers = snapshot["layers"]
    labels = [str(block_index(n)) for n in layers]
    load = [m["router_load"] for m in layers.values()]
    prob = [[_value(p) for p in m["expert_routing_probability"]] for m in layers.values()]
    with plt.rc_context(STYLE):
        fig, axes = plt.subplots(1, 2, figsize=(WIDTH, 0.28 * len(labels) + 1.6))
        _margins(fig, wspace=0.2)
        for ax, matrix, title in ((axes[0], load, "share of token-slots per expert (uniform = 1/E)"),
                                  (axes[1], prob, "mean router probability when chosen")):
            image = _matrix(ax, matrix, title, vmin=0, annotate=len(matrix) * len(matrix[0]) <= 64)
            ax.set_ylabel("block")
            ax.set_yticks(range(len(labels)), labels)
            fig.colorbar(image, ax=ax, shrink=0.8)
        fig.savefig(path)
        plt.close(fig)


def specialization_figure(snapshot: dict, path: Path) -> None:
    plt = _plt()
    names = picked_layers(list(snapshot["layers"]))
    with plt.rc_context(STYLE):
        fig, axes = plt.subplots(1, len(names), figsize=(WIDTH, 3.6), squeeze=False)
        _margins(fig, top=0.55, bottom=0.8, wspace=0.3)
        for ax, name in zip(axes[0], names, strict=True):
            spec = snapshot["layers"][name]["specialization"]
            title = f"{layer_title(name)}\nNMI {spec['nmi']:.3f} (shuffled max {spec['nmi_baseline']['max']:.3f})"
            image = _matrix(ax, spec["expert_source_share"], title, cmap=SHARE_CMAP, vmin=0, vmax=1,
                            xlabels=spec["sources"], annotate=len(spec["expert_source_share"]) <= 16)
            ax.set_xlabel("source")
        fig.colorbar(image, ax=axes, shrink=0.7, label="share of the expert's token-slots")
        fig.savefig(path)
        plt.close(fig)


def router_probability_figure(snapshot: dict, path: Path) -> None:
    plt = _plt()
    names = picked_layers(list(snapshot["layers"]))
    with plt.rc_context(STYLE):
        fig, axes = plt.subplots(1, len(names), figsize=(WIDTH, 3.4), squeeze=False)
        _margins(fig, left=0.65, top=0.65, wspace=0.35)
        for ax, name in zip(axes[0], names, strict=True):
            m = snapshot["layers"][name]
            h = m["probability_histograms"]
            centres = [(a + b) / 2 for a, b in zip(h["edges"][:-1], h["edges"][1:], strict=True)]
            cmap = plt.get_cmap("tab10" if m["num_experts"] <= 10 else "tab20")
            for e, counts in enumerate(h["counts"]):
                total = max(sum(counts), 1)
                ax.step(centres, [c / total for c in counts], where="mid", color=cmap(e % cmap.N), lw=1.2,
                        label=f"expert {e}")
            ax.axvline(1 / m["num_experts"], color="black", ls=":", lw=1)
            ax.set(title=f"{layer_title(name)}: router probability per expert", xlabel="g_e(x)",
                   ylabel="fraction of tokens", xlim=(0, h["edges"][-1]), ylim=(0, None))
        handles, labels = axes[0, 0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="upper center", ncol=min(len(labels), 8), frameon=False)
        fig.savefig(path)
        plt.close(fig)


def simplex_figure(snapshot: dict, path: Path) -> None:
    plt = _plt()
    names = [n for n in picked_layers(list(snapshot["layers"])) if "simplex" in snapshot["layers"][n]]
    corners = [(0.0, 0.0), (1.0, 0.0), (0.5, math.sqrt(3) / 2)]
    with plt.rc_context(STYLE):
        fig, axes = plt.subplots(1, len(names), figsize=(WIDTH, 3.4), squeeze=False)
        _margins(fig, left=0.2, bottom=0.3, wspace=0.1)
        for ax, name in zip(axes[0], names, strict=True):
            points = snapshot["layers"][name]["simplex"]
            xs = [sum(p[i] * corners[i][0] for i in range(3)) for p in points]
            ys = [sum(p[i] * corners[i][1] for i in range(3)) for p in points]
            ax.plot(*zip(*(corners + corners[:1]), strict=True), color="black", lw=1)
            ax.scatter(xs, ys, s=3, alpha=0.35, color="#1f77b4")
            for i, (cx, cy) in enumerate(corners):
                ax.annotate(f"expert {i}", (cx, cy), ha="center", va="bottom" if i == 2 else "top", fontsize=8)
            ax.set_aspect("equal")
            ax.set_axis_off()
            ax.set_title(f"{layer_title(name)}: router probabilities")
        fig.savefig(path)
        plt.close(fig)


def _mean(values) -> float:
    values = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return sum(values) / len(values) if values else math.nan


def layer_means(snapshot: dict) -> dict:
    """Means over the MoE layers of the headline metrics of one snapshot (the curves over steps, the report)."""
    layers = list(snapshot["layers"].values())
    out = {f"similarity_{p}": _mean([m["weight_similarity"].get(p, {}).get("mean") for m in layers])
           for p in ("gate", "up", "down", "all")}
    out["diversity"] = _mean([m["diversity"] for m in layers])
    out["output_similarity"] = _mean([m["output_similarity"]["mean"] for m in layers])
    out["entropy_ratio"] = _mean([m["routing_entropy"] / math.log(m["num_experts"]) for m in layers
                                  if m["num_experts"] > 1])
    out["load_cov"] = _mean([m["load_cov"] for m in layers])
    out["relative_compactness"] = _mean([m["relative_compactness"] for m in layers])
    if all("specialization" in m for m in layers):
        out["nmi"] = _mean([m["specialization"]["nmi"] for m in layers])
        out["nmi_baseline_max"] = _mean([m["specialization"]["nmi_baseline"]["max"] for m in layers])
    out["kl_to_dense"] = (snapshot.get("kl_to_dense") or {}).get("all")
    out["nll"] = (snapshot.get("nll") or {}).get("all")
    out["embedding_cosine_to_dense"] = (snapshot.get("embedding_cosine_to_dense") or {}).get("all")
    return out


def is_embedding_analysis(snapshots: list[dict]) -> bool:
    """An encoder's analysis measures the embeddings' cosine to the dense encoder, not NLL or KL (it has no
    next-token distribution): its panels and columns show that instead of empty ones."""
    return any(s.get("embedding_cosine_to_dense") for s in snapshots)


def steps_figure(snapshots: list[dict], path: Path) -> None:
    plt = _plt()
    steps = [s["step"] for s in snapshots]
    means = [layer_means(s) for s in snapshots]

    def series(key):
        return [_value(m.get(key)) for m in means]

    with plt.rc_context(STYLE):
        fig, axes = plt.subplots(2, 4, figsize=(WIDTH, 4.8))
        _margins(fig, wspace=0.35, hspace=0.5)
        ax = axes[0, 0]
        for proj in ("gate", "up", "down"):
            ax.plot(steps, series(f"similarity_{proj}"), "o-", ms=3, color=PROJECTION_COLORS[proj], label=proj)
        ax.set(title="weight similarity (layer mean)", ylim=(-0.05, 1.05))
        ax.legend()
        panels = [(axes[0, 1], "diversity", "diversity"), (axes[0, 2], "output_similarity", "output similarity"),
                  (axes[0, 3], "entropy_ratio", "routing entropy / log E"), (axes[1, 0], "load_cov", "load CoV"),
                  (axes[1, 1], "relative_compactness", "relative compactness"),
                  (axes[1, 3], "embedding_cosine_to_dense", "embedding cosine to dense (mean)")
                  if is_embedding_analysis(snapshots) else (axes[1, 3], "kl_to_dense", "KL(dense ‖ model), nats/token")]
        bounded = {"diversity", "output_similarity", "entropy_ratio"}     # in [0, 1]: drawn on [0, 1], like
        for ax, key, title in panels:                                     # layers.png (exact values: the table)
            ax.plot(steps, series(key), "o-", ms=3, color="#333333")
            ax.set(title=title)
            if key in bounded:
                ax.set_ylim(-0.05, 1.05)
            else:
                ax.ticklabel_format(axis="y", useOffset=False)
        ax = axes[1, 2]
        if "nmi" in means[0]:
            ax.plot(steps, series("nmi"), "o-", ms=3, color="#bcbd22", label="NMI")
            ax.fill_between(steps, 0, series("nmi_baseline_max"), color="#7f7f7f", alpha=0.35, label="shuffled max")
            ax.legend()
        ax.set(title="specialization by source", ylim=(0, None))
        for ax in axes.flat:
            ax.set_xlabel("step")
        fig.savefig(path)
        plt.close(fig)


# held-out results that are counts, not curves worth a panel
EVAL_COUNTS = ("tokens", "pairs", "distinct_captions", "zero_shot/classes")


def _points(xs: list, ys: list) -> tuple[list, list]:
    """The (x, y) pairs whose y was logged (a null is a step without that value, not a zero)."""
    kept = [(x, y) for x, y in zip(xs, ys, strict=True) if y is not None]
    return [x for x, _ in kept], [y for _, y in kept]


def _per_layer(ax, steps: list, routing: dict, stat: str) -> None:
    """One thin line per MoE layer and their mean in black."""
    cmap = _plt().get_cmap("viridis")
    names = list(routing)
    for i, name in enumerate(names):
        ax.plot(*_points(steps, routing[name][stat]), lw=0.8, alpha=0.7, color=cmap(i / max(1, len(names) - 1)),
                label=layer_title(name) if len(names) <= 6 else None)
    means = [_mean([routing[n][stat][i] for n in names]) for i in range(len(steps))]
    ax.plot(*_points(steps, [None if math.isnan(m) else m for m in means]), lw=1.6, color="black", label="mean")
    ax.legend(ncol=2, fontsize=7, loc="best", framealpha=0.6)


def training_figure(curves: dict, path: Path) -> None:
    """A training run's curves over its steps (the dict `upcycle.analyze.curves.run_curves` reads from log.jsonl)."""
    plt = _plt()
    steps = curves["steps"]
    with plt.rc_context(STYLE):
        fig, axes = plt.subplots(2, 4, figsize=(WIDTH, 5.0))
        _margins(fig, left=0.6, wspace=0.4, hspace=0.55)
        ax = axes[0, 0]
        for term, color in (("total", "#333333"), ("task", "#1f77b4")):
            if term in curves["loss"]:
                ax.plot(*_points(steps, curves["loss"][term]), lw=1.2, color=color, label=term)
        for step in curves["skipped"]:
            ax.axvline(step, color="#d62728", lw=0.8, alpha=0.6)
        ax.set(title="training loss" + (" (red: skipped steps)" if curves["skipped"] else ""))
        ax.legend()
        ax = axes[0, 1]
        regularizers = {t: v for t, v in curves["loss"].items() if t not in ("total", "task")}
        for term, values in regularizers.items():
            ax.plot(*_points(steps, values), lw=1.2, label=term)
        if regularizers:
            ax.legend(fontsize=7, loc="best", framealpha=0.6)
            values = [v for series in regularizers.values() for v in series if v is not None]
            if values and min(values) > 0 and max(values) > 10 * min(values):
                ax.set_yscale("log")       # load balance near 1, z-loss near 1e-3: one axis shows both
        ax.set(title="regularizers (unweighted)")
        ax = axes[0, 2]
        evals, metrics = curves["eval"]["steps"], curves["eval"]["metrics"]
        shown = ["perplexity"] if "perplexity" in metrics else [m for m in metrics if m not in EVAL_COUNTS]
        for name in shown:
            ax.plot(*_points(evals, metrics[name]), "o-", ms=4, label=name)
        if len(shown) > 1:
            ax.legend()
        ax.set(title="held-out " + ("perplexity" if shown == ["perplexity"] else "metrics"))
        ax = axes[0, 3]
        ax.plot(*_points(steps, curves["lr"]), color="#2ca02c")
        ax.set(title="learning rate")
        ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
        if curves["routing"]:
            _per_layer(axes[1, 0], steps, curves["routing"], "entropy")
            _per_layer(axes[1, 1], steps, curves["routing"], "load_cov")
        axes[1, 0].set(title="routing entropy (nats)")
        axes[1, 1].set(title="load CoV over experts")
        ax = axes[1, 2]
        ax.plot(*_points(steps, curves["tokens_per_s"]), color="#8c564b")
        ax.set(title="tokens/s", ylim=(0, None))
        ax = axes[1, 3]
        ax.plot(*_points(steps, curves["grad_norm"]), color="#9467bd")
        ax.set(title="gradient norm (before clipping)")
        for ax in axes.flat:
            ax.set_xlabel("step")
        fig.savefig(path)
        plt.close(fig)


FIGURES = (("layers.png", "Per MoE layer: expert weight similarity per projection and diversity; expert output "
            "similarity; routing entropy over its maximum log E; load CoV; relative compactness; specialization "
            "by source against the shuffled-source baseline (grey)."),
           ("similarity.png", "E x E cosine similarity of the experts' gate, up and down weights and of their "
            "outputs on the same tokens, for the first, middle and last MoE layer."),
           ("utilization.png", "Per layer and expert: share of the token-slots, and the mean router probability "
            "of the tokens that chose the expert."),
           ("specialization.png", "Which sources each expert serves: share of each expert's token-slots per "
            "source (rows sum to 1), with NMI and its shuffled baseline."),
           ("router_probs.png", "Histogram of each expert's router probability over all tokens (the dotted "
            "line is 1/E, where an unspecialized router puts every expert)."),
           ("simplex.png", "Three experts: each token's router probabilities as a point of the simplex."))


def write_figures(analysis: dict, folder: Path) -> list[tuple[str, str]]:
    """Draw every figure that applies into `folder`; [(file name, caption)] in reading order. Per-layer figures
    show the last snapshot (the trained model of a run); a run with several snapshots adds steps.png first."""
    snapshots = analysis["snapshots"]
    last = snapshots[-1]
    drawn = []
    if analysis.get("training") and analysis["training"]["steps"]:
        training_figure(analysis["training"], folder / "training.png")
        drawn.append(("training.png", "The run's log (log.jsonl) over its steps: training loss, each regularizer "
                                      "unweighted, the held-out evaluations, learning rate, per-layer routing "
                                      "entropy and load CoV (black: their mean), tokens/s and gradient norm."))
    steps = [s for s in snapshots if s["step"] is not None]
    if len(steps) >= 2:
        steps_figure(steps, folder / "steps.png")
        drawn.append(("steps.png", "Over training: the layer means of the metrics at each checkpoint (step 0 = "
                                   "the upcycled model the run started from)."))
    has_sources = all("specialization" in m for m in last["layers"].values())
    has_simplex = any("simplex" in m for m in last["layers"].values())
    draw = {"layers.png": layers_figure, "similarity.png": similarity_figure, "utilization.png": utilization_figure,
            "specialization.png": specialization_figure, "router_probs.png": router_probability_figure,
            "simplex.png": simplex_figure}
    for name, caption in FIGURES:
        if (name == "specialization.png" and not has_sources) or (name == "simplex.png" and not has_simplex):
            continue
        draw[name](last, folder / name)
        drawn.append((name, caption))
    return drawn
