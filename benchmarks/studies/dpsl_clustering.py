"""DPSL on unsupervised clustering: a miniature of Table 1 of "Dirichlet-Prior Shaping: Guiding Expert
Specialization in Upcycled MoEs" (docs/methods.md §4.4: DPSL is a loss for any categorical head, not only routers).

Data: 2-D synthetic clusters, K = 3, in three regimes like the paper's (`REGIMES`): well separated with
proportions 4:1:1, overlapping, and elongated (long parallel stripes). Points are standardized per run.

Model: a soft-assignment head in the style of SwAV (Caron et al., "Unsupervised Learning of Visual Features by
Contrasting Cluster Assignments", 2020): an MLP 2 -> 64 -> 64 -> 16, L2-normalized, scored against K unit-norm
prototypes, logits = cosine / tau (tau = 0.1), p = softmax(logits). Written here from the paper's description.

Objective: swapped prediction. Two views of each point (additive Gaussian jitter, sigma = `AUG_SIGMA` in
standardized units); the target codes q of one view train the prediction p of the other:

    L_swap = - 1/B sum_b [ q2_b . log p1_b + q1_b . log p2_b ]

with the codes computed without gradient in one of two ways (`TARGETS`):

  sinkhorn  SwAV's codes: Sinkhorn-Knopp on exp(logits / eps), eps = 0.05, 3 iterations, which makes every
            cluster take an equal share (1/K) of the batch (equipartition; SwAV's defence against collapse)
  swap      the other view's own assignment, softmax(logits / 0.5) (sharpened, no equipartition): nothing in
            the objective stops every point going to one cluster

DPSL (the project's own `upcycle.training.loss.dpsl.dpsl`, docs/methods.md §4.4) is added on the assignment
probabilities of both views, [2B, K], against a symmetric Dir(alpha), alpha = 1 by default:
L = L_swap + lambda * L_DPS, during a window [start, end) of the training steps. The paper's recipe, "late in
training, lambda = 0.01", is read here as lambda = 0.01 over the last quarter of the steps (where "late" starts
is our choice); `CONFIGS` adds the stronger weights and longer windows that do change the outcome. Every run is
reported with its schedule.

Metric: clustering accuracy of argmax p on the clean points, after matching predicted to true clusters
one-to-one (Hungarian, scipy.optimize.linear_sum_assignment). k-means (scipy.cluster.vq.kmeans2, best of 10
inits) on the same standardized points is given as a reference.

Run: .venv/bin/python benchmarks/studies/dpsl_clustering.py -> benchmarks/results/dpsl_clustering.json and .png
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment

from upcycle.machine import machine
from upcycle.training.loss.dpsl import dpsl

RESULTS = Path(__file__).parents[1] / "results"
K = 3
TARGETS = ("sinkhorn", "swap")
AUG_SIGMA = 0.1


# ----------------------------------------------------------------------------------------------------- data
@dataclass(frozen=True)
class Regime:
    """K Gaussian clusters: centres [K, 2], per-cluster standard deviations along (x, y), and proportions."""
    centres: tuple[tuple[float, float], ...]
    scale: tuple[float, float]
    proportions: tuple[float, ...]


REGIMES = {
    # far apart (centre distance 5.2, sigma 0.5): trivially separable, but one cluster holds 2/3 of the points
    "imbalanced_4_1_1": Regime(centres=((0.0, 3.0), (-2.6, -1.5), (2.6, -1.5)), scale=(0.5, 0.5),
                               proportions=(4.0, 1.0, 1.0)),
    # balanced, centre distance 2.6 with sigma 1: the clusters overlap (Bayes accuracy about 0.86)
    "overlapping": Regime(centres=((0.0, 1.5), (-1.3, -0.75), (1.3, -0.75)), scale=(1.0, 1.0),
                          proportions=(1.0, 1.0, 1.0)),
    # balanced parallel stripes, 8 sigma long and 2.5 (short-axis) sigma apart: the true clusters are far
    # longer than the gaps between them, so distance to a centre (k-means) cuts across them
    "elongated": Regime(centres=((0.0, -1.0), (0.0, 0.0), (0.0, 1.0)), scale=(4.0, 0.2),
                        proportions=(1.0, 1.0, 1.0)),
}


def cluster_sizes(proportions: tuple[float, ...], n: int) -> list[int]:
    """n points split in these proportions (largest remainders, so the sizes sum to n exactly)."""
    share = np.asarray(proportions, dtype=float) / sum(proportions) * n
    sizes = np.floor(share).astype(int)
    sizes[np.argsort(sizes - share)[: n - sizes.sum()]] += 1
    return sizes.tolist()


def make_data(regime: Regime, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(points [n, 2] float32 standardized per axis, true labels [n]) for one regime and seed."""
    rng = np.random.default_rng(seed)
    parts, labels = [], []
    for k, size in enumerate(cluster_sizes(regime.proportions, n)):
        parts.append(rng.normal(regime.centres[k], regime.scale, size=(size, 2)))
        labels.append(np.full(size, k))
    x, y = np.concatenate(parts), np.concatenate(labels)
    x = (x - x.mean(0)) / x.std(0)
    return x.astype(np.float32), y


