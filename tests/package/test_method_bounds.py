"""Method argument bounds declared in the signature (`Annotated[float, Range(...)]`): every
declared bound refuses a value just outside it before the dense weights load, naming the method, the argument,
the bound and the value; the values on the bound that it allows are accepted and computed with by the method;
`upcycle methods` shows the bounds.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Annotated

import pytest
import torch

from upcycle.cli import main, parser
from upcycle.commands.convert import convert_config
from upcycle.conversion.validate import resolve_method
from upcycle.core.ffn import FFNWeights
from upcycle.errors import UpcycleError
from upcycle.methods import METHODS, OneOf, Range, register

# What each method declares, written out so that loosening or dropping a bound fails here. The ranges are the
# ones the method bodies checked before (after the model had loaded), plus cluster's restarts and iters, which
# k-means refused with a ValueError, and finiteness for every float.
DECLARED = {
    ("cluster", "tau"): "in (0, 1]", ("cluster", "min_rank_fraction"): "in [0, 1]",
    ("cluster", "pca_factor"): "in [1, inf)", ("cluster", "restarts"): "in [1, inf)",
    ("cluster", "iters"): "in [1, inf)", ("cluster", "damping"): "in [0, inf)",
    ("drop", "ratio"): "in [0, 1]", ("drop_svd", "fraction"): "in [0, 1]",
    ("granular", "granularity"): "in [1, inf)",
    ("noise", "std"): "in [0, inf)", ("noise", "fraction"): "in [0, 1]",
    ("spri", "rho"): "in [0, inf)", ("spri", "delta"): "in [0, inf)", ("spri", "perturbation"): "in [0, inf)",
    ("spri", "placement"): "one of 'down', 'gate', 'up'",
    # undeclared float arguments: any finite float
    **{(m, "router_std"): "finite" for m in ("copy", "drop", "drop_svd", "granular", "noise", "spri")},
}
BOUNDED = [(m.name, a.name) for m in METHODS.values() for a in m.args.values() if a.bound is not None]


def validate(cfg):
    """The conversion's method check (`make_plan` runs it first), on a config alone."""
    return resolve_method(cfg.method, cfg.method_args, cfg.moe)


def outside(name: str, arg: str) -> list:
    """Values just outside the declared bound: the open end itself or the next representable value beyond a
    closed end (the next integer for ints), NaN and inf for floats, an unlisted word for choices."""
    a = METHODS[name].args[arg]
    if isinstance(a.bound, OneOf):
        return ["nope"]
    b, values = a.bound, []
    step = (lambda x, d: x + d) if a.type is int else (lambda x, d: math.nextafter(x, d * math.inf))
    if b.low is not None:
        values.append(b.low if b.low_open else step(b.low, -1))
    if b.high is not None:
        values.append(b.high if b.high_open else step(b.high, +1))
    return values + ([math.nan, math.inf] if a.type is float else [])


def on_the_bound(name: str, arg: str) -> list:
    """The allowed values at the edges: a closed end itself, the next value inside an open end, every choice."""
    a = METHODS[name].args[arg]
    if isinstance(a.bound, OneOf):
        return list(a.bound.choices)
    b, values = a.bound, []
    for end, inward in ((b.low, 1), (b.high, -1)):
        if end is not None:
            is_open = b.low_open if inward == 1 else b.high_open
            values.append(end if not is_open else (end + inward if a.type is int else
                                                   math.nextafter(end, inward * math.inf)))
    return values


def yaml_text(value) -> str:
    """How a user writes `value` in `--set` (YAML: `.nan`, `.inf`)."""
    if isinstance(value, float) and math.isnan(value):
        return ".nan"
    if isinstance(value, float) and math.isinf(value):
        return ".inf"
    return repr(value) if not isinstance(value, str) else value


def test_every_bound_is_the_declared_one():
    assert {(m, a): METHODS[m].args[a].bound.describe() for m, a in BOUNDED} == DECLARED




@pytest.mark.parametrize("name,arg", BOUNDED)
def test_out_of_range_is_refused_before_the_model_loads(name, arg, tiny_llama, tmp_path, capsys, no_weights_loaded):
    bound = METHODS[name].args[arg].bound
    for value in outside(name, arg):
        out = tmp_path / "out"
        code = main(["convert", str(tiny_llama), str(out), "--method", name,
                     "--set", f"method_args.{arg}={yaml_text(value)}", "--quiet"])
        err = capsys.readouterr().err
        assert code == 2, (value, err)
        assert f"method {name!r} argument {arg!r} must be {bound.describe()}, got {value!r}" in err, err
        assert not out.exists()


