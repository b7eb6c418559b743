"""Analyzing a target: every docs/methods.md §5 metric of every MoE layer, as JSON, PNG figures and one HTML page.

    validate (TARGET, OUT, sources) -> tokenize the sources -> per snapshot: one forward (+ the dense model's)
    -> `analysis.layer_metrics` per layer -> OUT/analysis.json, OUT/*.png, OUT/report.html (written atomically)

An encoder (the BERT family) is analyzed on one text per row, by default on the texts of its held-out pairs with
one data source per pair source and role (`upcycle.analyze.encoder_sources`), and reports its embeddings'
cosine to the dense encoder instead of NLL and KL (`upcycle.analyze.collect`).
For a training run every checkpoint is one snapshot, and the figures add the metrics over the steps and the
run's own curves from its log.jsonl (analysis.json "training", training.png: `upcycle.analyze.curves`).
Nothing is written until every number is computed; OUT appears whole or not at all.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import ClassVar

from ..checkpoint.loading import check_sequence_length, dense_config, load_dense
from ..data.held_out import held_out_split
from ..data.model_names import model_inputs
from ..data.source_texts import (
    DEFAULT_SOURCES,
    SourceRows,
    default_source_texts,
    parse_source,
    source_rows,
    user_source_texts,
)
from ..errors import UpcycleError
from ..figures.html_report import render_report
from ..figures.plots import write_figures
from ..files import file_problem, json_text
from ..machine import machine
from ..outputs.claims import Input, inputs
from ..outputs.job import NEW_OUTPUT, Claiming, run_job
from .collect import capture, moe_modules, snapshot_metrics
from .curves import run_curves
from .encoder_sources import PairData, encoder_pairs, is_encoder_folder, pair_rows, text_rows
from .target import AnalysisTarget, RecordedSources, resolve_target, snapshot_models

FORMAT = "upcycle-analysis"
VERSION = 1


@dataclass(frozen=True)
class AnalyzeOptions:
    sources: tuple[str, ...] = ()          # NAME=FILE
    data: tuple[str, ...] = ()             # FILE (named after its stem)
    dense: str | None = None
    tokens: int = 1024                     # real tokens per source
    sequence_length: int = 256
    checkpoints: str = "all"
    batch_size: int = 8
    output_tokens: int = 512               # tokens every expert runs on (output similarity, RC)
    bins: int = 40
    shuffles: int = 20
    seed: int = 0
    pairs: str | None = None               # encoders: a pair file whose texts are the sources (by source and role)


# (flag, low, high) of each number option: beyond these a typo would allocate for minutes, not analyze more
OPTION_RANGES = {"tokens": ("--tokens", 16, 2**26), "sequence_length": ("--sequence-length", 2, 2**20),
                 "output_tokens": ("--output-tokens", 1, 2**20), "seed": ("--seed", 0, 2**32 - 1),
                 "batch_size": ("batch size", 1, 2**16), "bins": ("histogram bins", 1, 10**4),
                 "shuffles": ("shuffles", 0, 10**4)}


def check_options(options: AnalyzeOptions) -> None:
    for name, (flag, low, high) in OPTION_RANGES.items():
        value = getattr(options, name)
        if not low <= value <= high:
            raise UpcycleError(f"{flag} must be from {low} to {high:,}, got {value:,}")


@dataclass(frozen=True)
class SourceSpec:
    name: str
    file: str | None                # None: one of DEFAULT_SOURCES
    split: dict | None = None       # a merge's held-out rule for the file's documents (`held_out_split`)


def _source_specs(options: AnalyzeOptions, recorded: RecordedSources | None = None) -> tuple[list[SourceSpec], str]:
    """(the data sources, names unique; where they come from): --source/--data when given, else the held-out
    text of each source a merged model records, else DEFAULT_SOURCES."""
    specs = [SourceSpec(*parse_source(s)) for s in options.sources] + [SourceSpec(*parse_source(f))
                                                                        for f in options.data]
    origin = "--source/--data"
    if not specs and recorded is not None:
        specs, origin = [SourceSpec(r.name, r.file, r.split) for r in recorded.sources], "the merge's sources"
    if not specs:
        specs, origin = [SourceSpec(name, None) for name in DEFAULT_SOURCES], "defaults"
    names = [spec.name for spec in specs]
    if len(set(names)) != len(names):
        raise UpcycleError(f"source names must differ: {names}")
    for spec in specs:
        if spec.file is not None and (problem := file_problem(spec.file)):
            raise UpcycleError(f"source file {spec.file}: {problem}")
    return specs, origin


def _progress(total: int, desc: str, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, disable=not enabled, file=sys.stderr, leave=False)


def _dense_source(options: AnalyzeOptions, recorded: str | None, notes: list[str]) -> str | None:
    """The dense model for KL: --dense (an error when it does not load), else the recorded one (skipped with a
    note when it is gone), checked by its config alone before any weight is read."""
    name = options.dense or recorded
    if name is None:
        return None
    try:
        dense_config(name, wanted_by="--dense takes the dense model the MoE model was converted from, to measure "
                                     "the KL to it")
    except UpcycleError as e:
        if options.dense:
            raise
        notes.append(f"the recorded dense source {name} does not load ({e}): no KL to dense")
        return None
    return name


def _texts(spec: SourceSpec) -> tuple[list[str], str]:
    if spec.file is None:
        return default_source_texts(spec.name)
    texts, origin = user_source_texts(spec.file)
    if spec.split:
        _, held = held_out_split(texts, spec.split["share"], spec.split["seed"])
        if held:            # the merge's held-out documents; a file too short to split is read whole
            texts = held
            origin = f"{origin} (the merge's held-out share {spec.split['share']:g}, seed {spec.split['seed']})"
    return texts, origin


def _sources(specs: list[SourceSpec], tokenizer, options: AnalyzeOptions, encoder: bool = False,
             pairs: PairData | None = None) -> list[SourceRows]:
    """Each source's rows: packed documents, or for an encoder one text per row (its pairs' texts by default)."""
    if pairs is not None:
        return pair_rows(pairs, tokenizer, tokens=options.tokens, sequence_length=options.sequence_length,
                         seed=options.seed)
    rows = []
    for spec in specs:
        texts, origin = _texts(spec)
        rows.append((text_rows if encoder else source_rows)(
            spec.name, texts, origin, tokenizer, tokens=options.tokens, sequence_length=options.sequence_length,
            seed=options.seed))
    return rows


def analyze(target: str, out: str, options: AnalyzeOptions = AnalyzeOptions(), *, overwrite: bool = False,
            progress: bool = True, command: str | None = None) -> dict:
    """Analyze TARGET into the new folder OUT; returns the analysis (what analysis.json holds)."""
    started = time.perf_counter()
    plan = make_analysis_plan(target, options, command)
    return run_job(plan, out, lambda claim: _analyze(plan, claim, started, progress), overwrite=overwrite)


def make_analysis_plan(target: str, options: AnalyzeOptions = AnalyzeOptions(), command: str | None = None
                       ) -> AnalysisPlan:
    """What `analyze` decides before a weight loads (`AnalysisPlan`), every refusal that needs no weight made."""
    check_options(options)
    resolved = resolve_target(target, options.checkpoints)
    encoder = is_encoder_folder(resolved.skeleton)
    if options.pairs is not None and not encoder:
        raise UpcycleError(f"--pairs is for encoders (the BERT family); {resolved.skeleton} is not one: give its "
                           f"text with --source NAME=FILE")
    pairs = None
    if encoder and (options.pairs is not None or not (options.sources or options.data)):
        pairs = encoder_pairs(options.pairs, resolved.kind, resolved.path)
    specs, sources_from = ([], pairs.origin) if pairs is not None else _source_specs(options, resolved.sources)
    # router-source agreement needs the analysis's source s to be the merge's source s
    expert_source = (list(resolved.sources.expert_source)
                     if resolved.sources is not None and sources_from == "the merge's sources" else None)
    dense_name = _dense_source(options, resolved.dense, resolved.notes)
    given = [*inputs(("target", target), ("run's input model", resolved.skeleton)),
             *inputs(*((f"source {spec.name}", spec.file) for spec in specs)),
             *inputs(*(pairs.files() if pairs is not None else ())),
             *(Input(f"dense model's {what}" if what != "model" else "dense model", path)
               for name in {options.dense, resolved.dense, dense_name} - {None} for what, path in model_inputs(name))]
    return AnalysisPlan(target, options, resolved, specs, sources_from, expert_source, dense_name, encoder, pairs,
                        command, given)


@dataclass(frozen=True)
class AnalysisPlan:
    """What `analyze` decided before a weight loads: the target as resolved, the sources and where they came
    from, the dense model to compare with, and whether the model is an encoder (one text per row)."""

    target: str
    options: AnalyzeOptions
    resolved: AnalysisTarget
    specs: list[SourceSpec]
    sources_from: str
    expert_source: list[int] | None
    dense_name: str | None
    encoder: bool
    pairs: PairData | None
    command: str | None
    given: list[Input]                  # what OUT must never be
    kind: ClassVar[str] = "analyze"     # the output's kind (`outputs.job.Plan`)
    claiming: ClassVar[Claiming] = NEW_OUTPUT

    def summary(self) -> dict:
        """The decisions as plain values."""
        r = self.resolved
        return {"target": self.target, "kind": r.kind, "snapshots": [s.label for s in r.snapshots],
                "sources": [spec.name for spec in self.specs], "sources_from": self.sources_from,
                "dense": self.dense_name, "encoder": self.encoder, "notes": list(r.notes)}

    def describe(self) -> str:
        """The analysis as lines for a person (`upcycle analyze --dry-run`)."""
        s = self.summary()
        rows = "one text per row (encoder)" if self.encoder else "packed documents"
        return "\n".join([f"analysis plan for {self.target} ({s['kind']}): {len(s['snapshots'])} snapshot(s) "
                          f"({', '.join(s['snapshots'])})",
                          f"  sources: {', '.join(s['sources']) or 'the pairs'} ({self.sources_from}); {rows}, "
                          f"{self.options.tokens} tokens each",
                          f"  KL to the dense model: {self.dense_name or 'none'}",
                          *(f"  note: {note}" for note in s["notes"])])


def _analyze(plan: AnalysisPlan, claim, started: float, progress: bool) -> dict:
    out, target, options, resolved = claim.out, plan.target, plan.options, plan.resolved
    encoder, dense_name, expert_source = plan.encoder, plan.dense_name, plan.expert_source

    def say(message: str) -> None:
        if progress:
            print(f"[upcycle analyze] {message}", file=sys.stderr)

    say(f"{resolved.kind} {target}: {len(resolved.snapshots)} snapshot(s); dense source: {dense_name or 'none'}")
    timings: dict[str, float] = {}
    models = snapshot_models(resolved)
    snapshot, model, tokenizer = next(models)
    timings["load"] = time.perf_counter() - started
    if tokenizer is None:
        raise UpcycleError(f"{resolved.skeleton} has no tokenizer: the sources cannot be tokenized")
    if encoder:         # one text per row: a row past the position table would index beyond it
        check_sequence_length(model, options.sequence_length)
    t = time.perf_counter()
    rows = _sources(plan.specs, tokenizer, options, encoder, plan.pairs)
    timings["sources"] = time.perf_counter() - t
    say("sources: " + ", ".join(f"{r.name} {r.tokens} tokens" for r in rows))
    dense = None
    if dense_name is not None:
        t = time.perf_counter()
        dense, _ = load_dense(dense_name)
        timings["load_dense"] = time.perf_counter() - t
    names = [r.name for r in rows]
    snapshots = []
    timings["forward"], timings["metrics"] = 0.0, 0.0
    while snapshot is not None:                 # one model in memory: each checkpoint is loaded into it in turn
        t = time.perf_counter()
        with _progress(sum(r.tokens for r in rows), f"{snapshot.label}: forward", progress) as bar:
            cap = capture(model, rows, dense, batch_size=options.batch_size, progress=bar)
        timings["forward"] += time.perf_counter() - t
        t = time.perf_counter()
        with _progress(len(moe_modules(model)), f"{snapshot.label}: metrics", progress) as bar:
            metrics = snapshot_metrics(model, cap, names, options, progress=bar, expert_source=expert_source)
        timings["metrics"] += time.perf_counter() - t
        snapshots.append({"label": snapshot.label, "step": snapshot.step, "path": snapshot.path, **metrics})
        say(f"{snapshot.label}: {len(metrics['layers'])} MoE layers analyzed")
        snapshot, model, _ = next(models, (None, None, None))
    result = {"format": FORMAT, "version": VERSION,
              "target": {"path": str(target), "kind": resolved.kind, "dense": dense_name,
                         "dense_from": "--dense" if options.dense else ("recorded" if dense_name else None),
                         "notes": resolved.notes},
              "inputs": {"sources": [r.describe() for r in rows], "sources_from": plan.sources_from,
                         "expert_source": expert_source, "tokens_per_source": options.tokens,
                         "rows": "one text per row (encoder)" if encoder else "packed documents",
                         "sequence_length": options.sequence_length, "checkpoints": options.checkpoints,
                         "output_tokens": options.output_tokens, "histogram_bins": options.bins,
                         "shuffles": options.shuffles, "seed": options.seed, "command": plan.command},
              "machine": machine(), "snapshots": snapshots}
    curves = run_curves(resolved.path) if resolved.kind == "run" else None
    if curves is not None:
        result["training"] = curves
    t = time.perf_counter()
    with claim.directory() as tmp:
        figures = write_figures(result, tmp)
        timings["figures"] = time.perf_counter() - t
        timings["total"] = time.perf_counter() - started
        result["seconds"] = {k: round(v, 2) for k, v in timings.items()}
        (tmp / "report.html").write_text(render_report(result, {name: (tmp / name).read_bytes()
                                                                for name, _ in figures}, figures))
        (tmp / "analysis.json").write_text(json_text(result, indent=1, where="analysis.json") + "\n")
    say(f"wrote {out}: analysis.json, {len(figures)} figures, report.html ({timings['total']:.0f} s)")
    return result
