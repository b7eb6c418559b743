"""What the commands' arguments share: the number rule for flags, flags that set config keys, and JSON output.

A flag of `convert` or `train` that sets a config key is declared once, as a `ConfigFlag` naming its dotted key:
the parser takes the key's existence, default (shown in the help) and allowed values from the config dataclass,
and the flag's text becomes the key's value through the config's own rule (`upcycle.config_reader.coerce`:
`--calibration-tokens 1e5` means what `--set calibration.tokens=1e5` means), so a flag cannot drift from its key.
Configuration precedence (docs/design.md principle 8): dataclass defaults < `--config recipe.yaml` < explicit
flags < `--set key=value` (repeatable, dotted keys, YAML values).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import typing
from dataclasses import dataclass

from ..config_reader import coerce, refuse_overwrite_key, set_override
from ..errors import UpcycleError


def whole_number(text: str) -> int:
    """A run flag's integer (not a config key: --stop-after, eval's --tokens, tiny-clip's sizes), read by the
    config's number rule like every other number the user writes (`--tokens 1e5` is 100000)."""
    try:
        return coerce(text, int, "value")
    except UpcycleError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def seed_number(text: str) -> int:
    """A --seed flag: a whole number from 0 to SEED_MAX, as the config's seed keys take (every RNG a run seeds
    takes it; a larger one overflowed torch's generator)."""
    from ..config import SEED_MAX

    seed = whole_number(text)
    if not 0 <= seed <= SEED_MAX:
        raise argparse.ArgumentTypeError(f"must be between 0 and {SEED_MAX}, got {seed}")
    return seed


def comma_list(text: str) -> list[str]:
    """'1, 3,-1' -> ['1', '3', '-1']: the items stay text, read by the key's element type (coerce)."""
    return [x for x in text.replace(" ", "").split(",") if x]


@dataclass(frozen=True)
class ConfigFlag:
    """A command-line flag that sets the config key `key` (dotted, e.g. moe.top_k)."""

    flag: str
    key: str
    help: str
    split: bool = False                 # a comma-separated list (--layers 1,3,5) for a list-typed key
    # the values offered when the key's field declares none (read when the parser is built, so that a registry
    # the values come from is imported only then)
    choices: typing.Callable[[], tuple[str, ...]] | None = None


def config_field(cls: type, key: str) -> dataclasses.Field:
    """The dataclass field a dotted key names in config class `cls`; a key that is not there is a programming
    error, raised when the parser is built (so every command fails at once, not the flag silently)."""
    *sections, leaf = key.split(".")
    for section in sections:
        fields = {f.name: f for f in dataclasses.fields(cls)}
        if section not in fields or not dataclasses.is_dataclass(typing.get_type_hints(cls)[section]):
            raise TypeError(f"flag for {key!r}: {cls.__name__} has no section {section!r}")
        cls = typing.get_type_hints(cls)[section]
    fields = {f.name: f for f in dataclasses.fields(cls)}
    if leaf not in fields:
        raise TypeError(f"flag for {key!r}: {cls.__name__} has no key {leaf!r}")
    return fields[leaf]


def flag_choices(cls: type, key: str, flag: ConfigFlag | None = None) -> tuple[str, ...] | None:
    """The values a key's flag offers: the choices the config field declares (`upcycle.config.choice`), else the
    flag's own."""
    choices = config_field(cls, key).metadata.get("choices")
    if choices:
        return tuple(c for c in choices if isinstance(c, str))
    return flag.choices() if flag is not None and flag.choices is not None else None


def default_text(value) -> str:
    """A config default as the help shows it (as one would write it on the command line)."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value)
    return f"{value:g}" if isinstance(value, float) else str(value)


def add_config_flags(parser: argparse.ArgumentParser, cls: type, flags: tuple[ConfigFlag, ...]) -> None:
    for f in flags:
        field = config_field(cls, f.key)
        default = field.default_factory() if field.default is dataclasses.MISSING else field.default
        shown = "" if default is None else f" (default {default_text(default)})"
        choices = flag_choices(cls, f.key, f)
        # no argparse default: a flag left out must not override the recipe (precedence); no argparse type:
        # the text is read by the key's type when the config is built
        parser.add_argument(f.flag, dest=f.key, help=f.help + shown, choices=choices,
                            type=comma_list if f.split else None,
                            metavar=None if choices else f.flag.lstrip("-").replace("-", "_").upper())


def nested(data: dict, flags: dict) -> dict:
    """Put each non-None dotted flag into the nested recipe mapping."""
    for key, value in flags.items():
        if value is not None:
            node = data
            *parents, leaf = key.split(".")
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = value
    return data


def flag_values(args: argparse.Namespace, flags: tuple[ConfigFlag, ...]) -> dict:
    """{dotted key: the flag's text (or list of texts)} for every config flag, None where not given."""
    return {f.key: getattr(args, f.key) for f in flags}


def apply_sets(data: dict, assignments: list[str]) -> None:
    for assignment in assignments:
        refuse_overwrite_key({assignment.split("=", 1)[0].strip(): None}, f"--set {assignment}")
        set_override(data, assignment)


class NonFiniteResult(UpcycleError):
    """A computed result that is NaN or infinite."""


def dumps(result: dict) -> str:
    """JSON as the commands print and write it: valid JSON, so a NaN or infinite number is an error (a model or
    a run that produced one is reported, not written as the invalid token NaN)."""
    try:
        return json.dumps(result, indent=2, allow_nan=False)
    except ValueError:
        bad = [key for key, value in _leaves(result) if isinstance(value, float) and not math.isfinite(value)]
        raise NonFiniteResult(f"the result holds non-finite numbers ({', '.join(bad[:5])}): the model's outputs "
                              f"are not finite (NaN or infinite weights or activations)") from None


def _leaves(value, prefix: str = ""):
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _leaves(item, f"{prefix}{key}.")
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _leaves(item, f"{prefix}{i}.")
    else:
        yield prefix.rstrip("."), value


def quiet_transformers() -> None:
    """--quiet: transformers' own bars (weight loading, downloads) off too, not only ours."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
