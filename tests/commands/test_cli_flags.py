"""The command-line flags of `convert` and `train` against the run config : every flag is a
config key or one of the listed run flags, lands on that key and nowhere else, offers exactly the values the
config allows, shows the config's default, and reads its value by the config's one number rule.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import typing

import pytest

from upcycle.cli import main, parser
from upcycle.commands import convert, train
from upcycle.commands.flags import (
    ConfigFlag,
    add_config_flags,
    comma_list,
    config_field,
    flag_choices,
    seed_number,
    whole_number,
)
from upcycle.config import (
    CHECKPOINTING,
    EXPORTS,
    MIXED_PRECISIONS,
    NON_FFN,
    REPORT_TO,
    ROUTER_INITS,
    SCHEDULES,
    STORAGE_DTYPES,
    TASKS,
    ConvertConfig,
    TrainConfig,
    to_dict,
)
from upcycle.config_reader import build, coerce
from upcycle.conversion.plan import make_plan
from upcycle.errors import UpcycleError
from upcycle.export.registry import STOCK_CLASSES

COMMANDS = {"convert": (ConvertConfig, convert.CONFIG_FLAGS, convert.convert_config),
            "train": (TrainConfig, train.CONFIG_FLAGS, train.train_config)}
RUN_FLAGS = {"convert": convert.RUN_FLAGS, "train": train.RUN_FLAGS}
# the values each choice flag must offer: the config's allowed values (the run's validators accept each of them
# and refuse others, checked below)
ALLOWED = {"export": EXPORTS, "export_class": ("auto", *STOCK_CLASSES), "schedule": SCHEDULES,
           "mixed_precision": MIXED_PRECISIONS, "task": TASKS, "sources.router": ROUTER_INITS,
           "sources.non_ffn": NON_FFN, "dtype": ("auto", *STORAGE_DTYPES), "report_to": REPORT_TO,
           "activation_checkpointing": CHECKPOINTING}


def subparser(command: str) -> argparse.ArgumentParser:
    actions = parser(every_command=True)._subparsers._group_actions[0]
    return actions.choices[command]


def key_hint(cls: type, key: str):
    *sections, leaf = key.split(".")
    for section in sections:
        cls = typing.get_type_hints(cls)[section]
    return typing.get_type_hints(cls)[leaf]


def leaf_default(cls: type, key: str):
    field = config_field(cls, key)
    return field.default_factory() if field.default is dataclasses.MISSING else field.default


def nested(key: str, value) -> dict:
    """{'moe': {'top_k': v}} for 'moe.top_k'."""
    *sections, leaf = key.split(".")
    data = {leaf: value}
    for section in reversed(sections):
        data = {section: data}
    return data


def flat(data: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in data.items():
        out |= flat(v, f"{prefix}{k}.") if isinstance(v, dict) and k != "method_args" else {prefix + k: v}
    return out


@pytest.mark.parametrize("command", COMMANDS)
def test_every_flag_is_a_config_key_or_a_listed_run_flag(command):
    cls, flags, _ = COMMANDS[command]
    dests = {action.dest for action in subparser(command)._actions}
    config_dests = dests - RUN_FLAGS[command] - {"model"}
    assert RUN_FLAGS[command] <= dests, "a listed run flag no longer exists"
    assert config_dests == {f.key for f in flags}
    for key in config_dests:
        config_field(cls, key)                    # raises for a key the config does not have


def test_a_flag_for_a_key_the_config_lacks_fails_when_the_parser_is_built():
    """What renaming a config field without its flag does: `upcycle` fails at once, naming the key."""
    for key, message in (("moe.num_expert", "MoEConfig has no key 'num_expert'"),
                         ("mo.num_experts", "ConvertConfig has no section 'mo'"),
                         ("seed.x", "has no section 'seed'")):
        with pytest.raises(TypeError, match=message):
            add_config_flags(argparse.ArgumentParser(), ConvertConfig, (ConfigFlag("--x", key, "help"),))


def plan_run(cfg: ConvertConfig) -> None:
    """The checks a conversion makes before a weight is read: its plan, as a run with OUT makes it."""
    make_plan(cfg, writing=True, build=False)


@pytest.mark.parametrize("command", COMMANDS)
def test_choices_are_the_values_the_config_allows(command):
    cls, flags, _ = COMMANDS[command]
    with_choices = {f.key: flag_choices(cls, f.key, f) for f in flags if flag_choices(cls, f.key, f) is not None}
    assert with_choices == {k: v for k, v in ALLOWED.items() if k in with_choices}
    for key, choices in with_choices.items():
        default = leaf_default(cls, key)
        assert default is None or default in choices
        for value in choices:       # each offered value passes the validator the run uses
            cfg = build(cls, nested(key, value))
            plan_run(cfg) if cls is ConvertConfig else None    # a TrainConfig checks itself
        with pytest.raises(UpcycleError, match=key):
            cfg = build(cls, nested(key, "not-a-choice"))
            plan_run(cfg) if cls is ConvertConfig else None    # a TrainConfig checks itself


@pytest.mark.parametrize("command", COMMANDS)
def test_help_shows_the_config_default(command):
    """A flag whose key has a default says it once, `(default X)`, and X read by the key's type is the
    config's default; a key without one (None) has its default told in words."""
    cls, flags, _ = COMMANDS[command]
    helps = {action.dest: action.help for action in subparser(command)._actions}
    for f in flags:
        default, hint = leaf_default(cls, f.key), key_hint(cls, f.key)
        if default is None:       # decided at run time (from the model, the embedded data): told in words
            continue
        shown = re.findall(r"\(default ([^)]*)\)", helps[f.key])
        assert len(shown) == 1 and helps[f.key].count("default") == 1, helps[f.key]
        text = shown[0].split(",") if f.split else shown[0]
        assert coerce(text, hint, f.key) == default, (f.flag, shown[0], default)


