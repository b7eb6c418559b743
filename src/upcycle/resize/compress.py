"""`upcycle compress MODEL OUT --rank R`: a full-expert upcycle folder (a conversion's, or a training run's `model/`)
rewritten with delta experts, each MoE layer's E experts as their mean plus a rank-R change each (DeRS, CVPR 2025,
§3: upcycled experts stay close to one another, so what sets them apart is kept in low rank; the split is
`core.delta_split.split_experts`, a truncated SVD per matrix and expert).

    check     MODEL is an upcycle folder with full experts, and R fits every MoE layer (min(D, F)), from its
              upcycle_config.json before a weight loads
    claim     OUT (never an input; replaced only when upcycle wrote it)
    load      the model and its tokenizer, and the held-out probe (`run.held_out_probe`)
    change    each MoE layer's experts split into base + deltas, in place
    measure   per layer the share of the experts' differences from the base kept (each matrix: the least and the
              mean over experts) and the largest bias an expert loses (biases keep no per-expert delta); for the
              model, the KL to the source and the largest logit difference on the probe, the held-out perplexity
              before and after, and the bytes of the weights before and after
    write     the upcycle folder (delta experts: `upcycle.load` gives the compact model, `upcycle export` full
              experts again), then compress_report.json

The base is the experts' mean: for any rank the best single base in the least-squares sense (the mean minimizes
the sum of the experts' squared distances to it), and the one known from the folder alone. At full rank the split is
exact and the folder computes what the source does.
"""

from __future__ import annotations

import dataclasses
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import torch
from tqdm.auto import tqdm

from ..checkpoint.loading import TOKENIZER_FOLDER_FILES, load_model
from ..checkpoint.upcycle_format import MOE_CONFIG, save_folder_files
from ..core.delta_experts import DeltaExperts
from ..core.delta_split import split_experts
from ..core.expert_shape import ExpertShape
from ..core.moe import MoELayer, moe_layers
from ..data.model_names import model_inputs
from ..errors import UpcycleError
from ..files import json_text
from ..outputs.claims import Input
from ..outputs.job import NEW_OUTPUT, Claiming, dry_run_job, run_job
from ..probe import compare, probe_output
from ..progress import Phases
from .run import held_out_probe, perplexity
from .streamed import open_folder

REPORT = "compress_report.json"


@dataclass(frozen=True)
class CompressPlan:
    """What a compress of `model` would write."""

    model: str
    rank: int
    layers: dict[str, tuple[int, int]]          # MoE layer -> (parameters of its routed experts now, after)
    parameters: tuple[int, int]                 # the model's, before and after
    element_bytes: int                          # bytes per expert weight (the folder's storage dtype)
    given: list[Input] = field(default_factory=list)
    kind: ClassVar[str] = "compress"
    claiming: ClassVar[Claiming] = NEW_OUTPUT

    def summary(self) -> dict:
        return {"kind": self.kind, "model": self.model, "rank": self.rank,
                "layers": {name: list(counts) for name, counts in self.layers.items()},
                "parameters": list(self.parameters)}

    def describe(self) -> str:
        p0, p1 = self.parameters
        saved = sum(a - b for a, b in self.layers.values()) * self.element_bytes
        return "\n".join([
            f"compress plan for {self.model} (rank {self.rank}), nothing written",
            f"  MoE layers           {len(self.layers)}, experts as their mean plus rank-{self.rank} deltas",
            f"  parameters           {p0:,} -> {p1:,}",
            f"  weights on disk      {saved:,} bytes less ({saved / 1e9:.3f} GB)",
            "  runs                 in memory (the whole model loaded)"])


