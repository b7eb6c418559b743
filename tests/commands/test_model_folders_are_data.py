"""A model folder is data, never code, and never a way out of itself: its own Python never runs (whatever stdin
answers), a weight index naming files outside it is refused, and missing tensors, a config the weights do not fit,
NaN weights or an upcycled folder given as a dense one are refused with a message naming what is wrong. Every case
runs the command as a user would type it and checks the exit status, the message, and that every input is byte for
byte what it was."""

from __future__ import annotations

import io
import json
import shutil
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from conftest import fails, make_tiny
from upcycle.cli import main

QUIET = ["--quiet"]
TRAIN = ["--steps", "1", "--batch-size", "2", "--sequence-length", "16", "--set", "eval_tokens=32", "--quiet"]


def _planted(folder: Path, marker: Path, *, tokenizer_only: bool = False, dense: Path | None = None) -> Path:
    """A model folder whose config (or only its tokenizer) names Python of its own that creates `marker`."""
    folder.mkdir()
    (folder / "evil.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).mkdir(exist_ok=True)\n"
        "from transformers import LlamaConfig, PreTrainedTokenizerFast\n"
        "class EvilConfig(LlamaConfig):\n    model_type = 'evil'\n"
        "class EvilTokenizer(PreTrainedTokenizerFast):\n    pass\n")
    if tokenizer_only:
        for f in dense.iterdir():
            shutil.copy(f, folder / f.name)
        config = json.loads((folder / "tokenizer_config.json").read_text())
        config["auto_map"] = {"AutoTokenizer": ["evil.EvilTokenizer", "evil.EvilTokenizer"]}
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
        return folder
    config = make_tiny("llama").config.to_dict()
    config.update(model_type="evil", auto_map={"AutoConfig": "evil.EvilConfig",
                                               "AutoModelForCausalLM": "evil.EvilConfig"})
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_remote_code_never_runs_even_when_stdin_says_yes(lm, tmp_path, capsys, monkeypatch):
    dense, moe, train, held = lm
    marker = tmp_path / "PLANTED-CODE-RAN"
    evil = _planted(tmp_path / "evil", marker)
    evil_tokenizer = _planted(tmp_path / "evil-tok", marker, tokenizer_only=True, dense=dense)
    commands = [["convert", str(evil), str(tmp_path / "o1"), *QUIET],
                ["convert", str(evil), "--dry-run", *QUIET],
                ["train", str(evil), str(tmp_path / "o2"), "--data", str(train), *TRAIN],
                ["eval", str(evil), "--data", str(held)],
                ["analyze", str(moe), str(tmp_path / "o3"), "--dense", str(evil), "--data", str(held), "--quiet"]]
    for argv in commands:
        monkeypatch.setattr(sys, "stdin", io.StringIO("y\n" * 10))
        fails(capsys, argv, "")
        assert not marker.exists(), argv
    assert not any((tmp_path / f"o{i}").exists() for i in range(1, 4))
    # a known model type whose tokenizer names its own class: transformers' own class reads the same files, and
    # the folder's class never loads
    monkeypatch.setattr(sys, "stdin", io.StringIO("y\n" * 10))
    assert main(["convert", str(evil_tokenizer), str(tmp_path / "o4"), "--num-experts", "2", "--top-k", "1",
                 *QUIET]) == 0
    assert not marker.exists()


def _escaping_index(folder: Path, tmp_path: Path, entry: str) -> None:
    """Point one tensor of `folder`'s index at a shard outside it (copied there, so reading it would work)."""
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    name, file = next(iter(index["weight_map"].items()))
    secret = tmp_path / "secret"
    secret.mkdir(exist_ok=True)
    shutil.copy(folder / file, secret / file)
    index["weight_map"][name] = entry.format(secret=secret, file=file)
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


@pytest.mark.parametrize("entry", ["../secret/{file}", "{secret}/{file}"])
def test_an_index_that_points_outside_the_folder_is_refused(lm, tmp_path, capsys, entry):
    dense, _, _, held = lm
    sharded = tmp_path / "sharded"
    make_tiny("llama").save_pretrained(sharded, max_shard_size="20KB")
    _escaping_index(sharded, tmp_path, entry)
    for extra in ([], ["--set", "streaming=false"]):
        fails(capsys, ["convert", str(sharded), str(tmp_path / "o"), *extra, *QUIET], "may only name files")
    moe = tmp_path / "moe"
    assert main(["convert", str(dense), str(moe), "--num-experts", "2", "--top-k", "1", "--shard-size", "20KB",
                 *QUIET]) == 0
    _escaping_index(moe, tmp_path, entry)
    fails(capsys, ["eval", str(moe), "--data", str(held)], "may only name files")
    fails(capsys, ["export", str(moe), str(tmp_path / "e")], "may only name files")
    fails(capsys, ["analyze", str(moe), str(tmp_path / "a"), "--data", str(held), "--quiet"], "may only name files")
    assert not any((tmp_path / n).exists() for n in ("o", "e", "a"))


@pytest.mark.parametrize("streaming", ["true", "false"])
def test_missing_tensors_a_wrong_config_and_nan_weights_are_refused(tmp_path, capsys, streaming):
    model = tmp_path / "m"
    make_tiny("llama").save_pretrained(model)
    weights = load_file(model / "model.safetensors")
    run = ["--num-experts", "2", "--top-k", "1", "--set", f"streaming={streaming}", *QUIET]
    # one tensor deleted
    save_file({k: v for k, v in weights.items() if k != "model.layers.1.mlp.up_proj.weight"},
              model / "model.safetensors", metadata={"format": "pt"})
    fails(capsys, ["convert", str(model), str(tmp_path / "o"), *run], "model.layers.1.mlp.up_proj.weight")
    # NaN in a source weight
    bad = dict(weights)
    bad["model.layers.2.mlp.down_proj.weight"] = bad["model.layers.2.mlp.down_proj.weight"].clone()
    bad["model.layers.2.mlp.down_proj.weight"][0, 0] = float("nan")
    save_file(bad, model / "model.safetensors", metadata={"format": "pt"})
    fails(capsys, ["convert", str(model), str(tmp_path / "o"), *run], "NaN or infinite")
    # config.json without num_hidden_layers: the class default (32 blocks) does not match the 4 stored
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((model / "config.json").read_text())
    del config["num_hidden_layers"]
    (model / "config.json").write_text(json.dumps(config))
    line = fails(capsys, ["convert", str(model), str(tmp_path / "o"), *run], "model.layers.")
    assert "match" in line          # in memory: "does not match its config"; streaming: "names do not match"
    assert not (tmp_path / "o").exists()


def test_an_upcycled_folder_is_not_converted_again(lm, tmp_path, capsys):
    _, moe, _, _ = lm
    fails(capsys, ["convert", str(moe), str(tmp_path / "o"), *QUIET], "is an upcycle MoE folder already")


def test_a_wrong_intermediate_size_is_named_on_the_streaming_path(tmp_path, capsys):
    model = tmp_path / "m"
    make_tiny("llama").save_pretrained(model)
    config = json.loads((model / "config.json").read_text())
    config["intermediate_size"] = 48
    (model / "config.json").write_text(json.dumps(config))
    fails(capsys, ["convert", str(model), str(tmp_path / "o"), *QUIET], "does not fit its config.json")
