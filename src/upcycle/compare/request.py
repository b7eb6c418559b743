"""What a user asks `upcycle compare` for, as written on the command line (or by a script), read into the grid's
axes and the recipes every cell builds its configs from, each piece of text checked and refused with the flag
that gave it (`plan.py` then makes the cells)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..config_reader import coerce, load_recipe, recipe_path, refuse_overwrite_key, set_override
from ..errors import UpcycleError
from ..files import json_copy
from ..methods import get_method

DENSE = "dense"                # the dense-continued baseline's method name
KEEP = ("all", "models", "results")


@dataclass(frozen=True)
class CompareRequest:
    """What the user asked for, as written (the CLI's flags, or a script's arguments)."""

    model: str
    methods: tuple[str, ...]
    train_recipe: str | None
    seeds: tuple[int | str, ...] = (0,)
    eesd: tuple[str | float, ...] | None = None     # "none" or a coefficient; None: the recipe's own
    train_sets: tuple[str, ...] = ()                # KEY=VALUE on the train config
    convert_recipe: str | None = None
    convert_sets: tuple[str, ...] = ()              # KEY=VALUE on the convert config (every method)
    method_sets: tuple[str, ...] = ()               # METHOD.KEY=VALUE on one method's convert config
    method_recipes: tuple[str, ...] = ()            # METHOD=RECIPE: that method's train recipe
    keep: str = "models"


def eesd_label(value: float | None) -> str:
    return "none" if not value else f"{value:g}"


def _eesd_settings(values: tuple[str | float, ...] | None) -> list[float | None]:
    """--eesd values as coefficients (none = 0.0); None = keep the recipe's own value."""
    if values is None:
        return [None]
    if not values:
        raise UpcycleError("--eesd needs at least one value: none or a coefficient such as 1.0")
    out = []
    for text in values:
        if isinstance(text, str) and text.strip().lower() in ("none", "off"):
            value = 0.0
        else:
            value = coerce(text, float, "--eesd value")
            if not (math.isfinite(value) and value >= 0):
                raise UpcycleError(f"--eesd values are none or a finite coefficient >= 0, got {text!r}")
        if value in out:
            raise UpcycleError(f"--eesd lists {eesd_label(value)} twice")
        out.append(value)
    return out


def _seeds(values: tuple[int | str, ...]) -> list[int]:
    if not values:
        raise UpcycleError("--seeds needs at least one seed")
    seeds = [coerce(v, int, "--seeds value") for v in values]
    if any(s < 0 for s in seeds):
        raise UpcycleError(f"--seeds must be whole numbers >= 0, got {list(values)}")
    if len(set(seeds)) != len(seeds):
        raise UpcycleError(f"--seeds lists a seed twice: {seeds}")
    return seeds


def _methods(names: tuple[str, ...]) -> list[str]:
    if not names:
        raise UpcycleError("--methods needs at least one method (see `upcycle methods`)")
    for name in names:
        if name == DENSE:
            raise UpcycleError("the dense-continued baseline is always run: leave 'dense' out of --methods")
        get_method(name)                       # an unknown method is refused with the list of known ones
    if len(set(names)) != len(names):
        raise UpcycleError(f"--methods lists a method twice: {list(names)}")
    return list(names)


def _split_method_key(assignment: str, sep: str, what: str, methods: list[str]) -> tuple[str, str]:
    """'drop.method_args.ratio=0.25' -> ('drop', 'method_args.ratio=0.25') (sep '.'); 'spri=r.yaml' (sep '=')."""
    method, found, rest = assignment.partition(sep)
    if not found or not rest:
        raise UpcycleError(f"{what} {assignment!r}: expected METHOD{sep}...")
    if method not in methods:
        raise UpcycleError(f"{what} {assignment!r}: {method!r} is not one of --methods ({', '.join(methods)})")
    return method, rest


def _recipe(path: str | None, what: str) -> dict:
    data = load_recipe(recipe_path(path, "convert" if what == "convert recipe" else "train"))   # a name or a file
    refuse_overwrite_key(data, f"{what} {path}")
    return data


def parse_grid(request: CompareRequest) -> tuple[list[str], list[float | None], list[int]]:
    """The grid's axes (methods, EESD settings, seeds) from the request's text, each checked."""
    if request.keep not in KEEP:
        raise UpcycleError(f"--keep must be one of {', '.join(KEEP)}, got {request.keep!r}")
    methods = _methods(tuple(request.methods))
    eesd = _eesd_settings(None if request.eesd is None else tuple(request.eesd))
    seeds = _seeds(tuple(request.seeds))
    if request.train_recipe is None:
        raise UpcycleError("compare needs a training recipe (--config, e.g. clip-up or a YAML file): every cell "
                           "trains with it, so the methods get the same token budget")
    return methods, eesd, seeds


@dataclass
class Recipes:
    """The recipes and overrides of a request, read and checked: the training recipe (per method where
    --method-config gives one), the conversion recipe with --convert-set applied, --method-set per method."""

    train: dict
    per_method: dict[str, dict]
    convert: dict
    method_sets: dict[str, dict]
    train_sets: tuple[str, ...]

    def train_data(self, method: str) -> dict:
        """A fresh copy of `method`'s training recipe with --set applied."""
        data = json_copy(self.per_method.get(method, self.train))
        for assignment in self.train_sets:
            refuse_overwrite_key({assignment.split("=", 1)[0].strip(): None}, f"--set {assignment}")
            set_override(data, assignment)
        return data


def read_recipes(request: CompareRequest, methods: list[str]) -> Recipes:
    base_train = _recipe(request.train_recipe, "recipe")
    method_recipes = {}
    for assignment in request.method_recipes:
        method, path = _split_method_key(assignment, "=", "--method-config", methods)
        method_recipes[method] = _recipe(path, "recipe")
    base_convert = _recipe(request.convert_recipe, "convert recipe")
    for assignment in request.convert_sets:
        refuse_overwrite_key({assignment.split("=", 1)[0].strip(): None}, f"--convert-set {assignment}")
        set_override(base_convert, assignment)
    method_sets: dict[str, dict] = {m: {} for m in methods}
    for assignment in request.method_sets:
        method, rest = _split_method_key(assignment, ".", "--method-set", methods)
        set_override(method_sets[method], rest)
    return Recipes(base_train, method_recipes, base_convert, method_sets, tuple(request.train_sets))