def plan_compress(model: str, rank: int) -> CompressPlan:
    """The plan after every refusal that needs no weight (module docstring, "check")."""
    folder = Path(model)
    if not (folder / MOE_CONFIG).is_file():
        hint = " (a training run: its model/ folder)" if (folder / "model" / MOE_CONFIG).is_file() else ""
        raise UpcycleError(f"{model} is not an upcycle folder{hint}: compress takes the folder of a conversion or "
                           f"a training run's model/")
    skeleton = open_folder(folder).model          # the config and the shapes, no weight
    layers = {}
    for name, layer in moe_layers(skeleton).items():
        experts = layer.experts
        if isinstance(experts, DeltaExperts):
            raise UpcycleError(f"{model}: layer {name} already holds delta experts (rank {experts.rank})")
        limit = min(experts.hidden_size, experts.intermediate_size)
        if rank > limit:
            raise UpcycleError(f"--rank must be at most min(model width, expert width) = {limit} (layer {name}), "
                               f"got {rank}")
        with torch.device("meta"):
            delta = DeltaExperts(experts.num_experts, ExpertShape.of(experts.weights()), rank)
        layers[name] = (sum(p.numel() for p in experts.parameters()), sum(p.numel() for p in delta.parameters()))
    if not layers:
        raise UpcycleError(f"{model} has no MoE layer to compress")
    before = sum(p.numel() for p in skeleton.parameters())
    after = before - sum(a - b for a, b in layers.values())
    element = next(iter(moe_layers(skeleton).values())).experts.dtype.itemsize
    given = [Input(what, path) for what, path in model_inputs(model)]
    return CompressPlan(model, rank, layers, (before, after), element, given)


def compress(model: str, out: str | Path, rank: int, *, overwrite: bool = False, progress: bool = True) -> dict:
    """Compress the folder `model` into OUT at `rank` (module docstring); returns the report."""
    plan = plan_compress(model, rank)
    return run_job(plan, out, lambda claim: _execute(plan, claim, progress), overwrite=overwrite)


def dry_run(model: str, rank: int, out: str | Path | None = None, *, overwrite: bool = False) -> str:
    """What `compress` would write, after every refusal it makes before reading a weight; nothing is written."""
    return dry_run_job(plan_compress(model, rank), out, overwrite=overwrite)


def compress_layer(layer: MoELayer, rank: int) -> dict:
    """`layer`'s full experts replaced in place by their mean plus rank-`rank` deltas; what the split kept."""
    experts = layer.experts
    weights = experts.weights()
    split = split_experts(weights, rank)
    delta = DeltaExperts(experts.num_experts, ExpertShape.of(weights), rank, dtype=experts.dtype).to(
        layer.router.weight.device)
    delta.load_base(split.base)
    delta.load_deltas(split.deltas)
    layer.experts = delta.train(layer.training)
    layer.config = dataclasses.replace(layer.config, experts="delta", delta_rank=rank, train_base=True)
    return {"energy_kept": {name: {"min": float(kept.min()), "mean": float(kept.mean())}
                            for name, kept in split.energy.items()},
            "largest_bias_lost": split.bias_drift}


def _weight_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


def _execute(plan: CompressPlan, claim, progress: bool) -> dict:
    phases = Phases(4, progress, "upcycle compress")
    try:
        loaded, tokenizer = load_model(plan.model)
        loaded.eval()
        probe = held_out_probe(loaded, tokenizer, 0)
        phases("model loaded")
        before = probe_output(loaded, probe)
        layers = {}
        with torch.no_grad():
            for name, layer in tqdm(moe_layers(loaded).items(), desc="splitting experts", unit="layer",
                                    disable=not progress, leave=False):
                layers[name] = compress_layer(layer, plan.rank)
        after = probe_output(loaded, probe)
        measured = compare(before, after)
        phases(f"{len(layers)} MoE layers split; compared with the source on the probe")
        with claim.directory() as tmp:
            save_folder_files(loaded, tmp)
            for name in TOKENIZER_FOLDER_FILES:
                if (Path(plan.model) / name).is_file():
                    shutil.copyfile(Path(plan.model) / name, tmp / name)
            report = {"kind": "compress", "source": plan.model, "rank": plan.rank,
                      "probe": {"source": probe.source, "rows": measured["compared_rows"]},
                      "kl_to_source": measured["kl_to_dense"], "max_abs_logit_diff": measured["max_abs_logit_diff"],
                      "held_out_perplexity": {"before": perplexity(probe, before), "after": perplexity(probe, after)},
                      "parameters": {"before": plan.parameters[0], "after": plan.parameters[1]},
                      "weight_bytes": {"before": _weight_bytes(Path(plan.model)), "after": _weight_bytes(tmp)},
                      "layers": layers}
            (tmp / REPORT).write_text(json_text(report, indent=1, where=REPORT) + "\n")
        phases(f"written to {claim.out}")
    finally:
        phases.close()
    return report