def sample(cls: type, f: ConfigFlag) -> str:
    """A value for the flag that differs from the key's default and builds."""
    default, hint = leaf_default(cls, f.key), key_hint(cls, f.key)
    if flag_choices(cls, f.key, f):
        return next(c for c in reversed(flag_choices(cls, f.key, f)) if c != default)
    if f.split:
        return {"placement.layers": "1,-1", "placement.towers": "vision", "train": "router,experts"}[f.key]
    if hint is int:
        return "3" if default != 3 else "4"
    if hint is float:
        return "0.5"
    return "some-value"


@pytest.mark.parametrize("command", COMMANDS)
def test_each_flag_lands_on_its_key_and_nowhere_else(command):
    cls, flags, to_config = COMMANDS[command]
    base = flat(to_dict(to_config(parser(every_command=True).parse_args([command, "m", "out"]))))
    for f in flags:
        text = sample(cls, f)
        got = flat(to_dict(to_config(parser(every_command=True).parse_args([command, "m", "out", f.flag, text]))))
        changed = {k for k in base if got[k] != base[k]}
        assert changed == {f.key}, (f.flag, changed)
        # the value is the text read by the key's type, exactly as a recipe's value would be
        value = text.split(",") if f.split else text
        assert got[f.key] == flat(to_dict(build(cls, nested(f.key, value))))[f.key], (f.flag, got[f.key])


def test_flags_read_numbers_by_the_config_rule(tmp_path, capsys):
    """A flag's text means what `--set key=` of the same text means (`coerce`), not Python's int()/float()."""
    args = ["convert", "m", "out", "--calibration-tokens", "1e5", "--top-k", "2.0", "--layers", "1, -1e0",
            "--num-experts", "8"]
    cfg = convert.convert_config(parser(every_command=True).parse_args(args))
    assert (cfg.calibration.tokens, cfg.moe.top_k, cfg.placement.layers) == (100000, 2, (1, -1))
    args = parser(every_command=True).parse_args(["train", "m", str(tmp_path / "run"), "--lr", "1E-3", "--warmup",
                                                  ".5", "--steps", "2e1"])
    cfg = train.train_config(args)
    assert (cfg.lr, cfg.warmup, cfg.steps) == (1e-3, 0.5, 20) and type(cfg.steps) is int
    for flag, value, message in (("--top-k", "2.5", r"moe.top_k must be a whole number \(int\), got 2.5"),
                                 ("--layers", "1,x", r"placement.layers\[1\] must be int, got 'x'"),
                                 ("--seed", "one", "seed must be int, got 'one'")):
        assert main(["convert", "m", str(tmp_path / "o"), flag, value, "--quiet"]) == 2
        assert re.search(message, capsys.readouterr().err)
    assert not (tmp_path / "o").exists()


def test_no_flag_reads_numbers_on_its_own():
    """Every number on the command line goes through `coerce`: config flags as text into the config, the run
    flags' integers through `whole_number` (a seed through `seed_number`, which reads it so); no parser uses
    Python's int() or float()."""
    root = parser(every_command=True)
    for command, sub in root._subparsers._group_actions[0].choices.items():
        for action in sub._actions:
            assert action.type in (None, comma_list, whole_number, seed_number), (command, action.dest, action.type)
    args = root.parse_args(["train", "m", "out", "--stop-after", "1e1"])
    assert args.stop_after == 10 and type(args.stop_after) is int
    assert root.parse_args(["eval", "m", "--tokens", "1e5"]).tokens == 100000
    assert root.parse_args(["analyze", "m", "out", "--tokens", "2e3"]).tokens == 2000


def test_a_run_flag_that_is_no_whole_number_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as stop:
        parser(every_command=True).parse_args(["eval", "m", "--tokens", "2.5"])
    assert stop.value.code == 2
    assert r"argument --tokens: value must be a whole number (int), got 2.5" in capsys.readouterr().err
