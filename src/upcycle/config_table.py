"""The table of every config key that docs/configuration.md shows, generated from the keys' declarations
(`upcycle.config`: each field's default and its declared range or choices), so the page cannot drift from the
code: `python -m upcycle.config_table` prints it, and a test compares it with the page."""

from __future__ import annotations

import dataclasses
import math
import typing

from .config import ConvertConfig, Range, TrainConfig

START, END = "<!-- config-table -->", "<!-- /config-table -->"


def _default(f: dataclasses.Field):
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def _text(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(_text(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{}" if not value else str(value)
    return str(value)


def _bound(value: float) -> str:
    if math.isinf(value):
        return "∞"
    return f"{value:,}" if isinstance(value, int) or float(value).is_integer() and abs(value) >= 1e4 else f"{value:g}"


def allowed(f: dataclasses.Field) -> str:
    """A field's declared values as the table writes them: an interval, a list of choices, or nothing."""
    if "choices" in f.metadata:
        return ", ".join(_text(c) for c in f.metadata["choices"])
    r: Range | None = f.metadata.get("range")
    if r is None:
        return ""
    return f"{'(' if r.low_open else '['}{_bound(r.low)}, {_bound(r.high)}{')' if r.high_open else ']'}"


# keys whose values a registry or the machine decides (checked when the run starts, `conversion/validate.py`)
CHECKED_LATER = {"method": "a method of `upcycle methods`", "export_class": "auto, or a class of `export/registry.py`",
                 "device": "auto, cpu, cuda, cuda:N", "shard_size": "a size such as 5GB or 500MB",
                 "model": "default, a folder, or a Hugging Face id",
                 "memory_budget": "auto, or a size such as 70GB (the memory plan checks it)"}


def rows(cls: type, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted key, default, allowed) for every key of `cls`, sections flattened; list-valued sections (merge
    sources, freeze rules) are one row."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            out += rows(hint, f"{prefix}{f.name}.")
        else:
            text = allowed(f) or CHECKED_LATER.get(f.name if not prefix else "", "")
            out.append((f"{prefix}{f.name}", _text(_default(f)), text or ("true, false" if hint is bool else "")))
    return out


def table() -> str:
    lines = []
    for title, cls in (("convert", ConvertConfig), ("train", TrainConfig)):
        lines += [f"`upcycle {title}` ({cls.__name__}):", "", "| key | default | allowed |", "|---|---|---|"]
        lines += [f"| `{k}` | `{d}` | {a} |" for k, d, a in rows(cls)]
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


if __name__ == "__main__":
    print(table(), end="")
