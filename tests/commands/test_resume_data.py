"""`--resume` continues the run it started: the data it records at its start (size and SHA-256 in inputs.json)
is what it resumes with. A file edited, replaced or removed since is refused in one line, before anything is
written; the same bytes under a new modification time resume."""

from __future__ import annotations

import json
import os

import pytest

from conftest import digest, fails
from upcycle.cli import main


@pytest.fixture
def stopped(lm, tmp_path):
    _, moe, train, held = lm
    run = tmp_path / "run"
    assert main(["train", str(moe), str(run), "--data", str(train), "--eval-data", str(held), "--steps", "4",
                 "--batch-size", "4", "--sequence-length", "32", "--checkpoint-every", "2", "--stop-after", "2",
                 "--quiet", "--set", "eval_tokens=64"]) == 0
    return moe, run, train, held


def test_the_run_records_what_its_data_held(stopped):
    import hashlib

    _, run, train, held = stopped
    contents = json.loads((run / "inputs.json").read_text())["contents"]
    assert contents == {key: {"size": path.stat().st_size, "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
                        for key, path in (("data", train), ("eval_data", held))}


@pytest.mark.parametrize(("change", "said"), [
    ("append", "training data {train} changed since the run started (was {size:,} bytes, is {grown:,})"),
    ("same size", "training data {train} changed since the run started (has the same size and other content)"),
    ("remove", "training data {train} changed since the run started (is gone)"),
])
def test_resume_refuses_data_changed_since_the_run_started(stopped, capsys, change, said):
    moe, run, train, _ = stopped
    size = train.stat().st_size
    if change == "append":
        with open(train, "a") as f:
            f.write("\n\nthe cat sat on the mat.")
    elif change == "same size":
        text = train.read_text()
        train.write_text(("dog" if text[:3] != "dog" else "cat") + text[3:])
    else:
        train.unlink()
    before = digest(run)
    message = said.format(train=train, size=size, grown=train.stat().st_size if train.exists() else 0)
    fails(capsys, ["train", str(moe), str(run), "--resume", "--quiet"], message)
    assert digest(run) == before


def test_the_same_bytes_with_a_new_time_resume(stopped, capsys):
    moe, run, train, _ = stopped
    os.utime(train, (1, 1))
    assert main(["train", str(moe), str(run), "--resume", "--quiet"]) == 0
    assert (run / "model").is_dir()
