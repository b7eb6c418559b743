"""An output's record proves only what lies inside its folder: a planted entry that is absolute, climbs out with
`..` or passes through a link makes the record unproven, so `--overwrite` of convert, prune and grow refuses and
nothing outside OUT changes (such an entry used to make `--overwrite` remove the user's empty folders outside OUT);
and a damaged record (truncated, empty, of another type) is refused as damaged, not as an old format."""

from __future__ import annotations

import json

import pytest

from conftest import digest, fails
from upcycle.cli import main
from upcycle.outputs.ownership import MARKER


def _written(command: str, tiny_lm, out) -> list[str]:
    """`command` run once into `out`; returns its argv (run again with --overwrite by the tests)."""
    dense, moe, train, _ = tiny_lm
    argv = {"convert": ["convert", str(dense), str(out), "--num-experts", "2", "--top-k", "1"],
            "prune": ["prune", str(moe), str(out), "--num-experts", "3", "--calibration", str(train),
                      "--calibration-tokens", "128"],
            "grow": ["grow", str(moe), str(out), "--num-experts", "5", "--calibration", str(train),
                     "--calibration-tokens", "128"]}[command] + ["--quiet"]
    assert main(argv) == 0
    return argv


def _plant(out, entry: str, value) -> None:
    record = json.loads((out / MARKER).read_text())
    record["files"][entry] = value
    (out / MARKER).write_text(json.dumps(record))


@pytest.mark.parametrize("command", ["convert", "prune", "grow"])
@pytest.mark.parametrize("how", ["absolute", "climbs", "climbs-inside", "through-link"])
def test_a_record_entry_outside_out_makes_it_unproven_and_nothing_outside_changes(tiny_lm, tmp_path, capsys,
                                                                                  command, how):
    victim = tmp_path / "victim"                     # the user's empty folder beside OUT
    victim.mkdir()
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "inner").mkdir(parents=True)
    out = tmp_path / "out"
    argv = _written(command, tiny_lm, out)
    entry = {"absolute": str(victim), "climbs": "../victim", "climbs-inside": "model/../../victim",
             "through-link": "link/inner"}[how]
    if how == "through-link":
        (out / "link").symlink_to(elsewhere, target_is_directory=True)
    _plant(out, entry, {"dir": True})
    before = digest(out, elsewhere)
    fails(capsys, [*argv, "--overwrite"], "a record that reaches outside its folder proves nothing")
    assert victim.is_dir() and (elsewhere / "inner").is_dir()
    assert digest(out, elsewhere) == before


@pytest.mark.parametrize(("damage", "text"), [("truncated", None), ("empty", ""), ("a list", "[]"),
                                               ("files a list", None)])
def test_a_damaged_record_is_refused_as_damaged(tiny_lm, tmp_path, capsys, damage, text):
    out = tmp_path / "out"
    argv = _written("convert", tiny_lm, out)
    record = (out / MARKER).read_text()
    if damage == "truncated":
        text = record[: len(record) // 2]
    elif damage == "files a list":
        text = json.dumps({**json.loads(record), "files": [list(json.loads(record)["files"])]})
    (out / MARKER).write_text(text)
    before = digest(out)
    line = fails(capsys, [*argv, "--overwrite"], "is damaged or unreadable")
    assert "written before upcycle recorded" not in line
    assert digest(out) == before
