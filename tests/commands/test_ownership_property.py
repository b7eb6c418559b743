"""Ownership is a record (`upcycle.outputs.ownership`), as a property: a user's file put anywhere in an output of
every kind, at any depth, under a name near each one upcycle gives its files and temporaries, is never deleted or
changed, whatever the command: `convert --overwrite`, `train --overwrite`, `train --resume`, a comparison's
clean-up, a benchmark's work folder. The command either refuses (the output untouched) or succeeds leaving the
user's file as it was. Hypothesis draws the names and places; the outputs are made once and copied per example."""

from __future__ import annotations

import json
import shutil
import socket
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from conftest import digest, make_tiny
from upcycle.cli import main

ROOT = Path(__file__).resolve().parents[2]

# Names near the ones upcycle gives: its temporaries' schemes without their whole identity, locks, markers, the
# files of a model, a run, a checkpoint, a tracker, and plain names.
NEAR = ["notes.txt", ".drafts.tmp", ".thesis.lock", ".x.old-backup", ".model.tmp", ".step-0000004.tmp",
        f".out.tmp-{socket.gethostname()}x-1-abcdefgh", ".out.tmp-otherhost-1-abcdefgh", ".log.jsonl.tmp-h-1-a",
        "model.safetensors", "model-00001-of-00002.safetensors", "config.json", "log.jsonl", "optimizer.pt",
        "manifest.json", "events.out.tfevents.1.host", "run-abc.wandb", ".upcycle-output.json.bak", "1_Notes",
        "chapter.txt", "timing.json", ".out.lock", "comparison.md"]
FOLDERS = ["", "model", "checkpoints", "checkpoints/step-0000001", "checkpoints/step-0000004", "tensorboard",
           "wandb", "wandb/my", "model/1_Notes", ".hidden", ".drafts.tmp", "mine", "mine/deeper"]
CONVERT = ["--num-experts", "2", "--top-k", "1", "--quiet"]
TRAIN = ["--steps", "2", "--batch-size", "4", "--sequence-length", "16", "--quiet", "--set", "eval_tokens=32",
         "--set", "checkpoint_every=1"]
EXAMPLES = settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@st.composite
def user_files(draw) -> list[tuple[str, bytes]]:
    """One to three files of the user's: (relative path, content)."""
    count = draw(st.integers(1, 3))
    return [(f"{draw(st.sampled_from(FOLDERS))}/{draw(st.sampled_from(NEAR))}".lstrip("/"),
             f"the user's {i}\n".encode()) for i in range(count)]


def _plant(out: Path, files: list[tuple[str, bytes]]) -> list[tuple[Path, bytes]]:
    planted = []
    for rel, content in files:
        path = out / rel
        if path.exists() or any(p.is_file() for p in path.parents if out in p.parents or p == out):
            continue                       # a name upcycle's output already has there: not a new file of theirs
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
        planted.append((path, content))
    return planted


def _intact(planted: list[tuple[Path, bytes]]) -> None:
    for path, content in planted:
        assert path.is_file() and path.read_bytes() == content, path


@pytest.fixture(scope="module")
def outputs(tiny_lm, tmp_path_factory):
    """A conversion and a run stopped at step 1 (checkpointed, resumable), made once."""
    dense, moe, train, _ = tiny_lm
    root = tmp_path_factory.mktemp("owned")
    model = root / "gpt2"
    make_tiny("gpt2").save_pretrained(model)
    assert main(["convert", str(model), str(root / "converted"), *CONVERT]) == 0
    assert main(["train", str(moe), str(root / "run"), "--data", str(train), *TRAIN, "--stop-after", "1"]) == 0
    return {"model": model, "converted": root / "converted", "run": root / "run", "moe": moe, "train": train}


def _fresh(tmp_path: Path) -> Path:
    """A new folder for one example (hypothesis runs many in one test's tmp_path)."""
    return Path(tempfile.mkdtemp(dir=tmp_path))


def _copy(source: Path, to: Path) -> Path:
    shutil.copytree(source, to, symlinks=True)
    return to


@EXAMPLES
@given(files=user_files())
@example(files=[(".drafts.tmp/ch1.txt", b"mine")]).via("a hidden folder named like a temporary")
@example(files=[(".thesis.lock", b"mine"), (".x.old-backup", b"mine")]).via("names like a lock and a temporary")
def test_overwrite_of_a_conversion_never_touches_a_users_file(outputs, tmp_path, files):
    out = _copy(outputs["converted"], _fresh(tmp_path) / "out")
    planted = _plant(out, files)
    before = digest(out)
    code = main(["convert", str(outputs["model"]), str(out), "--overwrite", *CONVERT])
    if planted:
        assert code == 2 and digest(out) == before          # refused, the output as it was
    _intact(planted)


@pytest.mark.slow      # over 15 s on 2 cores (tests/durations.json): the slow tier
@EXAMPLES
@given(files=user_files(), resume=st.booleans())
@example(files=[("wandb/my/notes.txt", b"mine")], resume=False).via("a tracker's folder")
@example(files=[("checkpoints/step-0000001/my_backup.bin", b"mine")], resume=False).via("a checkpoint's folder")
@example(files=[("model/config.json", b"mine"), ("model/1_Notes/chapter.txt", b"mine")],
         resume=True).via("a model folder the run would write at its end")
def test_overwrite_and_resume_of_a_run_never_touch_a_users_file(outputs, tmp_path, files, resume):
    here = _fresh(tmp_path)
    run = _copy(outputs["run"], here / "run")
    planted = _plant(run, files)
    before = digest(run)
    code = main(["train", str(outputs["moe"]), str(run), "--data", str(outputs["train"]), *TRAIN,
                 "--resume" if resume else "--overwrite"])
    if planted and not resume:
        assert code == 2 and digest(run) == before
    _intact(planted)
    assert not list(here.glob("run.kept-*")) or planted       # only a user's file makes upcycle keep anything


@EXAMPLES
@given(files=user_files(), forge=st.booleans())
def test_a_benchmarks_work_folder_keeps_a_users_file(outputs, tmp_path, files, forge):
    """What a benchmark wrote goes, what it did not stays; a record forged to list the user's file (without its
    fingerprint, or with a wrong one) proves nothing."""
    from upcycle.scripts import claim_work, clear, note

    work = claim_work(_fresh(tmp_path) / "work")
    _copy(outputs["converted"], work / "converted")
    (work / "scratch.bin").write_bytes(b"benchmark's")
    note(work / "scratch.bin")
    planted = _plant(work, files)
    if forge and planted:
        marker = work / ".upcycle-output.json"
        record = json.loads(marker.read_text())
        for path, _ in planted:
            record["files"][path.relative_to(work).as_posix()] = {"size": 1, "sha256": "0" * 64}
        marker.write_text(json.dumps(record))
    clear(work, work)
    _intact(planted)
    assert not (work / "scratch.bin").exists() and not (work / "converted" / "model.safetensors").exists()
    if not planted:
        assert not work.exists()
