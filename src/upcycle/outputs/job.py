"""The one skeleton of every command that plans before it writes (convert, train, prune and grow, compare,
analyze): check -> claim OUT -> execute -> report -> write.

A command first makes its plan: a value (`Plan`) holding everything decided before a weight loads, whose
`summary()` is the decisions as plain values, `describe()` the same for a person, `given` the inputs OUT must
never be, `kind` the output's kind (its record says it) and `claiming` how OUT is taken (a new output, or one the
command adds to). Then either

    run_job(plan, out, execute, check=..., overwrite=...)
        check       the refusals the plan leaves to the machine it runs on (does the run fit its memory?)
        claim       OUT checked against the inputs and what exists there, and locked (`claims.claim_output`)
        execute     `execute(claim)` computes, reports, and writes through the claim (whole or not at all)

or, for `--dry-run`,

    dry_run_job(plan, out, check=..., overwrite=...)
        the same `check`, OUT checked as the claim checks it (`claims.check_claim`), nothing claimed or written;
        returns the plan's description

so a dry run refuses what its run refuses: both make the same calls, in the same order.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

from .claims import Claim, Input, check_claim, claim_output

T = TypeVar("T")


@dataclass(frozen=True)
class Claiming:
    """How a command takes OUT: `existing` "refuse" (a new output; an existing one needs --overwrite and must be
    upcycle's) or "continue" (a command that adds to its own output: --resume, compare); `lock`: False where
    another process holds it (a distributed run's other ranks, compare's cells)."""

    existing: str = "refuse"
    lock: bool = True


NEW_OUTPUT = Claiming()


class Plan(Protocol):
    """What every command's plan gives the runner (module docstring)."""

    @property
    def kind(self) -> str: ...

    @property
    def given(self) -> list[Input]: ...

    @property
    def claiming(self) -> Claiming: ...

    def summary(self) -> dict: ...

    def describe(self) -> str: ...


def _nothing() -> None:
    return None


def run_job(plan: Plan, out: str | os.PathLike, execute: Callable[[Claim], T], *,
            check: Callable[[], None] = _nothing, overwrite: bool = False) -> T:
    """Check what the plan leaves to this machine, claim OUT, and carry the plan out into the claim."""
    check()
    how = plan.claiming
    with claim_output(out, kind=plan.kind, given=plan.given, overwrite=overwrite, existing=how.existing,
                      lock=how.lock) as claim:
        return execute(claim)


def dry_run_job(plan: Plan, out: str | os.PathLike | None, *, check: Callable[[], None] = _nothing,
                overwrite: bool = False) -> str:
    """`--dry-run`: with OUT, the run's own refusals in its order (`check`, then OUT's as its claim makes them),
    then the plan described; nothing is claimed or written."""
    if out is not None:
        check()
        check_claim(out, kind=plan.kind, given=plan.given, overwrite=overwrite, existing=plan.claiming.existing)
    return plan.describe()
