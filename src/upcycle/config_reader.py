"""Reading a run configuration (docs/design.md principle 8): YAML recipes, `--set`, and the values of flags, into
the dataclasses of `upcycle.config`.

A recipe is a YAML mapping with the same nesting as the dataclasses; `--set a.b=v` overrides one key (the value
is parsed as YAML, so `3`, `0.5`, `true`, `[1, 3]` and `null` mean what they say). Unknown keys and wrong types
are refused with the key's dotted path, before anything runs.

Numbers follow one rule, here and for method arguments (`coerce`): a number-typed key takes a number in any form
a person writes it (`1e-3`, `1E-3`, `.5`, `5.`, `1e+3`, `-2.5E-4`, `8`). YAML 1.1 reads some of these as
strings (`1e-3` has no dot), so a string that is a decimal number literal becomes a float for a float key, and an
int key takes a number whose value is whole (`1e5`, `8.0`) but refuses `2.5`. The words `inf` and `nan` (any case,
signed; YAML spells them `.inf`, `.nan`) are the float's non-finite values, as on the command line (`--lr inf`):
each key's range check then refuses them where a finite number is needed, saying so. Only number-typed keys
convert: `method=1e3` stays the string '1e3' (and is refused as an unknown method), and no other word is a number.
Booleans are YAML's (`true`, `no`...). The command-line flags of a config key go through the same rule (cli.py).
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from pathlib import Path

import yaml

from .config import clip_text, short_value
from .errors import UpcycleError

# A decimal number as people write it: sign, digits with an optional point (or a point and digits), exponent.
_NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")
_INTEGER = re.compile(r"[+-]?\d+")
_NON_FINITE = re.compile(r"[+-]?(inf|infinity|nan)", re.IGNORECASE)


def _number(value, kind: type, where: str):
    """`value` as `kind` (int or float): a YAML number, or a string YAML left unread such as '1e-3'."""
    wrong = UpcycleError(f"{where} must be {kind.__name__}, got {short_value(value)} ({type(value).__name__})")
    if isinstance(value, bool):          # bool is an int subclass; true is not 1 here
        raise wrong
    if isinstance(value, str):
        text = value.strip()
        if _INTEGER.fullmatch(text):
            value = int(text)            # exact, however many digits
        elif _NUMBER.fullmatch(text) or _NON_FINITE.fullmatch(text):
            value = float(text)
        else:
            raise wrong
    if kind is float and isinstance(value, (int, float)):
        return float(value)
    if kind is int and isinstance(value, int):
        return value
    if kind is int and isinstance(value, float):
        # a whole number written as a float (`1e5` tokens, `8.0` experts) is that int; 2.5 is not an int
        if math.isfinite(value) and value.is_integer():
            return int(value)
        raise UpcycleError(f"{where} must be a whole number (int), got {short_value(value)}")
    raise wrong


def _fits_shape(value, hint) -> bool:
    """Whether `value` has the outer shape of `hint` (a sequence for a list/tuple, a mapping for a dict or
    dataclass, a scalar otherwise): the union member whose error message to show."""
    origin = typing.get_origin(hint)
    if origin in (list, tuple) or hint in (list, tuple):
        return isinstance(value, (list, tuple))
    if origin is dict or hint is dict or dataclasses.is_dataclass(hint):
        return isinstance(value, dict)
    return not isinstance(value, (list, tuple, dict))


def coerce(value, hint, where: str):
    """`value` (from YAML, `--set` or Python) checked and converted to the type `hint` (see the module docstring
    for the number rule); `where` names the key in the error."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        members = [a for a in args if a is not type(None)]
        for arg in members:
            try:
                return coerce(value, arg, where)
            except UpcycleError as e:
                errors.append((arg, str(e)))
        # report the member the value was meant for: a list's error for a list, a number's for a scalar
        raise UpcycleError(next((e for arg, e in errors if _fits_shape(value, arg)), errors[0][1]))
    if dataclasses.is_dataclass(hint):
        return build(hint, value, where + ".")
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise UpcycleError(f"{where} must be a list, got {short_value(value)}")
        return origin(coerce(v, args[0], f"{where}[{i}]") for i, v in enumerate(value))
    if hint is dict or origin is dict:
        if not isinstance(value, dict):
            raise UpcycleError(f"{where} must be a mapping, got {short_value(value)}")
        return dict(value)
    if hint in (int, float):
        return _number(value, hint, where)
    if hint is bool and not isinstance(value, bool):
        raise UpcycleError(f"{where} must be true or false, got {short_value(value)} ({type(value).__name__})")
    if hint is str and isinstance(value, bool):
        # YAML 1.1 reads yes/no/on/off as booleans: `mixed_precision: no` arrives as False
        raise UpcycleError(f"{where} must be a string, got {short_value(value)}: YAML reads the words yes, no, on, "
                           f"off, true and false as booleans; quote the word ({where.rsplit('.', 1)[-1]}: 'no')")
    if not isinstance(value, hint):
        raise UpcycleError(f"{where} must be {hint.__name__}, got {short_value(value)} ({type(value).__name__})")
    return value


