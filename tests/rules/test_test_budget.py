"""The test suite's budget: `make test` (the fast tier, what the README's test command and CI's first step run)
holds no test that takes over 15 seconds on 2 cores; a longer one is marked `slow` and runs in `make test-slow`
(CI's second step). The seconds are read from tests/durations.json, each test's wall time measured by
`make durations` (tests/conftest.py records, tests/durations.py merges), so this rule costs nothing to check."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

DURATIONS = Path(__file__).resolve().parents[1] / "durations.json"
LIMIT_S = 15.0


def over_budget(fast: list[str], recorded: dict[str, float], limit: float = LIMIT_S) -> dict[str, float]:
    """The fast tests whose recorded seconds exceed `limit`."""
    return {test: recorded[test] for test in fast if recorded.get(test, 0.0) > limit}


def recorded_seconds() -> dict[str, float]:
    return {row["test"]: row["seconds"] for row in json.loads(DURATIONS.read_text())["durations"]}


def test_no_fast_test_takes_more_than_its_budget(request):
    recorded = recorded_seconds()
    fast = [item.nodeid for item in request.session.items if item.get_closest_marker("slow") is None]
    assert request.node.nodeid in fast                    # what pytest collected now is what is checked
    assert over_budget(fast, recorded) == {}, "mark these slow, or make them faster, then run `make durations`"
    if len(fast) > 1000:        # a whole fast tier collected: the file must have measured nearly all of it
        measured = sum(test in recorded for test in fast)
        assert measured >= 0.9 * len(fast), f"tests/durations.json measured {measured} of {len(fast)} fast " \
                                            f"tests: run `make durations`"


def test_the_budget_check_names_a_slow_test():
    recorded = {"a::quick": 0.4, "a::long": 15.5, "a::marked_slow": 90.0}
    assert over_budget(["a::quick", "a::long", "a::new"], recorded) == {"a::long": 15.5}


@pytest.mark.parametrize("field", ["machine", "fast_tests", "durations"])
def test_the_durations_file_says_where_it_was_measured(field):
    data = json.loads(DURATIONS.read_text())
    assert data[field]
    assert data["machine"]["cpus"] >= 1 and all(row["seconds"] >= 0 for row in data["durations"])
