"""The comparison's figures, drawn from the cells' JSON alone (so they can be redrawn from comparison.json):

  metric_over_steps.png   the held-out metric at every evaluation of the runs, per (method, EESD): the mean over
                          seeds as a line, the seeds' range as a band; the dense-continued baseline dashed
  init_diagnostics.png    what each method starts from: the held-out metric right after conversion, the mean
                          expert similarity and the routing entropy / log E at init (bars: mean over seeds, dots:
                          each seed)
"""

from __future__ import annotations

from pathlib import Path

from ..figures.plots import STYLE
from .request import DENSE
from .table import METRICS, metric, row_key


def _label(key: tuple[str, str]) -> str:
    method, eesd = key
    return "dense (continued)" if method == DENSE else (method if eesd == "none" else f"{method} + EESD {eesd}")


def write_figures(cells: list[dict], table: list[dict], task: str, out: Path) -> list[str]:
    """Write the PNGs into `out`; their file names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    _, label, path = METRICS[task][0]
    keys = [(row["method"], row["eesd"]) for row in table]
    colors = {k: plt.get_cmap("tab10")(i % 10) for i, k in enumerate(k for k in keys if k[0] != DENSE)}
    colors |= {k: "black" for k in keys if k[0] == DENSE}
    names = []
    with plt.rc_context(STYLE):
        fig, ax = plt.subplots(figsize=(7.5, 4.2))
        for key in keys:
            members = [c for c in cells if row_key(c) == key]
            steps = sorted({e["step"] for c in members for e in c["evals"]})
            series = [[_value(c, s, path) for c in members] for s in steps]
            kept = [(s, [v for v in vals if v is not None]) for s, vals in zip(steps, series, strict=True)]
            kept = [(s, vals) for s, vals in kept if vals]
            if not kept:
                continue
            xs = [s for s, _ in kept]
            ax.plot(xs, [sum(v) / len(v) for _, v in kept], marker="o", ms=3, color=colors[key],
                    ls="--" if key[0] == DENSE else "-", label=f"{_label(key)} (n={len(members)})")
            ax.fill_between(xs, [min(v) for _, v in kept], [max(v) for _, v in kept], color=colors[key], alpha=0.15,
                            lw=0)
        ax.set_xlabel("training step (0 = right after conversion)")
        ax.set_ylabel(f"held-out {label}")
        plotted = [v for line in ax.get_lines() for v in line.get_ydata()]
        if METRICS[task][0][0] == "perplexity" and plotted and max(plotted) > 10 * min(plotted):
            # a perplexity of 700 beside 25 would flatten every other line
            ax.set_yscale("log")
            ax.set_ylabel(f"held-out {label} (log scale)")
        ax.set_title(f"Held-out {label} over training (line: mean over seeds; band: range)")
        ax.legend(loc="best", ncol=2)
        fig.tight_layout()
        fig.savefig(out / "metric_over_steps.png")
        plt.close(fig)
        names.append("metric_over_steps.png")

        panels = [(f"{label}\nright after conversion", lambda c: _value(c, 0, path), True),
                  ("expert similarity at init\n(mean pairwise weight cosine)",
                   lambda c: _diag(c, "expert_similarity"), False),
                  ("routing entropy / log E at init", lambda c: _diag(c, "entropy_ratio"), False)]
        fig, axes = plt.subplots(1, 3, figsize=(10, 0.9 + 0.38 * len(keys)), sharey=True)
        for ax, (title, read, with_dense) in zip(axes, panels, strict=True):
            for y, key in enumerate(keys):
                if key[0] == DENSE and not with_dense:
                    continue
                values = [v for v in (read(c) for c in cells if row_key(c) == key) if v is not None]
                if not values:
                    continue
                ax.barh(y, sum(values) / len(values), color=colors[key], alpha=0.5, height=0.7)
                ax.plot(values, [y] * len(values), "o", color=colors[key], ms=3.5)
            ax.set_title(title)
        axes[0].set_yticks(range(len(keys)), [_label(k) for k in keys])
        axes[0].invert_yaxis()
        fig.tight_layout()
        fig.savefig(out / "init_diagnostics.png")
        plt.close(fig)
        names.append("init_diagnostics.png")
    return names


def _value(cell: dict, step: int, path: tuple[str, ...]) -> float | None:
    evaluation = next((e for e in cell["evals"] if e["step"] == step), None)
    return metric(evaluation, path)


def _diag(cell: dict, scalar: str) -> float | None:
    init = cell["diagnostics"]["init"]
    return None if init is None else init["mean"].get(scalar)