def dense_ffn() -> FFNWeights:
    g = torch.Generator().manual_seed(0)
    return FFNWeights(w_up=torch.randn(16, 8, generator=g), w_gate=torch.randn(16, 8, generator=g),
                      w_down=torch.randn(8, 16, generator=g), activation="silu")


@pytest.mark.parametrize("name,arg", BOUNDED)
def test_values_on_the_bound_are_accepted_and_computed_with(name, arg):
    """Each allowed edge value passes the conversion's validation (as `--set` writes it) and the method runs on
    it: the declared bound is no tighter than the method needs and no looser than it can compute."""
    method = METHODS[name]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(200, 8, generator=g) + 0.5
    for value in on_the_bound(name, arg):
        cfg = convert_config(parser(every_command=True).parse_args(["convert", "m", "out", "--method", name,
                                                   "--set", f"method_args.{arg}={yaml_text(value)}"]))
        _, args = validate(cfg)
        assert args[arg] == value and type(args[arg]) is method.args[arg].type
        init = method(dense_ffn(), args, num_experts=4, top_k=2, generator=torch.Generator().manual_seed(0),
                      normalize_topk=True, activations=x)
        assert all(torch.isfinite(t).all() for t in init.experts.tensors().values()), (arg, value)


def test_the_listing_shows_every_bound(capsys):
    assert main(["methods"]) == 0
    text = capsys.readouterr().out
    for name, arg in BOUNDED:
        a = METHODS[name].args[arg]
        assert f"--set method_args.{arg}=<{a.type.__name__}> {a.bound.describe()}   (default {a.default!r})" in text
    assert "method_args.tau=<float> in (0, 1]" in text
    assert "method_args.placement=<str> one of 'down', 'gate', 'up'   (default 'down')" in text
    assert "method_args.router_std=<float> finite   (default 0.02)" in text        # undeclared: any finite float
    assert "method_args.router_bias=<bool>   (default False)" in text            # no bound


def test_range_ends_and_notation():
    half_open = Range(0, 1, low_open=True)
    assert [half_open.contains(v) for v in (0.0, 5e-324, 0.5, 1.0, math.nextafter(1.0, 2.0))] == \
        [False, True, True, True, False]
    assert [Range(0).contains(v) for v in (-5e-324, 0.0, 1e300, math.inf, math.nan)] == \
        [False, True, True, False, False]
    assert not Range(0, 1, high_open=True).contains(1.0) and Range(high=2).contains(-1e300)
    assert [str(r) for r in (half_open, Range(1), Range(high=2, high_open=True))] == ["(0, 1]", "[1, inf)",
                                                                                     "(-inf, 2)"]
    assert Range().describe() == "finite" and Range().contains(-1e300) and not Range().contains(-math.inf)
    assert OneOf("a", "b").contains("a") and not OneOf("a", "b").contains("c")
    with pytest.raises(TypeError):
        Range(1, 0)


def test_a_bound_is_checked_when_the_method_registers():
    """A default outside its own bound, two bounds, or a Range on a non-number is a programming error, raised
    at import (register), not on a user's run."""
    def method(default, annotation):
        args = dataclasses.make_dataclass("Args", [("x", annotation, dataclasses.field(default=default))],
                                          frozen=True)

        def fn(ffn, layer, args):
            raise AssertionError("never run")
        fn.__annotations__ = {"args": args}
        return fn

    def no_default(ffn, layer, args):
        raise AssertionError("never run")
    no_default.__annotations__ = {"args": dataclasses.make_dataclass("Args", [("x", float)], frozen=True)}

    def not_a_dataclass(ffn, layer, args: dict):
        raise AssertionError("never run")

    def old_signature(ffn, *, num_experts, top_k, generator, x=0.5):
        raise AssertionError("never run")

    cases = [(method(2.0, Annotated[float, Range(0, 1)]), "default 2.0 is not in \\[0, 1\\]"),
             (method(0.5, Annotated[float, Range(0, 1), Range(0)]), "declares 2 bounds"),
             (method("a", Annotated[str, Range(0)]), "has a Range but is not a number"),
             (no_default, "argument x needs a default"),
             (not_a_dataclass, "must name a dataclass"),
             (old_signature, "signature must be \\(ffn, layer, args\\)")]
    for fn, message in cases:
        with pytest.raises(TypeError, match=message):
            register("_never_registered", paper="-")(fn)
    assert "_never_registered" not in METHODS


def test_in_range_values_of_the_wrong_type_still_say_the_type():
    with pytest.raises(UpcycleError, match="argument 'ratio' must be float, got 'half'"):
        METHODS["drop"].resolve_args({"ratio": "half"})
    with pytest.raises(UpcycleError, match=r"argument 'granularity' must be a whole number \(int\), got 1.5"):
        METHODS["granular"].resolve_args({"granularity": 1.5})
