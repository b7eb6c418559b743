"""`--dry-run` on every command that plans (convert, train, prune, grow, compare, analyze): it prints the plan the
run would carry out and writes nothing, and it refuses what the run refuses before the run's first weight, with
the same line (both go through `outputs.job`: the dry run and the runner make the same checks)."""

from __future__ import annotations

import pytest
import yaml

from upcycle.cli import main


@pytest.fixture(scope="module")
def study(tiny_lm, tmp_path_factory):
    """The shared tiny dense model (conftest's tiny_lm), and a 3-step recipe on its text."""
    dense, _, train, held = tiny_lm
    recipe = tmp_path_factory.mktemp("dry") / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"data": str(train), "eval_data": str(held), "steps": 3, "batch_size": 4,
                                      "sequence_length": 32}))
    return recipe.parent, dense, recipe, train, held


def _compare(dense, recipe, out, *flags) -> list[str]:
    return ["compare", str(dense), str(out), "--methods", "copy", "--config", str(recipe), "--num-experts", "4",
            "--top-k", "2", *flags]


def test_compare_dry_run_prints_every_cell_and_writes_nothing(study, tmp_path, capsys):
    _, dense, recipe, _, _ = study
    out = tmp_path / "study"
    assert main(_compare(dense, recipe, out, "--seeds", "0,1", "--dry-run")) == 0
    said = capsys.readouterr().out
    assert not out.exists()
    assert f"compare plan for {dense} (causal_lm) into {out}: 4 cells" in said
    for cell in ("copy-eesd-none-seed-0", "copy-eesd-none-seed-1", "dense-seed-0", "dense-seed-1"):
        assert f"  {cell}" in said and "3 steps" in said


@pytest.mark.parametrize("flags, message", [(["--methods", "nosuch"], "unknown method 'nosuch'"),
                                            (["--seeds", "0,0"], "lists a seed twice")])
def test_compare_dry_run_refuses_as_the_run_does(study, tmp_path, capsys, flags, message):
    _, dense, recipe, _, _ = study
    out = tmp_path / "study"
    argv = ["compare", str(dense), str(out), "--methods", "copy", "--config", str(recipe), *flags]
    errors = []
    for extra in (["--dry-run"], []):
        assert main([*argv, *extra]) == 2
        errors.append(capsys.readouterr().err.strip().splitlines()[-1])
    assert errors[0] == errors[1] and message in errors[0] and not out.exists()


def test_compare_dry_run_refuses_an_out_that_is_an_input(study, capsys):
    _, dense, recipe, _, _ = study
    errors = []
    for extra in (["--dry-run"], []):
        assert main(_compare(dense, recipe, dense / "study", *extra)) == 2       # inside the dense model
        errors.append(capsys.readouterr().err.strip().splitlines()[-1])
    assert errors[0] == errors[1] and "input" in errors[0] and not (dense / "study").exists()


def test_analyze_dry_run_prints_the_plan_and_refuses_as_the_run_does(tiny_lm, tmp_path, capsys):
    dense, moe, train, held = tiny_lm
    out = tmp_path / "analysis"
    argv = ["analyze", str(moe), str(out), "--source", f"toy={train}", "--source", f"held={held}", "--tokens", "64"]
    assert main([*argv, "--dry-run"]) == 0
    said = capsys.readouterr().out
    assert not out.exists()
    assert f"analysis plan for {moe} (upcycle): 1 snapshot(s)" in said and "sources: toy, held" in said
    assert f"KL to the dense model: {dense}" in said
    out.mkdir()
    (out / "mine.txt").write_text("the user's")
    errors = []
    for extra in (["--dry-run"], []):
        assert main([*argv, *extra]) == 2
        errors.append(capsys.readouterr().err.strip().splitlines()[-1])
    assert errors[0] == errors[1] and "exists" in errors[0]
    assert sorted(p.name for p in out.iterdir()) == ["mine.txt"]
