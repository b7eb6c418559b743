"""Registry of upcycling initializations (one registered method per file, mergekit style).

A method is a pure function of one dense FFN, what the conversion gives every layer (`LayerInputs`: the expert
count, top-k, a seeded generator, calibration activations) and its own arguments (no nn.Module, no I/O):

    @dataclass(frozen=True)
    class NameArgs:
        <method arguments with type hints and defaults>

    @register("name", paper="...", preserves_function=...)
    def name(ffn: FFNWeights, layer: LayerInputs, args: NameArgs) -> ExpertInit

The signature is the schema: the class its `args` parameter names holds the method's arguments, their
annotations are the types `--set method_args.x=v` is checked against (with the config's rule for numbers,
`upcycle.config_reader.coerce`: `1E-3` and `.25` are floats), their defaults the defaults. An argument's allowed values
are declared there too, `ratio: Annotated[float, Range(0, 1)] = 0.5` (`config.Range`), and checked with the types,
so an out-of-range value is refused in the conversion's validation, before the model loads. A float argument
without a declared range is any finite float (NaN or inf is no method's argument).
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..config import Bound, OneOf, Range
from ..config_reader import coerce
from ..core.ffn import FFNWeights
from ..errors import UpcycleError


@dataclass(frozen=True)
class LayerInputs:
    """What the conversion gives a method for one layer (not the user's): the experts to make, the experts each
    token takes, a seeded generator, whether top-k weights are renormalized, and the layer's calibration
    activations [N, D] (a method registered with needs_calibration gets them; others get None)."""

    num_experts: int
    top_k: int = 1
    generator: torch.Generator | None = None
    normalize_topk: bool = True
    activations: torch.Tensor | None = None


# The conversion's arguments (`LayerInputs`' fields), not the user's.
COMMON_ARGS = tuple(f.name for f in dataclasses.fields(LayerInputs))


@dataclass(frozen=True)
class ExpertInit:
    """A method's output for one layer: stacked experts, router rows, optional shared experts, facts."""

    experts: FFNWeights
    router_ED: torch.Tensor
    router_bias_E: torch.Tensor | None = None
    shared: FFNWeights | None = None
    info: dict = field(default_factory=dict)
    # data methods: a group id per calibration token (cluster's partition), compared with the router's top-1
    token_clusters: torch.Tensor | None = None


@dataclass(frozen=True)
class LayerLayout:
    """A method's output in shapes, for a dense FFN of width F: routed experts `routed_width` wide, one shared
    expert `shared_width` wide (None: none), a router bias or not. Declared with the method (`register(layout=)`)
    so that a conversion can be planned before a weight is read (--dry-run, streaming); the contract test checks
    every method's declaration against what it returns."""

    routed_width: int
    shared_width: int | None = None
    router_bias: bool = False


def same_width(width: int, args: dict) -> LayerLayout:
    """The default layout: every expert as wide as the dense FFN, no shared expert, no router bias."""
    return LayerLayout(width)


NOT_DENSE_PLUS_CHANGE = "its experts are not the dense FFN plus a change of each"


@dataclass(frozen=True)
class MethodArg:
    name: str
    type: type
    default: object
    bound: Bound | None = None      # the allowed values declared with the signature (None: any of the type)

    def describe(self) -> str:
        """'<float> in [0, 1]': the type and the allowed values, for the listing."""
        return f"<{self.type.__name__}>" + (f" {self.bound.describe()}" if self.bound is not None else "")


@dataclass(frozen=True)
class Method:
    name: str
    fn: Callable[..., ExpertInit]
    paper: str
    summary: str
    args: dict[str, MethodArg]
    args_class: type                # the dataclass its `args` parameter names (the schema)
    needs_calibration: bool
    # Whether the initialized layer reproduces the dense FFN, given (method args, normalize_topk, dropless).
    preserves: Callable[[dict, bool, bool], bool]
    # (dense FFN width, resolved args) -> the shapes it makes (LayerLayout)
    layout: Callable[[int, dict], LayerLayout] = same_width
    # (num_experts, top_k, resolved args) -> None, or raises: the counts the method can make (checked with the
    # arguments, before any weight)
    counts: Callable[[int, int, dict], None] = lambda num_experts, top_k, args: None
    # why its experts cannot be held as the dense FFN plus a low-rank change each (`moe.experts: delta`), or None
    # when they are the dense FFN plus a change (exact when the change has at most the delta rank)
    no_deltas: str | None = NOT_DENSE_PLUS_CHANGE

    def __call__(self, ffn: FFNWeights, args: dict, **common) -> ExpertInit:
        """Run the method with resolved `args` and the conversion's arguments (`LayerInputs`' fields)."""
        return self.fn(ffn, LayerInputs(**common), self.args_class(**args))

    def resolve_args(self, given: dict) -> dict:
        """Defaults filled in, unknown names and wrong types refused (before any weight is touched)."""
        unknown = set(given) - set(self.args)
        if unknown:
            known = ", ".join(self.args) or "none"
            raise UpcycleError(f"method {self.name!r} has no argument(s) {sorted(unknown)}; its arguments: {known}")
        resolved = {}
        for name, arg in self.args.items():
            value = given.get(name, arg.default)
            # the config's one rule: numbers in any written form ('1E-3', '.25') for int/float arguments
            where = f"method {self.name!r} argument {name!r}"
            value = coerce(value, arg.type, where)
            if arg.bound is not None and not arg.bound.contains(value):
                raise UpcycleError(f"{where} must be {arg.bound.describe()}, got {value!r}")
            resolved[name] = value
        return resolved


METHODS: dict[str, Method] = {}


def register(name: str, *, paper: str, preserves_function: bool | Callable[[dict, bool, bool], bool] = False,
             needs_calibration: bool = False, layout: Callable[[int, dict], LayerLayout] = same_width,
             counts: Callable[[int, int, dict], None] | None = None, no_deltas: str | None = NOT_DENSE_PLUS_CHANGE):
    """Register `fn(ffn, layer, args)` under `name`; the dataclass its `args` parameter names is the method's
    schema; `layout` says the shapes it makes (default: experts as wide as the dense FFN, nothing shared);
    `counts(num_experts, top_k, args)` refuses the expert counts it cannot make (default: any); `no_deltas` says
    why its experts cannot be stored as delta experts (None: they are the dense FFN plus a change of each)."""

    def wrap(fn: Callable[..., ExpertInit]) -> Callable[..., ExpertInit]:
        if list(inspect.signature(fn).parameters) != ["ffn", "layer", "args"]:
            raise TypeError(f"method {name}: the signature must be (ffn, layer, args)")
        args_class = typing.get_type_hints(fn)["args"]
        if not dataclasses.is_dataclass(args_class):
            raise TypeError(f"method {name}: `args` must name a dataclass of the method's arguments")
        hints = typing.get_type_hints(args_class, include_extras=True)     # keeps Annotated's bounds
        args = {}
        for f in dataclasses.fields(args_class):
            if f.default is dataclasses.MISSING:
                raise TypeError(f"method {name}: argument {f.name} needs a default")
            args[f.name] = _argument(name, f.name, hints[f.name], f.default)
        preserves = preserves_function if callable(preserves_function) else (lambda *_: bool(preserves_function))
        summary = (inspect.getdoc(fn) or "").split("\n")[0]
        METHODS[name] = Method(name, fn, paper, summary, args, args_class, needs_calibration, preserves, layout,
                               **({"counts": counts} if counts is not None else {}), no_deltas=no_deltas)
        return fn

    return wrap


def _argument(method: str, name: str, hint, default) -> MethodArg:
    """The argument's schema from its annotation: `T` or `Annotated[T, <one Range or OneOf>]`."""
    bounds = []
    if typing.get_origin(hint) is typing.Annotated:
        hint, *extras = typing.get_args(hint)
        bounds = [x for x in extras if isinstance(x, (Range, OneOf))]
    if len(bounds) > 1:
        raise TypeError(f"method {method}: argument {name} declares {len(bounds)} bounds; one at most")
    bound = bounds[0] if bounds else (Range() if hint is float else None)
    if isinstance(bound, Range) and hint not in (int, float):
        raise TypeError(f"method {method}: argument {name} has a Range but is not a number ({hint})")
    if bound is not None and not bound.contains(default):
        raise TypeError(f"method {method}: argument {name}'s default {default!r} is not {bound.describe()}")
    return MethodArg(name, hint, default, bound)


def get_method(name: str) -> Method:
    if name not in METHODS:
        raise UpcycleError(f"unknown method {name!r}; available: {', '.join(sorted(METHODS))}")
    return METHODS[name]


def random_router(num_experts: int, hidden_size: int, std: float, generator: torch.Generator) -> torch.Tensor:
    """Router rows ~ N(0, std^2) (Sparse Upcycling: the router is the only freshly initialized part)."""
    return torch.randn(num_experts, hidden_size, generator=generator, dtype=torch.float32) * std
