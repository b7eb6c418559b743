"""What `upcycle analyze TARGET` looks at: one model, or the checkpoints of a training run, as snapshots.

  upcycle folder (upcycle_config.json)        one snapshot; dense source: its run_config.yaml `model`
  stock MoE folder (`--export hf`)            one snapshot; dense source: the `source_model` of the
                                              upcycle_report.json the export copied
  training run (run_config.yaml + checkpoints/ or model/)
                                              step 0 = the run's input model (when that folder is still there),
                                              then its checkpoints (`checkpoints`: all, last, or every:N = the
                                              steps divisible by N, the last one always kept), loaded one after the
                                              other into the same model; dense source: the input model's

A model merged from several sources (`upcycle convert` with `sources.experts`) records in its report each
source's held-out text and which source each expert came from (`recorded_sources`): the analysis then reads
those texts by default, one data source per merged source, and reports router-source agreement.

Recorded models mean the same from any directory: a run records its input model's absolute path in
`inputs.json`, a conversion its dense model's in the report's `source_path`. A folder written before those records
named its models as the user typed them, relative to wherever that command ran: such a relative name is not
guessed at (neither the current directory's folder of that name nor the hub is tried); the analysis says so and
goes on without it (`--dense` names the dense model explicitly).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from safetensors.torch import load_model as load_safetensors
from torch import nn

from ..checkpoint.loading import load_model
from ..checkpoint.upcycle_format import MOE_CONFIG
from ..core.stock_moe import is_stock_moe
from ..data.assets import DEFAULT_MODEL_NAMES
from ..errors import UpcycleError
from ..files import read_json_file
from ..runs.checkpoint_format import MANIFEST, step_of
from ..runs.layout import CHECKPOINTS, INPUTS, RUN_CONFIG, checkpoints

REPORT = "upcycle_report.json"


@dataclass(frozen=True)
class Snapshot:
    label: str                        # "model", "step 0 (init)", "step 20"
    step: int | None
    path: str                         # the model folder, or the checkpoint folder whose weights are loaded


@dataclass
class AnalysisTarget:
    path: Path
    kind: str                         # "upcycle" | "stock" | "run"
    snapshots: list[Snapshot]
    dense: str | None                 # the dense model the target was upcycled from, when recorded
    skeleton: str                     # the folder whose model the checkpoints are loaded into
    notes: list[str] = field(default_factory=list)
    sources: RecordedSources | None = None      # a merge's sources, when the target (or a run's input) is one


@dataclass(frozen=True)
class RecordedSource:
    name: str
    file: str                         # its held-out text, or the text the held-out documents are drawn from
    split: dict | None                # {'share', 'seed'}: `data.held_out.held_out_split` of the file's documents


@dataclass(frozen=True)
class RecordedSources:
    sources: tuple[RecordedSource, ...]
    expert_source: tuple[int, ...]    # expert e was made from source expert_source[e]


def _yaml(path: Path) -> dict:
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError, UnicodeDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def _json(path: Path) -> dict:
    try:
        data = read_json_file(path, "record")
    except (OSError, ValueError, UnicodeDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def usable_record(name, notes: list[str], what: str) -> str | None:
    """A recorded model name that means the same from here: an embedded model's name, an absolute path or a hub
    id (no '/'-free relative folder guesses); else None with a note."""
    if not isinstance(name, str) or not name:
        if name is not None:
            notes.append(f"the recorded {what} {name!r} is not a model name: left out")
        return None
    if name in (*DEFAULT_MODEL_NAMES, "minilm") or Path(name).expanduser().is_absolute():
        return name
    notes.append(f"the {what} is recorded as {name!r}, relative to the folder that command ran in, which is not "
                 f"known: left out (give it explicitly{' with --dense' if what == 'dense model' else ''})")
    return None


def recorded_dense(folder: Path, notes: list[str] | None = None) -> str | None:
    """The dense source an upcycle or exported folder records (its report's source_path, else for older folders
    its source_model or its run config's model when they are absolute or embedded names), or None."""
    notes = [] if notes is None else notes
    report = _json(folder / REPORT)
    if isinstance(report.get("source_path"), str) and report["source_path"]:
        return report["source_path"]        # recorded to mean the same anywhere (`recorded_location`)
    if report.get("source_model"):
        return usable_record(report["source_model"], notes, "dense model")
    model = _yaml(folder / RUN_CONFIG).get("model") if (folder / MOE_CONFIG).is_file() else None
    return usable_record(model, notes, "dense model") if model is not None else None


def recorded_sources(folder: Path, notes: list[str]) -> RecordedSources | None:
    """The sources a merged model's report records, when every one of them has held-out text that is still
    there; otherwise None (with a note saying why, when the folder is a merge)."""
    try:
        sources = read_json_file(folder / REPORT, "conversion report").get("sources")
    except (OSError, ValueError):
        return None
    if not isinstance(sources, dict) or not sources.get("experts"):
        return None
    found = []
    for entry in sources["experts"]:
        held = entry.get("held_out")
        if not held:
            notes.append(f"source {entry.get('name') or entry.get('model')} of the merge recorded no text: the "
                         f"default data sources are used")
            return None
        if not Path(held["file"]).is_file():
            notes.append(f"the text {held['file']} of merged source {entry['name']} is gone: the default data "
                         f"sources are used")
            return None
        found.append(RecordedSource(entry["name"], held["file"], held.get("split")))
    return RecordedSources(tuple(found), tuple(sources["expert_source"]))


def select_checkpoints(found: list[Path], rule: str) -> list[Path]:
    """`all`, `last`, or `every:N` (steps divisible by N, and the last checkpoint)."""
    if rule == "all" or not found:
        return list(found)
    if rule == "last":
        return found[-1:]
    kind, _, number = rule.partition(":")
    if kind != "every" or not number.isdigit() or int(number) < 1:
        raise UpcycleError(f"--checkpoints {rule!r}: give all, last or every:N (N >= 1)")
    n = int(number)
    return [f for f in found if step_of(f) % n == 0 or f == found[-1]]


def _run_input(run: Path, notes: list[str]) -> Path | None:
    """The run's input model folder: the absolute path its inputs.json records (older runs: their config's model
    when that is absolute), when that folder is still there."""
    if (run / INPUTS).is_file():         # recorded to mean the same anywhere (`recorded_location`)
        model = _json(run / INPUTS).get("model")
        model = model if isinstance(model, str) and model else None
    else:
        model = usable_record(_yaml(run / RUN_CONFIG).get("model"), notes, "run's input model")
    if model is None:
        return None
    if model in (*DEFAULT_MODEL_NAMES, "minilm"):
        return None         # a dense model: the run's own checkpoints and model/ carry the experts
    folder = Path(model).expanduser()
    if not folder.is_dir():
        notes.append(f"the run's input model {model} is gone: no step 0")
        return None
    return folder


def resolve_target(target: str, checkpoint_rule: str = "all") -> AnalysisTarget:
    path = Path(target).expanduser()
    if not path.is_dir():
        raise UpcycleError(f"TARGET {target} is not a folder (an upcycle folder, an exported MoE folder or a "
                           f"training run folder)")
    if (path / RUN_CONFIG).is_file() and ((path / CHECKPOINTS).is_dir() or (path / "model").is_dir()):
        return _run_target(path, checkpoint_rule)
    if (path / MOE_CONFIG).is_file():
        notes: list[str] = []
        return AnalysisTarget(path, "upcycle", [Snapshot("model", None, str(path))], recorded_dense(path, notes),
                              str(path), notes, recorded_sources(path, notes))
    if is_stock_moe(_json(path / "config.json")):
        notes = []
        return AnalysisTarget(path, "stock", [Snapshot("model", None, str(path))], recorded_dense(path, notes),
                              str(path), notes, recorded_sources(path, notes))
    raise UpcycleError(f"TARGET {target} is neither an upcycle folder ({MOE_CONFIG}), a stock MoE folder "
                       f"(Qwen2-MoE, Qwen3-MoE, Mixtral...) nor a training run folder ({RUN_CONFIG} with "
                       f"{CHECKPOINTS}/ or model/); a dense model has no experts to analyze")


def _run_target(run: Path, rule: str) -> AnalysisTarget:
    complete = [f for f in checkpoints(run) if (f / MANIFEST).is_file()]
    chosen = select_checkpoints(complete, rule)
    notes: list[str] = []
    source = _run_input(run, notes)
    snapshots = []
    if source is not None and rule != "last":
        snapshots.append(Snapshot("step 0 (init)", 0, str(source)))
    snapshots += [Snapshot(f"step {step_of(f)}", step_of(f), str(f)) for f in chosen]
    if not chosen and (run / "model").is_dir():
        snapshots.append(Snapshot("model", None, str(run / "model")))
    if not snapshots:
        raise UpcycleError(f"run {run} has no complete checkpoint, no model/ and no input model to analyze")
    skeleton = str(source) if source is not None else str(run / "model")
    if source is None and not (run / "model").is_dir():
        raise UpcycleError(f"run {run}: neither its input model nor its model/ folder is there to load the "
                           f"checkpoints into")
    dense = recorded_dense(source, notes) if source is not None else None
    merged = recorded_sources(source, notes) if source is not None else None
    return AnalysisTarget(run, "run", snapshots, dense, skeleton, notes, merged)


def snapshot_models(target: AnalysisTarget) -> Iterator[tuple[Snapshot, nn.Module, object]]:
    """(snapshot, model in eval mode, tokenizer) for each snapshot; checkpoints are loaded into one model."""
    model, tokenizer = load_model(target.skeleton)
    model.eval()
    for snapshot in target.snapshots:
        folder = Path(snapshot.path)
        if (folder / "model.safetensors").is_file() and (folder / MANIFEST).is_file():
            missing, unexpected = load_safetensors(model, str(folder / "model.safetensors"), strict=False)
            if missing or unexpected:
                raise UpcycleError(f"checkpoint {folder} does not fit the model of {target.skeleton} (missing "
                                   f"{missing[:3]}, unexpected {unexpected[:3]})")
        elif str(folder) != target.skeleton:
            model, tokenizer = load_model(str(folder))
            model.eval()
        yield snapshot, model, tokenizer
