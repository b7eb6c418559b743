"""What `--overwrite` (and an output path) may replace: only an output upcycle wrote, and never an input, a
recipe, the current directory, a folder holding a user's file at any depth, or anything through a symbolic link;
a second run into the same output is refused, and a new run replaces an old one only once it holds a checkpoint.
Every test runs the command as a user would type it and checks the exit status, the message, and that every
input is byte for byte what it was."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from conftest import digest, fails, fake_run, train_config
from upcycle.cli import main
from upcycle.errors import UpcycleError
from upcycle.runs.layout import checkpoints
from upcycle.training.trainer import train

QUIET = ["--quiet"]
CONVERT = ["--num-experts", "2", "--top-k", "1", "--quiet"]
TRAIN = ["--steps", "1", "--batch-size", "2", "--sequence-length", "16", "--set", "eval_tokens=32", "--quiet"]
RUN = ["--steps", "2", "--batch-size", "4", "--sequence-length", "32", "--quiet", "--set", "eval_tokens=64"]


@pytest.fixture
def victim(tiny_lm, tmp_path) -> Path:
    """A private copy of the tiny upcycled model, to be given as input."""
    folder = tmp_path / "victim"
    shutil.copytree(tiny_lm[1], folder)
    return folder


def test_overwrite_never_deletes_the_input(tiny_lm, victim, tmp_path, capsys):
    train_txt = str(tiny_lm[2])
    before = digest(victim)
    # OUT = the input model, OUT = a folder holding it, OUT = the folder holding the training text
    for out in (victim, tmp_path):
        assert main(["train", str(victim), str(out), "--overwrite", "--data", train_txt, *RUN]) == 2
        assert "input" in capsys.readouterr().err
    text_dir = tmp_path / "texts"
    text_dir.mkdir()
    shutil.copy(train_txt, text_dir / "train.txt")
    assert main(["train", str(victim), str(text_dir), "--overwrite", "--data", str(text_dir / "train.txt"),
                 *RUN]) == 2
    assert (text_dir / "train.txt").exists()
    # convert and export refuse the same
    assert main(["convert", str(victim), str(victim), "--overwrite", "--quiet"]) == 2
    assert main(["export", str(victim), str(victim), "--overwrite"]) == 2
    assert digest(victim) == before


def test_overwrite_never_empties_the_current_directory(tiny_lm, tmp_path, monkeypatch, capsys):
    sandbox = tmp_path / "sbx"
    sandbox.mkdir()
    (sandbox / "notes.txt").write_text("mine")
    monkeypatch.chdir(sandbox)
    assert main(["train", str(tiny_lm[1]), ".", "--overwrite", "--data", str(tiny_lm[2]), *RUN]) == 2
    assert "current directory" in capsys.readouterr().err
    assert main(["train", str(tiny_lm[1]), str(tmp_path), "--overwrite", "--data", str(tiny_lm[2]), *RUN]) == 2
    assert (sandbox / "notes.txt").read_text() == "mine"


def test_overwrite_keeps_the_old_run_until_the_new_one_has_a_checkpoint(tiny_lm, tmp_path, capsys):
    _, moe, train_txt, held = tiny_lm
    run = tmp_path / "run"
    train(train_config(moe, train_txt, held, steps=2), run, progress=False)
    before = digest(run)
    # a missing data file, a typo in what trains: found before OUT is touched
    assert main(["train", str(moe), str(run), "--overwrite", "--data", str(tmp_path / "missing.jsonl"), *RUN]) == 2
    assert main(["train", str(moe), str(run), "--overwrite", "--data", str(train_txt), "--train", "experst",
                 *RUN]) == 2
    assert digest(run) == before
    assert sorted(os.listdir(tmp_path)) == ["run"]            # no staging folder left behind
    # a valid --overwrite replaces it
    train(train_config(moe, train_txt, held, steps=1), run, overwrite=True, progress=False)
    assert [c.name for c in checkpoints(run)] == ["step-0000001"] and sorted(os.listdir(tmp_path)) == ["run"]


def test_recipes_cannot_overwrite(tiny_lm, victim, tmp_path, capsys):
    recipe = tmp_path / "shared.yaml"
    recipe.write_text("overwrite: true\nsteps: 2\n")
    out = tmp_path / "existing"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert main(["train", str(victim), str(out), "--config", str(recipe), "--data", str(tiny_lm[2])]) == 2
    assert "command line only" in capsys.readouterr().err
    assert main(["convert", str(victim), str(out), "--config", str(recipe), "--quiet"]) == 2
    assert main(["convert", str(victim), str(out), "--set", "overwrite=true", "--quiet"]) == 2
    assert "command line only" in capsys.readouterr().err
    assert (out / "keep.txt").read_text() == "mine"


@pytest.fixture
def finished_run(tiny_lm, tmp_path) -> Path:
    """A finished training run of the tiny MoE (its checkpoint, model, log)."""
    _, moe, train, _ = tiny_lm
    assert main(["train", str(moe), str(tmp_path / "run"), "--data", str(train), *TRAIN]) == 0
    return tmp_path / "run"


def test_eval_out_never_overwrites_the_model_the_data_or_the_run(lm, tmp_path, capsys):
    _, moe, _, held = lm
    run = fake_run(moe, tmp_path / "run")
    before = digest(moe, held, run)
    for out in (moe / "config.json", moe / "model.safetensors", held, run / "log.jsonl"):
        model = run if out.parent == run else moe
        fails(capsys, ["eval", str(model), "--data", str(held), "--out", str(out)], "")
        fails(capsys, ["eval", str(model), "--data", str(held), "--out", str(out), "--overwrite"], "")
    assert digest(moe, held, run) == before


def test_eval_out_replaces_only_its_own_result_and_writes_it_whole(lm, tmp_path, capsys):
    _, moe, _, held = lm
    notes = tmp_path / "notes.json"
    notes.write_text('{"mine": true}\n')
    ev = ["eval", str(moe), "--data", str(held), "--sequence-length", "16"]
    fails(capsys, [*ev, "--tokens", "64", "--out", str(notes)], "already exists")
    fails(capsys, [*ev, "--tokens", "64", "--out", str(notes), "--overwrite"], "only upcycle's own outputs")
    assert notes.read_text() == '{"mine": true}\n'
    result = tmp_path / "eval.json"
    assert main([*ev, "--tokens", "64", "--out", str(result)]) == 0
    first = json.loads(result.read_text())
    assert first["format"] == "upcycle-eval" and first["tokens"] > 0
    assert main([*ev, "--tokens", "32", "--out", str(result), "--overwrite"]) == 0
    assert json.loads(result.read_text())["tokens"] < first["tokens"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["eval.json", "notes.json", "inputs"])


def test_overwrite_never_deletes_a_recipe_the_dense_model_or_a_users_folder(lm, tmp_path, capsys):
    dense, moe, train, held = lm
    folder = tmp_path / "recipes"
    folder.mkdir()
    (folder / "r.yaml").write_text("moe: {num_experts: 2, top_k: 1}\n")
    (folder / "t.yaml").write_text("lr: 1e-3\n")
    (folder / "other.txt").write_text("the user's")
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "thesis.txt").write_text("four years")
    analysis_in = tmp_path / "analysis"
    (analysis_in / "dense").mkdir(parents=True)
    for f in dense.iterdir():
        shutil.copy(f, analysis_in / "dense" / f.name)
    before = digest(dense, moe, folder, precious, analysis_in)
    fails(capsys, ["convert", str(dense), str(folder), "--config", str(folder / "r.yaml"), "--overwrite", *QUIET],
          "recipe")
    fails(capsys, ["train", str(moe), str(folder), "--config", str(folder / "t.yaml"), "--data", str(train),
                   "--overwrite", *TRAIN], "recipe")
    fails(capsys, ["convert", str(dense), str(precious), "--overwrite", *QUIET], "only upcycle's own outputs")
    fails(capsys, ["analyze", str(moe), str(analysis_in), "--dense", str(analysis_in / "dense"), "--data",
                   str(held), "--overwrite", "--quiet"], "dense model")
    # OUT = the dense model the MoE records as its source: an input of the analysis even when not named
    fails(capsys, ["analyze", str(moe), str(dense), "--data", str(held), "--overwrite", "--quiet"], "dense model")
    assert digest(dense, moe, folder, precious, analysis_in) == before


def test_overwrite_never_goes_through_a_symbolic_link(lm, tmp_path, capsys):
    dense, _, _, _ = lm
    target = tmp_path / "target"
    assert main(["convert", str(dense), str(target), "--num-experts", "2", "--top-k", "1", *QUIET]) == 0
    link = tmp_path / "link"
    link.symlink_to(target)
    before = digest(target)
    fails(capsys, ["convert", str(dense), str(link), "--overwrite", *QUIET], "symbolic link")
    assert digest(target) == before and link.is_symlink()
    # upcycle's own output with a file of the user's added: not replaced
    (target / "my-notes.txt").write_text("mine")
    fails(capsys, ["convert", str(dense), str(target), "--overwrite", *QUIET], "my-notes.txt")
    (target / "my-notes.txt").unlink()
    assert main(["convert", str(dense), str(target), "--overwrite", *QUIET]) == 0


def test_a_second_run_into_the_same_output_is_refused_never_mixed(lm, tmp_path, capsys):
    from upcycle.outputs.claims import claim_output, lock_path

    dense, moe, train, _ = lm
    out = tmp_path / "out"
    with claim_output(out, kind="convert"):           # another run is writing OUT
        fails(capsys, ["convert", str(dense), str(out), "--num-experts", "2", "--top-k", "1", *QUIET],
              "being written by another upcycle run")
        fails(capsys, ["train", str(moe), str(out), "--data", str(train), *TRAIN], "being written by another")
        assert not out.exists()
    assert not lock_path(out).exists()
    assert main(["convert", str(dense), str(out), "--num-experts", "2", "--top-k", "1", *QUIET]) == 0
    assert not lock_path(out).exists() and sorted(p.name for p in tmp_path.iterdir()) == ["inputs", "out"]


def test_eval_out_overwrite_replaces_an_earlier_eval_result_and_no_other_upcycle_json(tiny_lm, finished_run,
                                                                                       tmp_path, capsys):
    _, moe, _, held = tiny_lm
    # another model evaluated, its result aimed at the files of a run that is not its input
    evaluate = ["eval", str(moe), "--data", str(held), "--tokens", "32", "--quiet"]
    checkpoint = next((finished_run / "checkpoints").iterdir())
    others = [finished_run / "model" / "upcycle_config.json", finished_run / ".upcycle-output.json",
              checkpoint / "manifest.json", checkpoint / "trainer.json"]
    before = digest(*others)
    for other in others:
        fails(capsys, [*evaluate, "--out", str(other), "--overwrite"], "is another upcycle file")
    assert digest(*others) == before
    result = tmp_path / "result.json"
    assert main([*evaluate, "--out", str(result)]) == 0
    assert main([*evaluate, "--out", str(result), "--overwrite"]) == 0      # its own kind: replaced
    capsys.readouterr()


@pytest.mark.parametrize("place", ["model/MY_NOTES.txt", "tensorboard/keep.txt", "checkpoints/notes.md",
                                   "checkpoints/step-0000001/mine.json"])
def test_train_overwrite_refuses_a_run_with_a_users_file_at_any_depth(tiny_lm, finished_run, capsys, place):
    _, moe, train, _ = tiny_lm
    planted = finished_run / place
    made = [p for p in reversed(planted.parents) if not p.exists()]       # a folder of the user's is theirs too
    planted.parent.mkdir(parents=True, exist_ok=True)
    planted.write_text("mine\n")
    before = digest(finished_run)
    line = fails(capsys, ["train", str(moe), str(finished_run), "--data", str(train), "--overwrite", *TRAIN],
                 "holds what upcycle did not write")
    assert place in line
    assert digest(finished_run) == before
    planted.unlink()
    if made:                             # an empty folder the user made is theirs: still refused
        fails(capsys, ["train", str(moe), str(finished_run), "--data", str(train), "--overwrite", *TRAIN],
              f"{made[-1].relative_to(finished_run)}/")
        for folder in reversed(made):
            folder.rmdir()
    # the run as upcycle wrote it is replaced
    assert main(["train", str(moe), str(finished_run), "--data", str(train), "--overwrite", *TRAIN]) == 0


def test_an_older_upcycle_folder_is_never_replaced(tiny_lm, tmp_path, capsys):
    """A folder written before records carried fingerprints (no record, or a marker without them) cannot be proven
    upcycle's: --overwrite refuses it, says why, and touches nothing."""
    dense, moe, _, _ = tiny_lm
    old = tmp_path / "old"
    shutil.copytree(moe, old)
    (old / ".upcycle-output.json").unlink()
    before = digest(old)
    line = fails(capsys, ["convert", str(dense), str(old), "--overwrite", *CONVERT], "does not prove")
    assert "before upcycle recorded" in line and digest(old) == before
    (old / ".upcycle-output.json").write_text(json.dumps({"format": "upcycle-output", "kind": "convert",
                                                          "files": sorted(p.name for p in old.iterdir())}))
    fails(capsys, ["convert", str(dense), str(old), "--overwrite", *CONVERT], "does not prove")
    assert (old / "model.safetensors").is_file()


