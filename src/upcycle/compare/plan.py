"""The grid `upcycle compare` runs, as cells with their full configs, checked before anything is written.

A cell is one (method, EESD setting, seed): the dense model converted with that method (the same placement,
E and k for every method: one convert config, only `method`, its arguments and the seed differ), then trained
with one recipe (the same steps, batch and sequence length, so the same token budget), with
`regularizers.eesd` set to the cell's EESD coefficient. Each seed also gets one dense-continued cell: the dense
model trained with the same recipe (EESD off: a dense model has no experts to distil), the baseline.

The seed is both the conversion's seed (router draws, Drop-Upcycling's re-drawn neurons, k-means) and the
run's (the data order is a function of (seed, step)), so cells of one seed see the same batches.

Everything a cell will do is fixed here: a finished or interrupted cell in OUT whose recorded plan differs from
the new one is refused, not silently skipped or resumed into another run.

    OUT/study.json                         marks OUT as a compare folder; one line per invocation
    OUT/calibration/train_pairs.safetensors    CLIP only: the training image-caption pairs, for data-aware methods
    OUT/calibration/train_texts.safetensors    encoders only: texts of the training pairs (`text_calibration`)
    OUT/conversions/METHOD-seed-S/moe/     the converted model (upcycle folder), shared by the EESD settings
    OUT/conversions/METHOD-seed-S/conversion.json   conversion time and report summary, once `moe/` is written
    OUT/cells/NAME/plan.json               the cell's convert and train configs
    OUT/cells/NAME/run/                    the training run (log.jsonl, checkpoints/, model/)
    OUT/cells/NAME/cell.json               the cell's results, written last: the cell is finished
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from ..checkpoint.loading import dense_config
from ..config import ConvertConfig, TrainConfig, to_dict
from ..config_reader import build, recipe_path
from ..conversion.plan import make_plan as plan_conversion
from ..core.architectures import family_of
from ..data.assets import DEFAULT_MODEL_NAMES
from ..data.model_names import model_inputs
from ..errors import UpcycleError
from ..files import json_copy, read_json_file
from ..methods import get_method
from ..outputs.claims import Input, inputs
from ..outputs.job import Claiming
from .request import DENSE, CompareRequest, eesd_label, parse_grid, read_recipes
from .text_calibration import CALIBRATION_TEXTS, TextCalibration, text_calibration

STUDY = "study.json"
FORMAT = "upcycle-compare"
CALIBRATION_PAIRS = Path("calibration") / "train_pairs.safetensors"


@dataclass(frozen=True)
class Cell:
    name: str
    method: str                     # a registered method, or DENSE
    eesd: float | None              # None for the dense baseline
    seed: int
    convert: ConvertConfig | None   # None for the dense baseline
    train: TrainConfig

    def describe(self) -> dict:
        """The cell's plan as JSON (what plan.json holds and a rerun must match)."""
        return json_copy({"name": self.name, "method": self.method, "eesd": self.eesd, "seed": self.seed,
                          "convert": None if self.convert is None else to_dict(self.convert),
                          "train": to_dict(self.train)})


RESULT = "cell.json"        # a cell's results, written when it finished


