"""Several fine-tuned models of one base merged into one MoE, streamed (Branch-Train-MiX, Sukhbaatar et al. 2024,
arXiv:2403.07816; mergekit-moe's recipe form).

Each routed expert is a source model's FFN (or `count` experts made from it by the conversion's `method`, copy by
default: the source's FFN as it is); everything else (attention, embeddings, norms, the dense blocks) is the
base's, or with `non_ffn: average` the mean of the sources' (BTX). Optionally the base's FFN is a shared expert.

The blocks go through the streamed block source (`streaming.StreamedBlocks`, run by `orchestrator.run_conversion`), with
one dense block of the base in memory:
  1. every source is checked against the base from its config.json and safetensors headers (`sources.py`),
     and every text read and tokenized, before a weight is read;
  2. per source, four replay groups of token batches: its calibration text, its held-out text, its prompts and
     its negative prompts, each reservoir-sampled at a target's FFN input to `calibration.tokens`;
  3. at a target, each source's FFN tensors of that block are read (only those), turned into its experts, and
     the router is initialized from the groups (`methods.source_router`: random, prompts or data) by
     `merge_layers.SourceLayers`; the layer is installed in the block, the block written into the planned shards and
     released.
Memory: the base's block, the sources' FFNs of one block, the layer's stacked experts, and the groups' hidden states
at one depth (which grow with the amount of text, not with the weights).

Each target's layer and its facts (router-source agreement, the router rows' largest cosine, each expert against
its source's FFN) are `merge_layers.py`'s.

`export: hf` writes the stock class's layout directly, block by block, and checks the stock model, loaded whole
with transformers, against our outputs on the probe taken as the blocks were written (`merged_probe.py`,
`export.stock_folder.check_stock_folder`).
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from torch import nn

from ..checkpoint.averaged import AveragedReader
from ..checkpoint.lazy import checkpoint_names
from ..checkpoint.loading import DTYPES, load_tokenizer
from ..checkpoint.skeleton import empty_model
from ..checkpoint.streamed import StreamSource
from ..config import SourcesConfig
from ..core.devices import resolve_device
from ..core.keyed import keyed_generator
from ..core.surgery import Target
from ..data.held_out import held_out_split
from ..data.model_inputs import text_batches
from ..data.text import read_texts
from ..data.token_ids import embedding_rows
from ..errors import UpcycleError
from ..export.layout import write_configs
from ..export.protocol import export_entry
from ..export.stock_folder import check_stock_folder, stock_too_large
from ..methods import Method
from ..methods.source_router import expert_groups
from ..probe import Probe
from .blockwise import BlockVisit, ReplayGroup
from .calibration import Reservoir
from .inputs import ConversionInputs
from .merge_layers import SourceLayers
from .merged_probe import ProbeThroughBlocks
from .orchestrator import run_conversion
from .plan import COMPUTE_DTYPE, ConversionPlan
from .report import Converted, LayerEntry
from .sources import Source, source_name
from .streaming import StreamedBlocks

GROUPS = ("calibration", "held_out", "prompts", "negative_prompts")
ALL_TOKENS = 2**31 - 1     # prompts are few: every token of them (the largest budget a config holds)


def _texts(path: str, where: str) -> list[str]:
    try:
        return read_texts(path)
    except (FileNotFoundError, ValueError) as e:
        raise UpcycleError(f"{where}: {e}") from None


def needed_groups(sources: SourcesConfig, method: Method) -> set[str]:
    """The groups a merge replays: held-out text for the agreement report; the calibration text for the `data`
    router and for a method that needs calibration data; the prompts for the `prompts` router. Text nothing uses
    is not replayed (the replay is most of a merge's time)."""
    wanted = {"held_out"}
    if sources.router == "data" or method.needs_calibration:
        wanted.add("calibration")
    if sources.router == "prompts":
        wanted |= {"prompts", "negative_prompts"}
    return wanted


def source_batches(plan: ConversionPlan, tokenizer, index: int, kinds=GROUPS, rows: int | None = None,
                   ) -> dict[str, list[dict]]:
    """The token batches of source `index`, by group (those of `kinds`; a group without text is absent). The
    held-out documents are a seeded random `held_out` share of `data` unless `eval_data` is given."""
    entry, c = plan.sources.experts[index], plan.calibration
    where = f"sources.experts[{index}] ({entry.model})"
    docs = _texts(entry.data, where) if entry.data else []
    held = _texts(entry.eval_data, where) if entry.eval_data else []
    if docs and not entry.eval_data:
        docs, held = held_out_split(docs, plan.sources.held_out, plan.seed + index)
    groups = {"calibration": docs, "held_out": held, "prompts": list(entry.prompts),
              "negative_prompts": list(entry.negative_prompts)}
    out = {}
    for group, texts in groups.items():
        if texts and group in kinds:
            budget = c if group in ("calibration", "held_out") else dataclasses.replace(c, tokens=ALL_TOKENS)
            out[group] = text_batches(tokenizer, texts, budget, seed=plan.seed, embedding_rows=rows,
                                      where=f"{where}'s {group.replace('_', ' ')} text")
    return out


def merge_groups(plan: ConversionPlan, tokenizer, method: Method, rows: int | None = None) -> list[ReplayGroup]:
    """Every source's replay groups that the merge needs (`needed_groups`), each reservoir-sampled at a target
    with a seed of its own."""
    groups, kinds = [], tuple(g for g in GROUPS if g in needed_groups(plan.sources, method))
    for i in range(len(plan.sources.experts)):
        for kind, batches in source_batches(plan, tokenizer, i, kinds, rows).items():
            def reservoir(target: Target, i=i, kind=kind) -> Reservoir:
                return Reservoir(plan.calibration.tokens, keyed_generator(plan.seed, "reservoir", i, kind, target.name))

            groups.append(ReplayGroup((i, kind), batches, reservoir))
    return groups


class MergedSource(StreamedBlocks):
    """The block source of a merge: the base's blocks read from disk (its attention, or with `non_ffn: average`
    the sources' mean), the sources' texts replayed through them, each target's layer built from the sources'
    FFNs of that block (`SourceLayers`), and the output written block by block in the upcycle layout, or with
    `export: hf` in the stock class's, the probe carried through each block as written for the stock check."""

    desc = "merging blocks"
    records_probe = False        # nothing here reproduces one dense model: no dense outputs, no verdict

    def __init__(self, plan: ConversionPlan, inputs: ConversionInputs, directory: Path) -> None:
        method, planned = plan.method, plan.planned
        s, (base, sources) = plan.sources, plan.opened
        storage, device = DTYPES[plan.dtype], resolve_device(plan.device)
        self.tokenizer = load_tokenizer(base.path)
        if self.tokenizer is None and any(e.data or e.eval_data or e.prompts for e in s.experts):
            raise UpcycleError(f"{plan.model} has no tokenizer, so the sources' text and prompts cannot be read")
        self.groups = merge_groups(plan, self.tokenizer, method, embedding_rows(base.config))
        self.stock, self.why_not_hf = plan.stock, plan.why_not_stock      # the plan's: before a weight is read
        unique = {id(src.reader): src.reader for src in sources}
        reader = base.reader if s.non_ffn == "base" else AveragedReader(list(unique.values()))
        model = empty_model(base.config, COMPUTE_DTYPE)
        names, missing = checkpoint_names(model, reader)
        if missing:
            raise UpcycleError(f"{plan.model}: the checkpoint's tensor names do not match {type(model).__name__}'s "
                               f"({len(missing)} not found, e.g. {missing[:3]})")
        super().__init__(StreamSource(reader, model, names, COMPUTE_DTYPE, storage, device), plan, directory)
        self.inputs = dataclasses.replace(inputs, tokenizer=self.tokenizer)    # the base's tokenizer reads the probe
        self.base, self.sources = base, sources
        self.export_info: dict = {}
        self.ours: ProbeThroughBlocks | None = None       # our outputs on the probe, for the stock check
        self.why_not_checked = (None if self.stock is None else "check.end_to_end: false"
                                if plan.check.end_to_end is False else stock_too_large(planned))

    def replay_groups(self, probe: Probe) -> list[ReplayGroup]:
        if self.stock is not None and self.why_not_checked is None:    # the probe enters the first block now
            self.ours = ProbeThroughBlocks(self.source, probe, self.first_inputs)
        return self.groups

    def block_ready(self, visit: BlockVisit, block: nn.Module) -> None:
        if self.ours is not None:
            self.ours.run(visit.tower, block)

    def layer_builder(self) -> SourceLayers:
        return SourceLayers(self.plan, self.inputs, self.model, self.base, self.sources, self.source)

    def finish(self, probe: Probe) -> nn.Module:
        """The configs of the layout written (ours, or the stock class's); with a stock class, the stock model
        loaded whole and checked against our outputs on the probe (`merged_probe.py`)."""
        planned = super().finish(probe)
        write_configs(planned, self.stock, self.directory, self.tokenizer)
        if self.stock is None:
            self.export_info = export_entry(None, self.why_not_hf, streamed=True)
            return planned
        check = ({"checked": False, "why_not": self.why_not_checked} if self.ours is None else
                 check_stock_folder(self.directory, self.ours.output(), probe,
                                    self.plan.check.export_tolerance, self.family.outputs))
        from ..export.layout import runtimes_note

        self.export_info = export_entry(self.stock, streamed=True, check=check,
                                        runtimes_note=runtimes_note(planned, self.stock))
        return planned

    def record(self, layers: list[LayerEntry]) -> dict:
        return {"why_not_promised": "experts from several models: nothing reproduces one dense model",
                "sources": _sources_record(self.plan, self.base, self.sources),
                "router_source_agreement": _agreement_summary(layers)}


def merge_sources(plan: ConversionPlan, inputs: ConversionInputs, directory: Path, *, progress: bool = True,
                  phase=lambda message: None) -> tuple[Converted, dict]:
    """Merge the plan's sources on its base into `directory` (module docstring; the sources opened and checked
    by `plan.make_plan`); returns what it measured and what it wrote. `inputs.texts`: the probe of the stock
    export's check (the base's tokenizer reads it)."""
    t_start = time.perf_counter()
    source = MergedSource(plan, inputs, directory)
    load_s = time.perf_counter() - t_start
    done = run_conversion(source, source.inputs, progress=progress, phase=phase)
    done.timings.load = load_s
    return done, source.export_info


def _absolute(path: str | None) -> str | None:
    return str(Path(path).resolve()) if path else None


def _held_out_record(plan: ConversionPlan, entry, index: int) -> dict | None:
    """Where the source's held-out documents are (`upcycle analyze` reads them back): the whole `eval_data`,
    or `held_out_split(documents of data, share, seed)`; None without text."""
    if entry.eval_data:
        return {"file": _absolute(entry.eval_data), "split": None}
    if entry.data and plan.sources.held_out > 0:
        return {"file": _absolute(entry.data), "split": {"share": plan.sources.held_out, "seed": plan.seed + index}}
    return None


def _sources_record(plan: ConversionPlan, base: Source, sources: list[Source]) -> dict:
    """The report's `sources`: each source's model, data and held-out documents (`upcycle analyze` reads them
    back), and which source each expert came from."""
    s = plan.sources
    return {"router": s.router, "non_ffn": s.non_ffn, "shared_expert": s.shared_expert,
            "experts": [{"name": source_name(e.model, i), "model": e.model, "path": src.path,
                         "count": e.count, "data": _absolute(e.data), "eval_data": _absolute(e.eval_data),
                         "held_out": _held_out_record(plan, e, i), "prompts": len(e.prompts),
                         "negative_prompts": len(e.negative_prompts)}
                        for i, (e, src) in enumerate(zip(s.experts, sources, strict=True))],
            # expert e was made from source expert_source[e]: the routing analysis's groups
            "expert_source": expert_groups([e.count for e in s.experts]).tolist(), "base": base.path}


def _agreement_summary(layers: list[LayerEntry]) -> dict:
    agreement = {}
    for name in (layers[0].sources["agreement"] if layers else {}):
        values = [layer.sources["agreement"][name] for layer in layers]
        agreement[name] = {"mean": sum(values) / len(values), "min": min(values)}
    return agreement