def test_the_output_claim_refuses_before_anything_exists(tmp_path):
    """The checks come before the lock and before any folder is made: a refused claim leaves nothing."""
    from upcycle.outputs.claims import claim_output, inputs

    data = tmp_path / "data.txt"
    data.write_text("text")
    (tmp_path / "d").mkdir()
    with pytest.raises(UpcycleError, match="lies inside the data"):
        with claim_output(tmp_path / "d" / "new" / "x", kind="convert", given=inputs(("data", tmp_path / "d"))):
            pass
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d", "data.txt"] and not any((tmp_path / "d").iterdir())
    hard = tmp_path / "hard.txt"
    os.link(data, hard)
    with pytest.raises(UpcycleError, match="the same file under another name"):
        with claim_output(hard, kind="eval", given=inputs(("data", data)), overwrite=True, file=True):
            pass


def test_eval_overwrite_of_another_upcycle_outputs_file_says_whose_it_is(tiny_lm, tmp_path, capsys):
    """`eval --out REPORT --overwrite` on a report inside another upcycle output (a conversion's
    upcycle_report.json): refused naming that output, not as a file "upcycle did not write"."""
    import shutil

    from upcycle.cli import main

    _, moe, _, held = tiny_lm
    shutil.copytree(moe, tmp_path / "moe")
    report = tmp_path / "moe" / "upcycle_report.json"
    before = report.read_bytes()
    assert main(["eval", str(moe), "--data", str(held), "--tokens", "64", "--sequence-length", "16", "--quiet",
                 "--out", str(report), "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert "is a file of the upcycle" in err and "output" in err and "did not write" not in err
    assert report.read_bytes() == before