def hungarian_accuracy(pred: np.ndarray, true: np.ndarray) -> float:
    """Accuracy after the one-to-one relabelling of predicted clusters that maximizes agreement."""
    pred, true = np.asarray(pred), np.asarray(true)
    n = max(pred.max(), true.max()) + 1
    counts = np.zeros((n, n), dtype=np.int64)
    np.add.at(counts, (pred, true), 1)
    rows, cols = linear_sum_assignment(counts, maximize=True)
    return float(counts[rows, cols].sum() / len(true))


# ---------------------------------------------------------------------------------------------------- model
class AssignmentHead(torch.nn.Module):
    """MLP embedding, L2-normalized, scored against K unit-norm prototypes (SwAV's head, in 2-D)."""

    def __init__(self, k: int = K, width: int = 64, dim: int = 16, tau: float = 0.1) -> None:
        super().__init__()
        self.trunk = torch.nn.Sequential(torch.nn.Linear(2, width), torch.nn.ReLU(), torch.nn.Linear(width, width),
                                         torch.nn.ReLU(), torch.nn.Linear(width, dim))
        self.prototypes = torch.nn.Parameter(torch.randn(k, dim))
        self.tau = tau

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = torch.nn.functional.normalize(self.trunk(x), dim=-1)
        c = torch.nn.functional.normalize(self.prototypes, dim=-1)
        return z @ c.T    # cosine scores [B, K]; the logits are scores / tau, Sinkhorn works on the scores


@torch.no_grad()
def sinkhorn(scores_BK: torch.Tensor, eps: float = 0.05, iterations: int = 3) -> torch.Tensor:
    """SwAV's codes: the transport plan between the B points (mass 1/B each) and the K clusters (mass 1/K each)
    closest to exp(scores / eps), by alternating row and column normalizations; rows returned summing to 1.
    `scores` are cosines in [-1, 1], so exp(+-1 / 0.05) stays finite in float32."""
    q = torch.exp((scores_BK - scores_BK.max()) / eps).T          # [K, B]; the shift cancels in the normalizations
    q /= q.sum()
    K_, B = q.shape
    for _ in range(iterations):
        q /= q.sum(dim=1, keepdim=True) * K_                      # each cluster: 1/K of the mass
        q /= q.sum(dim=0, keepdim=True) * B                       # each point: 1/B
    return (q * B).T


@dataclass(frozen=True)
class Setting:
    targets: str = "sinkhorn"
    dpsl_lambda: float = 0.0
    dpsl_alpha: float = 1.0
    dpsl_start: float = 0.0      # fractions of the training steps: DPSL is on for steps in [start, end)
    dpsl_end: float = 1.0
    steps: int = 1000
    batch: int = 256
    lr: float = 1e-3


def train(x: np.ndarray, setting: Setting, seed: int) -> tuple[np.ndarray, dict]:
    """Train one head; returns (predicted cluster of every clean point, a few diagnostics)."""
    if setting.targets not in TARGETS:
        raise ValueError(f"targets must be one of {TARGETS}, got {setting.targets!r}")
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    data = torch.from_numpy(x)
    head = AssignmentHead()
    opt = torch.optim.Adam(head.parameters(), lr=setting.lr)
    on = range(int(setting.dpsl_start * setting.steps), int(setting.dpsl_end * setting.steps))
    last_dpsl = None
    for step in range(setting.steps):
        batch = data[torch.randint(len(data), (setting.batch,), generator=g)]
        v1 = batch + AUG_SIGMA * torch.randn(batch.shape, generator=g)
        v2 = batch + AUG_SIGMA * torch.randn(batch.shape, generator=g)
        s1, s2 = head(v1), head(v2)
        l1, l2 = s1 / head.tau, s2 / head.tau
        if setting.targets == "sinkhorn":
            q1, q2 = sinkhorn(s1.detach()), sinkhorn(s2.detach())
        else:
            q1, q2 = (l1.detach() / 0.5).softmax(-1), (l2.detach() / 0.5).softmax(-1)
        logp1, logp2 = l1.log_softmax(-1), l2.log_softmax(-1)
        loss = -((q2 * logp1).sum(-1) + (q1 * logp2).sum(-1)).mean()
        if setting.dpsl_lambda > 0 and step in on:
            shaping = dpsl(torch.cat([logp1, logp2]).exp(), setting.dpsl_alpha)
            loss = loss + setting.dpsl_lambda * shaping
            last_dpsl = shaping.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        p = (head(data) / head.tau).softmax(-1)
    pred = p.argmax(-1).numpy()
    return pred, {"cluster_shares": np.bincount(pred, minlength=K).tolist(),
                  "mean_max_probability": float(p.max(-1).values.mean()),
                  "dpsl_at_last_shaped_step": last_dpsl,
                  "dpsl_at_end": float(dpsl(p.double(), setting.dpsl_alpha))}