def build(cls, data: dict | None, where: str = ""):
    """Build dataclass `cls` from a nested mapping, refusing unknown keys and wrong types."""
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise UpcycleError(f"{where or 'config'} must be a mapping, got {short_value(data)}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = set(data) - set(names)
    if unknown:
        raise UpcycleError(f"unknown config key(s) {sorted(f'{where}{k}' for k in unknown)}; "
                           f"valid keys here: {', '.join(where + n for n in names)}")
    return cls(**{k: coerce(v, hints[k], where + k) for k, v in data.items()})


def _yaml_problem(error: yaml.YAMLError) -> str:
    """A one-line account of a YAML syntax error (PyYAML's own message spans several lines with a caret)."""
    problem = getattr(error, "problem", None) or str(error).splitlines()[0]
    mark = getattr(error, "problem_mark", None)
    return f"{problem} (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else problem


# A recipe is a few hundred bytes; these bounds only stop hostile YAML: a megabyte of text, and 100,000 values once
# aliases are expanded (nested aliases expand exponentially: 351 bytes can stand for billions of values).
MAX_RECIPE_BYTES = 2**20
MAX_YAML_VALUES = 100_000


def safe_yaml(text: str):
    """YAML's safe subset (no Python tags), refused when it expands to more than MAX_YAML_VALUES values, refers
    to itself or nests too deeply. Raises yaml.YAMLError or UpcycleError."""
    loader = yaml.SafeLoader(text)
    try:
        try:
            node = loader.get_single_node()
        except RecursionError:
            raise UpcycleError("the YAML nests too deeply") from None
        if node is None:
            return None
        _count_values(node)
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _count_values(root) -> int:
    """The number of values `root` stands for with its aliases expanded (each alias is the same node object, so
    a memo keeps this linear in the text); refused past the limit or for a value that contains itself."""
    sizes: dict[int, int] = {}
    stack = [(root, False)]
    on_path: set[int] = set()
    while stack:
        node, done = stack.pop()
        key = id(node)
        children = [] if isinstance(node, yaml.ScalarNode) else \
            [c for pair in node.value for c in pair] if isinstance(node, yaml.MappingNode) else list(node.value)
        if done:
            on_path.discard(key)
            sizes[key] = 1 + sum(sizes[id(c)] for c in children)
            if sizes[key] > MAX_YAML_VALUES:
                raise UpcycleError(f"the YAML expands to more than {MAX_YAML_VALUES:,} values (through its "
                                   f"aliases); a recipe is far smaller")
            continue
        if key in sizes:
            continue
        if key in on_path:
            raise UpcycleError("the YAML refers to itself (a recursive alias)")
        on_path.add(key)
        stack.append((node, True))
        stack.extend((c, False) for c in children if id(c) not in sizes)
    return sizes[id(root)]


def set_override(data: dict, assignment: str) -> None:
    """Apply one `a.b.c=value` to a nested mapping in place (the value is YAML; numbers see `coerce`)."""
    if "=" not in assignment:
        raise UpcycleError(f"--set expects key=value, got {short_value(assignment)}")
    key, raw = assignment.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise UpcycleError(f"--set {assignment}: the key must be dotted names such as moe.top_k, "
                           f"got {short_value(key)}")
    try:
        value = safe_yaml(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise UpcycleError(f"--set {clip_text(assignment)}: the value is not valid YAML: {_yaml_problem(e)} "
                           f"(quote a string, close a [list])") from None
    except UpcycleError as e:
        raise UpcycleError(f"--set {clip_text(assignment)}: {e}") from None
    node = data
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise UpcycleError(f"--set {key}: {part!r} is not a section")
    node[parts[-1]] = value


# The recipes that ship inside the package (package data, so a wheel has them too): one folder per command kind.
RECIPES = Path(__file__).resolve().parent / "recipes"
RECIPE_KINDS = ("convert", "train")
# A recipe *name* is one word of letters, digits, '-' and '_': no folder part and no suffix. Anything else is a
# path, so `./smollm2-copy` or `my.yaml` always reads the file, and a name never depends on the current directory.
_RECIPE_NAME = re.compile(r"[A-Za-z0-9_-]+")


def recipe_names(kind: str) -> tuple[str, ...]:
    """The packaged recipes of a command kind ('convert' or 'train'), by name."""
    if kind not in RECIPE_KINDS:
        raise ValueError(f"recipe kind {kind!r}: one of {RECIPE_KINDS}")
    return tuple(sorted(p.stem for p in (RECIPES / kind).glob("*.yaml")))


def recipe_path(text: str | Path | None, kind: str) -> Path | None:
    """What `--config TEXT` reads: a name (`smollm2-copy`) is the packaged `kind` recipe of that name, anything
    else a path (as given). An unknown name is refused with the names there are."""
    if text is None or isinstance(text, Path) or not _RECIPE_NAME.fullmatch(text):
        return None if text is None else Path(text)
    names = recipe_names(kind)
    if text not in names:
        hint = f"; to read the file {text!r} here, write ./{text}" if Path(text).is_file() else \
            "; a recipe file is given by its path (with a '/' or a .yaml suffix)"
        raise UpcycleError(f"--config {text}: no packaged {kind} recipe of that name (the {kind} recipes: "
                           f"{', '.join(names)}){hint}")
    return RECIPES / kind / f"{text}.yaml"


def load_recipe(path: str | Path | None) -> dict:
    """A YAML recipe as a nested mapping (empty when no path); a file that is missing, not a file, not text,
    not YAML or not a mapping is refused with its name."""
    if path is None:
        return {}
    file = Path(path).expanduser()
    if file.exists() and not file.is_dir() and not file.is_file():
        raise UpcycleError(f"recipe {path} is not a regular file (a pipe or a device); --config takes a YAML file")
    if file.is_file() and file.stat().st_size > MAX_RECIPE_BYTES:
        raise UpcycleError(f"recipe {path} is {file.stat().st_size:,} bytes; a recipe is at most "
                           f"{MAX_RECIPE_BYTES:,} bytes of YAML")
    try:
        data = safe_yaml(file.read_text(encoding="utf-8"))
    except UpcycleError as e:
        raise UpcycleError(f"recipe {path}: {e}") from None
    except FileNotFoundError:
        raise UpcycleError(f"recipe {path} does not exist") from None
    except IsADirectoryError:
        raise UpcycleError(f"recipe {path} is a directory; --config takes a YAML file") from None
    except UnicodeDecodeError:
        raise UpcycleError(f"recipe {path} is not a text file (a YAML recipe is UTF-8 text)") from None
    except OSError as e:       # permissions, a device, ...
        raise UpcycleError(f"recipe {path} cannot be read: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise UpcycleError(f"recipe {path} is not valid YAML: {_yaml_problem(e)}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UpcycleError(f"recipe {path} must be a mapping of config keys at the top level, "
                           f"got a {type(data).__name__}")
    return data


OVERWRITE_IS_A_FLAG = ("overwrite is not a recipe or --set key: replacing an existing output is decided on the "
                       "command line only (--overwrite), so that a shared recipe cannot delete folders")


def refuse_overwrite_key(data: dict, where: str) -> None:
    """A recipe (or --set) that asks to replace outputs is refused with the reason."""
    if isinstance(data, dict) and "overwrite" in data:
        raise UpcycleError(f"{where}: {OVERWRITE_IS_A_FLAG}")