@dataclass
class Plan:
    out: Path
    model: str
    task: str                       # causal_lm | clip
    methods: tuple[str, ...]        # in the order asked (the table's order)
    cells: list[Cell]
    keep: str
    calibration_pairs: tuple[Path, str | None] | None = None   # (file to write, CLIP data source) when needed
    calibration_texts: TextCalibration | None = None           # encoders: the training texts' file, when needed
    notes: list[str] = field(default_factory=list)
    given: list[Input] = field(default_factory=list)            # what OUT must never be (`compare_inputs`)
    kind: ClassVar[str] = "compare"                             # the output's kind (`outputs.job.Plan`)
    # OUT is claimed cell by cell: invocations on disjoint cells may share it (one per seed, say), and one whose
    # cells or conversions another running invocation holds is refused at its start (`study._record_start`)
    claiming: ClassVar[Claiming] = Claiming(existing="continue", lock=False)

    def summary(self) -> dict:
        """The decisions as plain values: the grid, and each cell's plan (what its plan.json holds)."""
        return {"out": str(self.out), "model": self.model, "task": self.task, "methods": list(self.methods),
                "keep": self.keep, "cells": [cell.describe() for cell in self.cells], "notes": list(self.notes)}

    def describe(self) -> str:
        """The grid as lines for a person: each cell, and whether an earlier invocation finished it."""
        lines = [f"compare plan for {self.model} ({self.task}) into {self.out}: {len(self.cells)} cells, methods "
                 f"{', '.join(self.methods)} and the dense baseline"]
        for cell in self.cells:
            done = (self.folder(cell) / RESULT).is_file()
            steps = cell.train.steps
            lines.append(f"  {cell.name:<40} {steps} steps{'  (finished: skipped)' if done else ''}")
        return "\n".join([*lines, *(f"  note: {note}" for note in self.notes)])

    def folder(self, cell: Cell) -> Path:
        return self.out / "cells" / cell.name

    def conversion(self, cell: Cell) -> Path:
        """The cell's converted model's folder, shared by the EESD settings of one (method, seed): EESD changes the
        training only, so they start from the very same weights."""
        return self.out / "conversions" / f"{cell.method}-seed-{cell.seed}"


def task_of_model(model: str) -> str:
    """The task the dense model trains on, from its config alone (no weights read): its family's (CLIP), else
    contrastive for an encoder (a family that attends both ways, not configured as a decoder: what
    `upcycle.tasks.kind.is_encoder` says of the loaded model), else next tokens."""
    _, config = dense_config(model)
    family = family_of(config)
    if family.task_of(config) is None and family.bidirectional and not getattr(config, "is_decoder", False):
        return "contrastive"
    return family.task_of(config) or "causal_lm"


def make_plan(request: CompareRequest, out: str | Path) -> Plan:
    """Every cell's configs, checked (method, arguments, ranges, recipes, OUT, existing cells) before any output."""
    methods, eesd, seeds = parse_grid(request)
    task = task_of_model(request.model)             # also: the model exists and its architecture is supported
    out = Path(out).expanduser()
    root = out.absolute()
    recipes = read_recipes(request, methods)

    def train_config(method: str, model: str, seed: int, value: float | None) -> TrainConfig:
        data = recipes.train_data(method)
        data["model"], data["seed"] = model, seed
        if value is not None:
            data.setdefault("regularizers", {})["eesd"] = value
        return build(TrainConfig, data)      # a config checks itself when built

    dense_train = train_config(DENSE, request.model, seeds[0], 0.0)
    calibration = None
    from_texts: list[tuple[TrainConfig, ConvertConfig]] = []    # encoder cells calibrated on the training texts
    cells: list[Cell] = []
    for method in methods:
        for value in eesd:
            for seed in seeds:
                train = train_config(method, request.model, seed, value)
                coefficient = train.regularizers.eesd          # the recipe's own when --eesd is not given
                name = f"{method}-eesd-{eesd_label(coefficient)}-seed-{seed}"
                data = json_copy(recipes.convert)
                recipe_method = data.get("method")
                data["method"], data["model"], data["seed"] = method, request.model, seed
                # a convert recipe's method_args belong to the method it names; other methods start from none
                args = dict(data.get("method_args") or {}) if recipe_method in (None, method) else {}
                data["method_args"] = {**args, **recipes.method_sets[method].get("method_args", {})}
                for key, section in recipes.method_sets[method].items():
                    if key != "method_args":
                        data[key] = {**data.get(key, {}), **section} if isinstance(section, dict) else section
                texts = False
                if get_method(method).needs_calibration and not (data.get("calibration") or {}).get("data"):
                    if task == "contrastive":     # a pair file is no calibration text: its texts, as the task reads
                        data.setdefault("calibration", {})["data"], texts = str(root / CALIBRATION_TEXTS), True
                    else:
                        data.setdefault("calibration", {})["data"], calibration = _default_calibration(
                            request.model, task, dense_train, root, calibration)
                convert = build(ConvertConfig, data)
                plan_conversion(convert, writing=False, build=False)     # refused now, as its run would
                if texts:
                    from_texts.append((train, convert))
                moe = root / "conversions" / f"{method}-seed-{seed}" / "moe"
                cells.append(Cell(name, method, coefficient, seed, convert,
                                  dataclasses.replace(train, model=str(moe))))
    for seed in seeds:
        cells.append(Cell(f"{DENSE}-seed-{seed}", DENSE, None, seed, None,
                          train_config(DENSE, request.model, seed, 0.0)))
    plan = Plan(out, request.model, task, tuple(methods), cells, request.keep, calibration,
                text_calibration(root / CALIBRATION_TEXTS, from_texts) if from_texts else None)
    _check_out(plan, request)
    plan.given = compare_inputs(plan, request)
    return plan


