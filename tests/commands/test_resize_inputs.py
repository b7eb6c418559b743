"""Inputs that prune, grow and train's plan used to fail on with a traceback or a silent rewrite: an encoder whose
position table is shorter than the calibration rows, a seed past what a generator takes, a launcher count that is
no number, and a stock export's tokenizer files (kept as they were given, not saved again in this transformers'
words)."""

from __future__ import annotations

import pytest

from conftest import fails, make_tiny
from upcycle.cli import main


@pytest.fixture(scope="module")
def tiny_encoder(tmp_path_factory):
    """A tiny BERT of 64 positions with a word-level tokenizer, copy-upcycled to 4 experts (top-2)."""
    from upcycle.data.clip_pairs import caption_tokenizer

    root = tmp_path_factory.mktemp("encoder")
    model = make_tiny("bert")
    assert model.config.max_position_embeddings == 64
    tokenizer = caption_tokenizer("the a cat dog sat ran on under mat tree red blue big small".split(), max_length=64)
    model.save_pretrained(root / "dense")
    tokenizer.save_pretrained(root / "dense")
    assert main(["convert", str(root / "dense"), str(root / "moe"), "--num-experts", "4", "--top-k", "2",
                 "--quiet"]) == 0
    return root / "moe"


@pytest.mark.parametrize(("command", "n", "streaming"), [("prune", "3", False), ("grow", "6", False),
                                                        ("prune", "3", True), ("grow", "6", True)])
def test_an_encoder_of_64_positions_prunes_and_grows_on_rows_of_64(tiny_encoder, tmp_path, command, n, streaming):
    """Calibration rows are cut at the model's position table, not a fixed 256 (which made 'The expanded size of
    the tensor (256) must match the existing size (64)')."""
    import json

    out = tmp_path / "out"
    assert main([command, str(tiny_encoder), str(out), "--num-experts", n, "--calibration-tokens", "512",
                 "--quiet", *["--streaming"] * streaming]) == 0
    report = json.loads((out / "resize_report.json").read_text())
    assert report["calibration"]["tokens"] >= 256 and report["kind"] == command


@pytest.mark.parametrize("argv", [["prune", "MOE", "OUT", "--num-experts", "3", "--by", "random"],
                                  ["grow", "MOE", "OUT", "--num-experts", "6", "--perturb", "noise"]])
def test_a_seed_past_what_a_generator_takes_is_one_line(tiny_lm, tmp_path, capsys, argv):
    _, moe, train, _ = tiny_lm
    out = tmp_path / "out"
    argv = [{"MOE": str(moe), "OUT": str(out)}.get(a, a) for a in argv]
    with pytest.raises(SystemExit) as stop:
        main([*argv, "--calibration", str(train), "--seed", "100000000000000000000"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "--seed: must be between 0 and 4294967295" in err and "Traceback" not in err and not out.exists()


@pytest.mark.parametrize("value", ["abc", "0", "-2", ""])
def test_a_launcher_count_that_is_no_process_count_is_one_line(tiny_lm, tmp_path, capsys, monkeypatch, value):
    _, moe, train, _ = tiny_lm
    monkeypatch.setenv("WORLD_SIZE", value)
    fails(capsys, ["train", str(moe), str(tmp_path / "run"), "--data", str(train), "--plan"],
          f"WORLD_SIZE={value!r} in the environment: the launcher sets it to a whole number >= 1")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("export_class", ["mixtral", "qwen2_moe"])
def test_a_pruned_or_grown_folder_keeps_the_tokenizer_files_it_was_given(tiny_lm, tmp_path, export_class):
    """A prune of a stock export (and a prune or grow of an upcycle folder) writes the source's tokenizer files
    byte for byte: saving the tokenizer again wrote "TokenizersBackend" and is_local / local_files_only into
    tokenizer_config.json, which transformers 4 and llama.cpp's converter refuse."""
    from upcycle.checkpoint.loading import TOKENIZER_FOLDER_FILES

    _, moe, train, _ = tiny_lm
    stock = tmp_path / "stock"
    assert main(["export", str(moe), str(stock), "--export-class", export_class]) == 0
    flags = ["--calibration", str(train), "--calibration-tokens", "128", "--quiet"]
    runs = [(stock, ["prune", str(stock), str(tmp_path / "pruned-stock"), "--num-experts", "3"]),
            (moe, ["prune", str(moe), str(tmp_path / "pruned"), "--num-experts", "3"]),
            (moe, ["grow", str(moe), str(tmp_path / "grown"), "--num-experts", "5"]),
            (moe, ["grow", str(moe), str(tmp_path / "grown-streamed"), "--num-experts", "5", "--streaming"])]
    for source, argv in runs:
        assert main([*argv, *flags]) == 0
        out = argv[2]
        given = _texts(source, TOKENIZER_FOLDER_FILES)
        assert given and _texts(out, TOKENIZER_FOLDER_FILES) == given, argv
    assert "TokenizersBackend" not in (tmp_path / "pruned-stock" / "tokenizer_config.json").read_text()


def _texts(folder, names) -> dict[str, bytes]:
    from pathlib import Path

    return {name: (Path(folder) / name).read_bytes() for name in names if (Path(folder) / name).is_file()}


def test_contrastive_train_and_eval_refuse_the_same_short_sequence_length(tiny_encoder, tmp_path, capsys):
    """Both name the encoder's own floor (its special tokens and one token of text); eval said '>= 2' first."""
    line = "cannot hold a text: this tokenizer adds"
    fails(capsys, ["eval", str(tiny_encoder), "--sequence-length", "2"], line)
    fails(capsys, ["train", str(tiny_encoder), str(tmp_path / "run"), "--sequence-length", "2", "--steps", "1"], line)
    assert not (tmp_path / "run").exists()