def kmeans_accuracy(x: np.ndarray, y: np.ndarray, seed: int) -> float:
    from scipy.cluster.vq import kmeans2

    best = None
    for i in range(10):
        centres, labels = kmeans2(x.astype(np.float64), K, minit="++", seed=seed * 100 + i)
        inertia = ((x - centres[labels]) ** 2).sum()
        if best is None or inertia < best[0]:
            best = (inertia, labels)
    return hungarian_accuracy(best[1], y)


# -------------------------------------------------------------------------------------------------- driver

# name -> (targets, DPSL lambda, window start, window end), as fractions of the training steps
CONFIGS = {
    "sinkhorn": ("sinkhorn", 0.0, 0.0, 1.0),
    "sinkhorn + DPSL 0.01 late": ("sinkhorn", 0.01, 0.75, 1.0),      # the paper's recipe
    "sinkhorn + DPSL 1 throughout": ("sinkhorn", 1.0, 0.0, 1.0),
    "swap": ("swap", 0.0, 0.0, 1.0),
    "swap + DPSL 0.01 late": ("swap", 0.01, 0.75, 1.0),              # the paper's recipe
    "swap + DPSL 0.1 throughout": ("swap", 0.1, 0.0, 1.0),
    "swap + DPSL 1 late": ("swap", 1.0, 0.75, 1.0),
    "swap + DPSL 1 throughout": ("swap", 1.0, 0.0, 1.0),
}
# the learned assignments drawn in the figure (seed 0), next to the truth
SHOWN = ("sinkhorn", "sinkhorn + DPSL 0.01 late", "swap", "swap + DPSL 1 throughout")


def setting_of(config: str, steps: int, batch: int) -> Setting:
    targets, lam, start, end = CONFIGS[config]
    return Setting(targets=targets, dpsl_lambda=lam, dpsl_start=start, dpsl_end=end, steps=steps, batch=batch)


def _job(regime: str, config: str, seed: int, points: int, steps: int, batch: int) -> dict:
    torch.set_num_threads(1)          # one run per core: the MLP is far too small to use two threads well
    x, y = make_data(REGIMES[regime], points, seed)
    t, cpu = time.perf_counter(), time.process_time()
    pred, info = train(x, setting_of(config, steps, batch), seed)
    # CPU seconds as well as wall: on a shared machine the wall time measures the other jobs too
    return {"regime": regime, "config": config, "seed": seed, "accuracy": hungarian_accuracy(pred, y),
            "seconds": time.perf_counter() - t, "cpu_seconds": time.process_time() - cpu, **info,
            "pred": pred.astype(np.int8)}


def summary(values: list[float]) -> dict:
    v = np.asarray(values, dtype=float)
    return {"mean": float(v.mean()), "std": float(v.std(ddof=1)) if len(v) > 1 else 0.0,
            "min": float(v.min()), "max": float(v.max())}


