"""The delta-experts quality study keeps one record per finished cell and collects its table from the records alone:
seeds recorded in different sessions add up, and a recorded seed is not run again."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "studies"))
import delta_study  # noqa: E402


@pytest.fixture
def records(tmp_path, monkeypatch):
    monkeypatch.setattr(delta_study, "RECORDS", tmp_path / "records")
    monkeypatch.setattr(delta_study, "machine", lambda: {"cpus": 2, "load_average": [float(len(str(tmp_path)))]})
    return tmp_path / "records"


def test_the_table_is_collected_from_every_seeds_records(records):
    for seed, (dense, full) in enumerate([(34.8, 34.9), (35.0, 35.1), (34.9, 34.7)]):
        delta_study.record("lm", "dense", seed, quality=dense, parameters={"total": 1}, command="upcycle compare a")
        delta_study.record("lm", "copy full", seed, quality=full, parameters={"total": 3}, command="upcycle compare a")
    delta_study.record("lm", "copy full, compressed r16", 1, quality=35.2, distance_to_source=7e-6,
                       command=["upcycle compress b", "upcycle eval c"])
    result = delta_study.collect()
    rows = result["tasks"]["lm"]["rows"]
    assert rows["dense"]["seeds"] == [0, 1, 2] and rows["dense"]["quality"]["values"] == [34.8, 35.0, 34.9]
    assert rows["copy full"]["quality"]["mean"] == statistics.fmean([34.9, 35.1, 34.7])
    assert rows["copy full"]["quality"]["std"] == statistics.stdev([34.9, 35.1, 34.7])
    assert rows["copy full"]["parameters"] == {"total": 3} and "minus_copy_full" not in rows["copy full"]
    assert rows["dense"]["minus_copy_full"]["values"] == pytest.approx([-0.1, -0.1, 0.2])    # seed by seed
    compressed = rows["copy full, compressed r16"]
    assert compressed["seeds"] == [1] and compressed["distance_to_source"]["values"] == [7e-6]
    assert compressed["minus_copy_full"]["values"] == pytest.approx([35.2 - 35.1])            # seed 1's full row
    assert "parameters" not in compressed and "contrastive" not in result["tasks"]
    assert result["commands"] == ["upcycle compare a", "upcycle compress b", "upcycle eval c"]
    assert result["machines"] == [{"cpus": 2}]           # one machine, whatever its load when each cell ended


def test_a_recorded_seed_is_not_run_again(records, tmp_path, monkeypatch):
    ran = []
    monkeypatch.setattr(delta_study, "run", lambda *argv: ran.append(argv))
    delta_study.record("lm", "copy delta16", 1, quality=35.0, parameters=None, command="upcycle compare a")
    delta_study.compare(tmp_path / "work", "lm", "delta16", 1)
    assert ran == []
    delta_study.record("lm", "copy full, compressed r16", 1, quality=35.0, distance_to_source=0.0, command=[])
    delta_study.record("lm", "copy full, compressed r64", 1, quality=35.0, distance_to_source=0.0, command=[])
    delta_study.compress(tmp_path / "work", "lm", 1)
    assert ran == []
    from upcycle.scripts import claim_work

    claim_work(tmp_path / "work")                                           # as the study claims its work folder
    delta_study.compare(tmp_path / "work", "lm", "delta16", 2)              # seed 2 has no record: it runs
    assert ran and ran[0][:3] == ("compare", "default", str(tmp_path / "work" / "lm" / "delta16"))
    assert "--seeds" in ran[0] and ran[0][ran[0].index("--seeds") + 1] == "2"


def test_compress_without_the_trained_model_says_how_to_run_the_arm_again(records, tmp_path, monkeypatch):
    monkeypatch.setattr(delta_study, "run", lambda *argv: pytest.fail("nothing may run"))
    with pytest.raises(SystemExit, match="the full arm was recorded on another machine"):
        delta_study.compress(tmp_path / "work", "contrastive", 3)
