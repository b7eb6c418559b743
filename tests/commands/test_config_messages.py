"""Malformed configuration is one line naming the flag or the file, exit status 2 and nothing written: YAML that
does not parse in `--set` or a recipe, a binary file, a folder or a list given as a recipe, for convert and train.
"""

from __future__ import annotations

import re

import pytest

from upcycle.cli import main


def _convert_fails(tmp_path, capsys, *argv: str) -> str:
    """Run `upcycle convert` on a model that does not exist (the config must fail first); return stderr."""
    assert main(["convert", str(tmp_path / "no-model"), str(tmp_path / "out"), *argv, "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("upcycle: error: ") and "Traceback" not in err and "could not load model" not in err
    assert not (tmp_path / "out").exists()
    return err


def test_malformed_yaml_in_set_is_a_message(tmp_path, capsys):
    err = _convert_fails(tmp_path, capsys, "--set", "moe.top_k=[1,")
    assert "--set moe.top_k=[1,: the value is not valid YAML" in err and len(err.splitlines()) == 1
    assert "the key must be dotted names" in _convert_fails(tmp_path, capsys, "--set", "moe..top_k=1")


def test_binary_file_as_config_is_a_message(tmp_path, capsys):
    binary = tmp_path / "weights.bin"
    binary.write_bytes(bytes(range(256)) * 4)
    assert f"recipe {binary} is not a text file" in _convert_fails(tmp_path, capsys, "--config", str(binary))
    nul = tmp_path / "nul.yaml"        # valid UTF-8, but characters YAML refuses
    nul.write_bytes(b"method: copy\x00\n")
    assert f"recipe {nul} is not valid YAML" in _convert_fails(tmp_path, capsys, "--config", str(nul))


def test_directory_as_config_is_a_message(tmp_path, capsys):
    err = _convert_fails(tmp_path, capsys, "--config", str(tmp_path))
    assert f"recipe {tmp_path} is a directory; --config takes a YAML file" in err


def test_recipe_whose_top_level_is_a_list_is_a_message(tmp_path, capsys):
    recipe = tmp_path / "list.yaml"
    recipe.write_text("- method: drop\n- seed: 3\n")
    err = _convert_fails(tmp_path, capsys, "--config", str(recipe))
    assert f"recipe {recipe} must be a mapping of config keys at the top level, got a list" in err
    broken = tmp_path / "broken.yaml"
    broken.write_text("moe: {top_k: 2\n")
    assert f"recipe {broken} is not valid YAML" in _convert_fails(tmp_path, capsys, "--config", str(broken))


def test_train_config_errors_are_messages_too(tmp_path, capsys):
    assert main(["train", str(tmp_path / "no-model"), str(tmp_path / "run"), "--config", str(tmp_path)]) == 2
    assert "is a directory; --config takes a YAML file" in capsys.readouterr().err
    assert main(["train", str(tmp_path / "no-model"), str(tmp_path / "run"), "--set", "lr=[1,"]) == 2
    assert "--set lr=[1,: the value is not valid YAML" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_a_model_config_with_zero_heads_or_nesting_past_the_parser_is_named(tmp_path, capsys):
    """A model's config.json is checked as read, before transformers builds a config from it (which divides by
    the head count, and whose JSON parser recurses): the key or the nesting is named, one line."""
    import json

    from conftest import make_tiny

    dense = tmp_path / "dense"
    make_tiny("llama").save_pretrained(dense)
    config = json.loads((dense / "config.json").read_text())
    (dense / "config.json").write_text(json.dumps({**config, "num_attention_heads": 0}))
    assert main(["convert", str(dense), str(tmp_path / "out"), "--quiet"]) == 2
    assert "config.json's num_attention_heads is 0; upcycle takes whole numbers from 1" in capsys.readouterr().err
    (dense / "config.json").write_text("[" * 5000 + "]" * 5000)
    assert main(["convert", str(dense), str(tmp_path / "out"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "config.json: the model's config: invalid JSON (nested too deeply to read)" in err
    assert len(err.splitlines()) == 1
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("key", "value", "said"), [
    ("vocab_size", 10**12, "base_config.vocab_size is 1000000000000; upcycle takes whole numbers from 1 to"),
    ("num_hidden_layers", -1, "base_config.num_hidden_layers is -1"),
    ("num_attention_heads", 0, "base_config.num_attention_heads is 0"),
    ("rms_norm_eps", -1, "base_config.rms_norm_eps is -1; it must be a finite number above 0"),
    ("rms_norm_eps", float("nan"), "base_config.rms_norm_eps is nan; it must be a finite number above 0"),
])
def test_an_upcycle_folders_base_config_is_range_checked(lm, capsys, key, value, said):
    """An upcycle folder's base_config is checked as a dense config.json is, before transformers builds from it:
    a vocabulary of 10^12 was an allocator message, zero heads a modulo by zero, a NaN epsilon a NaN model."""
    import json

    import upcycle
    from conftest import fails

    _, moe, _, held = lm
    config = json.loads((moe / "config.json").read_text())
    config["base_config"][key] = value
    (moe / "config.json").write_text(json.dumps(config))          # NaN as JSON's NaN, which Python reads back
    with pytest.raises(upcycle.UpcycleError, match=re.escape(said)):
        upcycle.load(moe)
    fails(capsys, ["eval", str(moe), "--data", str(held), "--tokens", "32", "--quiet"], said)
