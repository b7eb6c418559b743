"""`--config NAME`: the recipes that ship inside the package are named by the command that reads them, a path
still reads its file, and an unknown name is refused with the names there are."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from upcycle.cli import main, parser
from upcycle.commands.convert import convert_config
from upcycle.commands.train import train_config
from upcycle.config import ConvertConfig
from upcycle.config_reader import RECIPES, build, load_recipe, recipe_names, recipe_path
from upcycle.errors import UpcycleError

ROOT = Path(__file__).resolve().parents[2]


def _args(*argv: str):
    return parser(list(argv)).parse_args(list(argv))


def test_a_name_is_the_packaged_recipe_of_the_command_that_reads_it():
    assert recipe_names("train") == ("clip-up", "minilm-contrastive", "minilm-contrastive-gpu",
                                     "minilm-contrastive-gpu-long", "smollm2-copy", "smollm2-spri",
                                     "tiny-clip-pretrain")
    assert recipe_names("convert") == ("clip-up", "smollm2-drop")
    for kind in ("convert", "train"):
        assert {p.stem for p in (RECIPES / kind).glob("*.yaml")} == set(recipe_names(kind))
        for name in recipe_names(kind):
            assert recipe_path(name, kind) == RECIPES / kind / f"{name}.yaml"
    by_name = train_config(_args("train", "m", "o", "--config", "smollm2-copy"))
    by_path = train_config(_args("train", "m", "o", "--config", str(RECIPES / "train" / "smollm2-copy.yaml")))
    assert by_name == by_path and by_name.steps == 40 and by_name.regularizers.load_balance == 0.01
    # one name, two recipes: the command decides which (CLIP-UP's placement for convert, its training for train)
    placement = convert_config(_args("convert", "m", "o", "--config", "clip-up"))
    assert (placement.moe.num_experts, placement.moe.capacity_factor_train) == (8, 2.0)
    assert train_config(_args("train", "m", "o", "--config", "clip-up")).task == "clip"
    # flags and --set still go on top of a named recipe
    assert train_config(_args("train", "m", "o", "--config", "smollm2-copy", "--steps", "2")).steps == 2


def test_a_path_reads_its_file_even_where_it_looks_like_a_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("smollm2-copy").write_text("steps: 3\n")
    Path("mine.yaml").write_text("steps: 5\n")
    assert train_config(_args("train", "m", "o", "--config", "smollm2-copy")).steps == 40      # the name
    assert train_config(_args("train", "m", "o", "--config", "./smollm2-copy")).steps == 3     # the file
    assert train_config(_args("train", "m", "o", "--config", "mine.yaml")).steps == 5
    with pytest.raises(UpcycleError, match="recipe missing.yaml does not exist"):
        load_recipe(recipe_path("missing.yaml", "train"))


def test_an_unknown_name_is_refused_with_the_names_of_that_command(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["train", "m", "run", "--config", "smollm2-cpy", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "no packaged train recipe" in err and ("clip-up, minilm-contrastive, minilm-contrastive-gpu, "
                                                  "minilm-contrastive-gpu-long, smollm2-copy, smollm2-spri, "
                                                  "tiny-clip-pretrain") in err
    # a train recipe's name is not a conversion's
    assert main(["convert", "m", "out", "--config", "smollm2-copy", "--quiet"]) == 2
    assert "the convert recipes: clip-up, smollm2-drop" in capsys.readouterr().err
    Path("local").write_text("steps: 1\n")          # a file of that name here: the message says how to read it
    with pytest.raises(UpcycleError, match=r"write \./local"):
        recipe_path("local", "train")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["local"]          # nothing was written


@pytest.mark.parametrize("name", recipe_names("convert"))
def test_shipped_convert_recipes_are_valid(name):
    cfg = build(ConvertConfig, {**load_recipe(recipe_path(name, "convert")), "model": "default"})
    assert cfg.moe.num_experts >= 2 and cfg.placement.every == 2


def test_the_configuration_page_lists_every_packaged_recipe():
    text = (ROOT / "docs" / "configuration.md").read_text()
    for kind in ("convert", "train"):
        row = next(line for line in text.splitlines() if line.startswith(f"| `{kind}`"))
        assert tuple(sorted(re.findall(r"`([\w-]+)`", row.split("|")[2]))) == recipe_names(kind)


def test_compare_reads_names_of_its_two_kinds(tmp_path, capsys):
    """`compare --config` takes train recipes and `--convert-config` convert recipes, by name too."""
    from conftest import make_tiny

    make_tiny("llama").save_pretrained(tmp_path / "dense")
    argv = ["compare", str(tmp_path / "dense"), str(tmp_path / "study"), "--methods", "copy", "--quiet"]
    assert main([*argv, "--config", "smollm2-drop"]) == 2
    assert "no packaged train recipe" in capsys.readouterr().err
    assert main([*argv, "--config", "smollm2-copy", "--convert-config", "smollm2-copy"]) == 2
    assert "the convert recipes: clip-up, smollm2-drop" in capsys.readouterr().err
    assert main([*argv, "--config", "smollm2-copy", "--method-config", "copy=nope"]) == 2
    assert "no packaged train recipe" in capsys.readouterr().err
    assert not (tmp_path / "study").exists()