def _default_calibration(model: str, task: str, train: TrainConfig, root: Path,
                         pairs: tuple[Path, str | None] | None) -> tuple[str, tuple[Path, str | None] | None]:
    """The calibration data of a data-aware method when none is given: the recipe's training data (CLIP: its
    image-caption pairs, written once as model inputs; text: the recipe's data file); the converter's own default
    (the embedded Wikipedia train split, the recipe's default data too) on the embedded model."""
    if task == "clip":
        path = root / CALIBRATION_PAIRS
        return str(path), (path, train.data)
    if train.data is not None:
        return train.data, pairs
    if model in DEFAULT_MODEL_NAMES:
        return None, pairs
    raise UpcycleError(f"a data-aware method needs calibration data: give the recipe a `data` file, or "
                       f"--convert-set calibration.data=FILE (model {model!r} has no embedded default)")


def compare_inputs(plan: Plan, request: CompareRequest) -> list[Input]:
    """Every path the comparison reads, for the output checks (`upcycle.outputs.claims`)."""
    train = plan.cells[-1].train
    return [*(Input(what, path) for what, path in model_inputs(request.model)),
            *inputs(("training recipe", recipe_path(request.train_recipe, "train")),
                    ("conversion recipe", recipe_path(request.convert_recipe, "convert")),
                    ("training data", train.data), ("held-out data", train.eval_data),
                    *((f"{r.partition('=')[0]}'s recipe", recipe_path(r.partition("=")[2], "train"))
                      for r in request.method_recipes))]


def _check_out(plan: Plan, request: CompareRequest) -> None:
    """OUT may be new, or a compare folder whose existing cells have the plans this run would give them (where
    OUT may be at all is `compare_inputs` and `upcycle.outputs.claims.claim_output`'s to say)."""
    if plan.out.is_dir() and any(plan.out.iterdir()) and not (plan.out / STUDY).is_file():
        raise UpcycleError(f"output {plan.out} exists and is not an `upcycle compare` folder (no {STUDY}); "
                           f"choose a new folder")
    if (plan.out / STUDY).is_file():
        try:
            model = read_json_file(plan.out / STUDY, "study record").get("model")
        except (OSError, ValueError) as e:
            raise UpcycleError(f"{plan.out / STUDY} cannot be read ({e})") from None
        if model != plan.model:
            raise UpcycleError(f"{plan.out} is a comparison of model {model!r}, not {plan.model!r}: choose a new OUT")
    for cell in plan.cells:
        saved = plan.folder(cell) / "plan.json"
        if not saved.is_file():
            continue
        try:
            before = read_json_file(saved, "cell plan")
        except (OSError, ValueError) as e:
            raise UpcycleError(f"cell {cell.name}: {saved} cannot be read ({e}); move the cell folder away") from None
        now = cell.describe()
        differ = sorted(k for part in ("convert", "train") for k in _diff(before.get(part), now[part], part))
        if differ:
            raise UpcycleError(f"cell {cell.name} in {plan.out} was planned with other settings ({', '.join(differ)}"
                               f" differ); a cell is only skipped or resumed with the settings it ran with: use a "
                               f"new OUT, or move {plan.folder(cell)} away")


def _diff(a, b, where: str) -> list[str]:
    """Dotted keys where two config dicts differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [k for key in sorted(set(a) | set(b)) for k in _diff(a.get(key), b.get(key), f"{where}.{key}")]
    return [] if a == b else [where]
