"""Paths mean the same from anywhere: a run records its inputs so that it is analyzed the same from any directory,
a relative name recorded before is never looked up here or on the hub, and the embedded model's cache is an input
(never an output), rebuilt when it no longer matches its record."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest

from conftest import digest, fails, fake_run, make_tiny
from upcycle.cli import main

QUIET = ["--quiet"]
TRAIN = ["--steps", "1", "--batch-size", "2", "--sequence-length", "16", "--set", "eval_tokens=32", "--quiet"]


def _fake_default_cache(cache: Path) -> Path:
    """A tiny Llama where the embedded SmolLM2 is cached, with the record upcycle writes with it."""
    from upcycle.data.assets import SMOLLM2_CACHE, record_cache

    folder = cache / SMOLLM2_CACHE
    make_tiny("llama").save_pretrained(folder)
    record_cache(folder)
    return folder


def test_default_is_an_input_its_cache_is_never_an_output(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("UPCYCLE_CACHE", str(tmp_path / "cache"))
    folder = _fake_default_cache(tmp_path / "cache")
    before = digest(folder)
    fails(capsys, ["convert", "default", str(folder), "--overwrite", *QUIET], "embedded model's cache")
    fails(capsys, ["convert", "default", str(folder / "moe"), *QUIET], "lies inside the embedded model's cache")
    fails(capsys, ["train", "default", str(folder), "--overwrite", *TRAIN], "embedded model's cache")
    fails(capsys, ["eval", "default", "--out", str(folder / "config.json"), "--overwrite"], "embedded model's cache")
    assert digest(folder) == before


def test_a_cache_that_no_longer_matches_its_record_is_built_again(tmp_path, monkeypatch):
    from upcycle.data import assets

    monkeypatch.setenv("UPCYCLE_CACHE", str(tmp_path / "cache"))
    folder = _fake_default_cache(tmp_path / "cache")
    assert assets.cache_is_intact(folder)
    built = []
    monkeypatch.setattr(assets, "plain_from_gguf", lambda *args: built.append(args) or folder)
    monkeypatch.setattr(assets, "smollm2_gguf_folder", lambda: tmp_path)
    assert assets.default_model_path() == folder and built == []          # intact: used as it is
    # a weight replaced, a file removed: each is found, and the cache rebuilt (a file added, not upcycle's, is
    # refused instead: tests/commands/test_beside_outputs.py)
    for tamper in (lambda: (folder / "model.safetensors").write_bytes(b"x" * 100),
                   lambda: (folder / "config.json").unlink()):
        snapshot = tmp_path / "snapshot"
        shutil.copytree(folder, snapshot)
        tamper()
        assert not assets.cache_is_intact(folder)
        assets.default_model_path()
        shutil.rmtree(folder)
        snapshot.rename(folder)
    assert len(built) == 2
    # an unchanged file whose time changed (copied back, touched) is checked by its content and passes
    os.utime(folder / "config.json", (1, 1))
    assert assets.cache_is_intact(folder)


@pytest.mark.slow      # over 15 s on 2 cores (tests/durations.json): the slow tier
def test_a_run_is_analyzed_the_same_from_any_directory(lm, tmp_path, monkeypatch):
    from upcycle.analyze.run import AnalyzeOptions, analyze

    dense, _, train, held = lm
    work = tmp_path / "work"
    work.mkdir()
    shutil.move(str(dense), work / "llama")
    monkeypatch.chdir(work)
    # relative names, as people type them: the conversion and the run record where they really are
    assert main(["convert", "llama", "moe", "--num-experts", "2", "--top-k", "1", *QUIET]) == 0
    assert main(["train", "moe", "run", "--data", str(train), *TRAIN]) == 0
    options = AnalyzeOptions(data=(str(held),), tokens=64, sequence_length=16, output_tokens=16)
    here = analyze("run", str(tmp_path / "a1"), options, progress=False)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    there = analyze(str(work / "run"), str(tmp_path / "a2"), options, progress=False)
    assert [s["label"] for s in there["snapshots"]] == [s["label"] for s in here["snapshots"]]
    assert there["snapshots"][0]["label"] == "step 0 (init)"
    assert there["target"]["dense"] == here["target"]["dense"] == str(work / "llama")
    assert there["snapshots"][0]["kl_to_dense"] == here["snapshots"][0]["kl_to_dense"] is not None


def test_a_relative_name_recorded_before_is_never_looked_up_here_or_on_the_hub(lm, tmp_path, monkeypatch):
    from upcycle.analyze.run import AnalyzeOptions, analyze

    dense, moe, _, held = lm
    moved = tmp_path / "moe"
    shutil.copytree(moe, moved)
    report = json.loads((moved / "upcycle_report.json").read_text())
    report.pop("source_path")
    report["source_model"] = "llama"          # as an older version recorded it: relative to where it ran
    (moved / "upcycle_report.json").write_text(json.dumps(report))
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(dense, elsewhere / "llama")            # a same-named folder here must not be taken for it
    monkeypatch.chdir(elsewhere)
    options = AnalyzeOptions(data=(str(held),), tokens=64, sequence_length=16, output_tokens=16)
    started = time.perf_counter()
    result = analyze(str(moved), str(tmp_path / "a"), options, progress=False)
    assert time.perf_counter() - started < 60            # no half-minute of hub retries
    assert result["target"]["dense"] is None and result["snapshots"][0]["kl_to_dense"] is None
    assert any("relative to the folder that command ran in" in note for note in result["target"]["notes"])


def test_a_run_config_whose_model_is_not_a_name_is_a_note(lm, tmp_path):
    from upcycle.analyze.target import resolve_target

    _, moe, _, _ = lm
    run = fake_run(moe, tmp_path / "run")
    (run / "run_config.yaml").write_text("model: [1, 2]\n")
    target = resolve_target(str(run))
    assert target.skeleton == str(run / "model") and "not a model name" in " ".join(target.notes)
