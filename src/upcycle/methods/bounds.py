"""Allowed values of a method argument, declared in the method's signature (the signature is the schema):

    ratio: Annotated[float, Range(0, 1)] = 0.5                     # [0, 1]
    tau: Annotated[float, Range(0, 1, low_open=True)] = 0.95       # (0, 1]
    restarts: Annotated[int, Range(1)] = 3                         # [1, inf)
    placement: Annotated[str, OneOf("down", "gate", "up")] = "down"

The registry reads the bound into `MethodArg.bound` and checks a resolved value against it when the arguments
are resolved, i.e. in the conversion's validation, before any weight loads. A bound only says what can be told
from the value alone; what depends on the tensors (a granularity dividing the FFN width) stays in the method.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Range:
    """A number between `low` and `high` (None: unbounded on that side), each end closed unless `*_open`.
    A float must also be finite: NaN and inf lie in no range (an unbounded end is written `inf`, excluded)."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def __post_init__(self) -> None:
        if self.low is not None and self.high is not None and self.low > self.high:
            raise TypeError(f"Range: low {self.low} > high {self.high}")

    def contains(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        if self.low is not None and not (value > self.low if self.low_open else value >= self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)

    def __str__(self) -> str:
        low = "(-inf" if self.low is None else f"{'(' if self.low_open else '['}{self.low:g}"
        high = "inf)" if self.high is None else f"{self.high:g}{')' if self.high_open else ']'}"
        return f"{low}, {high}"

    def describe(self) -> str:
        """How an error or the listing says it: 'in [0, 1]', or 'finite' when unbounded."""
        return "finite" if self.low is None and self.high is None else f"in {self}"


@dataclass(frozen=True)
class OneOf:
    """A value from a fixed set (a string argument's choices)."""

    choices: tuple

    def __init__(self, *choices) -> None:
        if not choices:
            raise TypeError("OneOf needs at least one choice")
        object.__setattr__(self, "choices", tuple(choices))

    def contains(self, value) -> bool:
        return value in self.choices

    def __str__(self) -> str:
        return "{" + ", ".join(repr(c) for c in self.choices) + "}"

    def describe(self) -> str:
        return f"one of {', '.join(repr(c) for c in self.choices)}"


Bound = Range | OneOf