def main() -> None:
    from concurrent.futures import ProcessPoolExecutor

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--points", type=int, default=3000)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()

    start = time.perf_counter()
    info = machine()
    jobs = [(r, c, s) for r in REGIMES for c in CONFIGS for s in range(args.seeds)]
    with ProcessPoolExecutor(args.workers) as pool:
        futures = [pool.submit(_job, r, c, s, args.points, args.steps, args.batch) for r, c, s in jobs]
        runs = []
        for i, f in enumerate(futures):
            runs.append(f.result())
            last = runs[-1]
            print(f"[{i + 1}/{len(jobs)}] {last['regime']:17s} {last['config']:30s} seed {last['seed']}: "
                  f"accuracy {last['accuracy']:.3f}  ({last['seconds']:.1f} s)", flush=True)
    table: dict = {}
    for r in REGIMES:
        table[r] = {"kmeans": summary([kmeans_accuracy(*make_data(REGIMES[r], args.points, s), s)
                                       for s in range(args.seeds)])}
        for c in CONFIGS:
            mine = [run for run in runs if run["regime"] == r and run["config"] == c]
            table[r][c] = {**summary([run["accuracy"] for run in mine]),
                           "per_seed": [run["accuracy"] for run in mine],
                           "cluster_shares": [run["cluster_shares"] for run in mine],
                           "mean_max_probability": [run["mean_max_probability"] for run in mine]}
    results = {
        "machine": {**info, "load_average_at_end": list(os.getloadavg())},
        "wall_seconds": time.perf_counter() - start, "seconds_per_run_median": float(np.median(
            [run["seconds"] for run in runs])), "cpu_seconds_all_runs": sum(run["cpu_seconds"] for run in runs),
        "setting": {"points": args.points, "clusters": K, "seeds": list(range(args.seeds)), "steps": args.steps,
                    "batch": args.batch, "optimizer": "Adam", "lr": Setting().lr, "augmentation_sigma": AUG_SIGMA,
                    "head": "MLP 2-64-64-16, L2-normalized, K unit-norm prototypes, tau 0.1",
                    "sinkhorn": {"eps": 0.05, "iterations": 3}, "swap_target_temperature": 0.5,
                    "dpsl": {"loss": "upcycle.training.loss.dpsl.dpsl", "alpha": Setting().dpsl_alpha,
                             "on": "softmax probabilities of both views, [2B, K]"},
                    "regimes": {r: asdict(v) for r, v in REGIMES.items()},
                    "configs": {c: {"targets": t, "dpsl_lambda": lam, "dpsl_window": [a, b]}
                                for c, (t, lam, a, b) in CONFIGS.items()}},
        "accuracy": table,
        "runs": [{k: v for k, v in run.items() if k != "pred"} for run in runs],
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "dpsl_clustering.json").write_text(json.dumps(results, indent=2))
    plot(runs, results, args.points)
    print(markdown_table(results))
    print(f"wall time {results['wall_seconds']:.0f} s, CPU time of the runs {results['cpu_seconds_all_runs']:.0f} s")


def markdown_table(results: dict) -> str:
    table = results["accuracy"]
    configs = ["kmeans", *CONFIGS]
    lines = ["| targets / DPSL (lambda, window) | " + " | ".join(table) + " |",
             "|---|" + "---:|" * len(table)]
    for c in configs:
        cells = [f"{table[r][c]['mean']:.3f} ± {table[r][c]['std']:.3f}" for r in table]
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(runs: list[dict], results: dict, points: int) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    regimes = list(REGIMES)
    columns = ["truth", *SHOWN]
    fig = plt.figure(figsize=(3 * len(columns), 3 * len(regimes) + 3.2))
    grid = fig.add_gridspec(len(regimes) + 1, len(columns), height_ratios=[1] * len(regimes) + [1.1])
    for i, r in enumerate(regimes):
        x, y = make_data(REGIMES[r], points, 0)
        for j, c in enumerate(columns):
            ax = fig.add_subplot(grid[i, j])
            if c == "truth":
                labels, title = y, f"{r}: truth"
            else:
                run = next(run for run in runs if run["regime"] == r and run["config"] == c and run["seed"] == 0)
                labels, title = run["pred"], f"{c}\nseed 0: accuracy {run['accuracy']:.3f}"
            ax.scatter(x[:, 0], x[:, 1], c=labels, s=2, cmap="viridis", vmin=0, vmax=K - 1)
            ax.set_title(title, fontsize=8)
            ax.set_xticks([])
            ax.set_yticks([])
    ax = fig.add_subplot(grid[len(regimes), :])
    configs = ["kmeans", *CONFIGS]
    width = 0.8 / len(configs)
    for j, c in enumerate(configs):
        offsets = np.arange(len(regimes)) + (j - (len(configs) - 1) / 2) * width
        cells = [results["accuracy"][r][c] for r in regimes]
        ax.bar(offsets, [cell["mean"] for cell in cells], width, label=c,
               yerr=[[cell["mean"] - cell["min"] for cell in cells], [cell["max"] - cell["mean"] for cell in cells]],
               capsize=2)
        for o, cell in zip(offsets, cells, strict=True):
            if "per_seed" in cell:
                ax.scatter([o] * len(cell["per_seed"]), cell["per_seed"], s=6, color="black", zorder=3)
    ax.set_xticks(range(len(regimes)), regimes)
    ax.set_ylabel("Hungarian accuracy")
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize=7, ncol=5, loc="upper center", bbox_to_anchor=(0.5, -0.1))
    ax.set_title("mean over seeds (bars: min to max, dots: seeds); k-means = best of 10 inits", fontsize=9)
    fig.suptitle("DPSL on unsupervised clustering (miniature of the DPSL paper's Table 1)", fontsize=11)
    fig.tight_layout()
    fig.savefig(RESULTS / "dpsl_clustering.png", dpi=100, bbox_inches="tight")


if __name__ == "__main__":
    main()
