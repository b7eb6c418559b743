"""`upcycle train` / `upcycle eval` on what users actually give them: stock MoE exports load as they
are, encoders are refused instead of trained on a meaningless task, and bad inputs get a message, not a
traceback, before any output is written."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import transformers as T

from conftest import make_tiny
from upcycle.cli import main
from upcycle.config import RegularizerConfig, TrainConfig
from upcycle.errors import UpcycleError
from upcycle.tasks.evaluate import evaluate_model
from upcycle.training.trainer import train

RUN = ["--steps", "2", "--batch-size", "4", "--sequence-length", "32", "--quiet", "--set", "eval_tokens=64"]


@pytest.fixture(scope="module")
def exported(tiny_lm, tmp_path_factory) -> Path:
    """The tiny upcycled Llama exported to the stock Qwen2-MoE class (with its tokenizer)."""
    from upcycle.export.from_folder import export_folder

    out = tmp_path_factory.mktemp("export") / "qwen2moe"
    export_folder(tiny_lm[1], out)
    return out


def test_stock_moe_exports_evaluate_as_they_are(tiny_lm, exported, capsys):
    held = str(tiny_lm[3])
    assert main(["eval", str(exported), "--data", held, "--tokens", "128", "--sequence-length", "32"]) == 0
    stock = json.loads(capsys.readouterr().out)
    ours = evaluate_model(str(tiny_lm[1]), data=held, tokens=128, sequence_length=32)
    assert stock["tokens"] == ours["tokens"] > 0
    # the export is checked to 1e-5 in logits; perplexity over 128 tokens moves far less than 1e-4 relative
    assert stock["perplexity"] == pytest.approx(ours["perplexity"], rel=1e-4)


def test_stock_moe_exports_train_with_router_losses(tiny_lm, exported, tmp_path):
    _, _, train_txt, held = tiny_lm
    cfg = TrainConfig(model=str(exported), data=str(train_txt), eval_data=str(held), steps=3, batch_size=4,
                      sequence_length=32, lr=3e-3, eval_tokens=64,
                      regularizers=RegularizerConfig(load_balance=0.01, z_loss=0.001))
    summary = train(cfg, tmp_path / "run", progress=False)
    rows = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "loss" in row]
    assert {"task", "load_balance", "z_loss", "total"} == set(steps[0]["loss"])
    # every MoE block's router recorded (as many as the upcycle folder had MoE layers), with real statistics
    n_moe = len(json.loads((tiny_lm[1] / "upcycle_config.json").read_text())["layers"])
    assert len(steps[0]["layers"]) == n_moe and all(v["entropy"] > 0 for v in steps[0]["layers"].values())
    # load balance is 1 under uniform routing and at most E/k = 2
    assert all(1.0 <= row["loss"]["load_balance"] <= 2.0 for row in steps)
    model = T.AutoModelForCausalLM.from_pretrained(summary["model"])
    # the class the export wrote (auto: Mixtral for this every-block, renormalized conversion), trained as itself
    assert type(model).__name__ == json.loads((exported / "config.json").read_text())["architectures"][0] \
        == "MixtralForCausalLM"
    with pytest.raises(UpcycleError, match="stock class"):
        train(TrainConfig(**{**cfg.__dict__, "regularizers": RegularizerConfig(eesd=0.1)}), tmp_path / "eesd",
              progress=False)
    assert not (tmp_path / "eesd").exists()


@pytest.fixture
def bert_mlm(tiny_lm, tmp_path) -> Path:
    """A tiny BertForMaskedLM with the tiny Llama's word tokenizer (what a user's BERT folder looks like)."""
    folder = tmp_path / "bert"
    T.BertForMaskedLM(T.BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   intermediate_size=64, max_position_embeddings=64)).save_pretrained(folder)
    T.AutoTokenizer.from_pretrained(tiny_lm[0]).save_pretrained(folder)
    return folder


def test_encoders_are_refused_next_token_tasks_and_text_without_pairs(tiny_lm, bert_mlm, tmp_path, capsys):
    from upcycle import ConvertConfig, MoEConfig, convert

    moe = tmp_path / "bert-moe"
    convert(ConvertConfig(model=str(bert_mlm), moe=MoEConfig(num_experts=2, top_k=1)), moe, progress=False)
    for model in (bert_mlm, moe):
        # an encoder's task is the contrastive one (tests/commands/test_contrastive.py): pairs, not plain text
        assert main(["train", str(model), str(tmp_path / "run"), "--data", str(tiny_lm[2]), *RUN]) == 2
        assert "expected a .jsonl or .jsonl.gz file" in capsys.readouterr().err
        assert main(["train", str(model), str(tmp_path / "run"), "--data", str(tiny_lm[2]), "--task", "causal_lm",
                     *RUN]) == 2
        assert "masked-LM training" in capsys.readouterr().err
        assert main(["eval", str(model), "--data", str(tiny_lm[3]), "--task", "causal_lm"]) == 2
        assert "not a causal language model" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_eval_refuses_bad_arguments_before_evaluating(tiny_lm, tmp_path, capsys):
    _, moe, _, held = tiny_lm
    cases = [(["--tokens", "0"], "--tokens must be >= 1"),
             (["--out", str(tmp_path)], "is a folder"),
             (["--out", str(tmp_path / "no" / "such" / "r.json")], "does not exist"),
             (["--data", str(tmp_path)], "is a folder")]
    for extra, message in cases:
        assert main(["eval", str(moe), "--data", str(held), *extra]) == 2, extra
        assert message in capsys.readouterr().err, extra


def test_eval_tokens_counts_whole_rows_covering_what_was_asked(tiny_lm, tmp_path, capsys):
    _, moe, _, held = tiny_lm
    one = evaluate_model(str(moe), data=str(held), tokens=1, sequence_length=32)
    three = evaluate_model(str(moe), data=str(held), tokens=65, sequence_length=32)
    assert one["tokens"] == 31 and three["tokens"] == 3 * 31     # 32-token rows predict 31 tokens each
    # more tokens than the data holds: all of it is evaluated, and the console says so
    short = tmp_path / "short.txt"
    short.write_text("the cat sat on the mat under the red tree.")
    small = evaluate_model(str(moe), data=str(short), tokens=100000, sequence_length=32)
    assert 0 < small["tokens"] < 32 and "fewer than the 100,000 asked for" in capsys.readouterr().err


def test_eval_of_a_corrupt_upcycle_folder_says_so(tiny_lm, tmp_path, capsys):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_lm[1], broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    assert main(["eval", str(broken), "--data", str(tiny_lm[3])]) == 2
    assert "model.safetensors is not a readable safetensors file" in capsys.readouterr().err


def test_train_refuses_bad_inputs_before_writing(tiny_lm, tmp_path, capsys):
    _, moe, train_txt, _ = tiny_lm
    a_file = tmp_path / "a_file"
    a_file.write_text("not a folder")
    assert main(["train", str(moe), str(a_file), "--data", str(train_txt), *RUN]) == 2
    assert "not a folder" in capsys.readouterr().err and a_file.read_text() == "not a folder"
    (tmp_path / "texts").mkdir()
    assert main(["train", str(moe), str(tmp_path / "run"), "--data", str(tmp_path / "texts"), *RUN]) == 2
    assert "is a folder" in capsys.readouterr().err
    # data that holds OUT: the output check names it first
    assert main(["train", str(moe), str(tmp_path / "run"), "--data", str(tmp_path), *RUN]) == 2
    assert "lies inside the training data" in capsys.readouterr().err
    binary = tmp_path / "data.txt"
    binary.write_bytes(bytes(range(256)) * 4)
    assert main(["train", str(moe), str(tmp_path / "run"), "--data", str(binary), *RUN]) == 2
    assert "not valid UTF-8" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_gpt2_rows_longer_than_its_positions_are_refused(tiny_lm, tmp_path, capsys):
    folder = tmp_path / "gpt2"
    make_tiny("gpt2").save_pretrained(folder)                      # n_positions = 64
    T.AutoTokenizer.from_pretrained(tiny_lm[0]).save_pretrained(folder)
    args = ["--data", str(tiny_lm[2]), "--steps", "1", "--batch-size", "2", "--quiet"]
    assert main(["train", str(folder), str(tmp_path / "run"), *args, "--sequence-length", "65"]) == 2
    assert "longer than the 64 positions" in capsys.readouterr().err
    assert main(["eval", str(folder), "--data", str(tiny_lm[3]), "--sequence-length", "65"]) == 2
    assert "longer than the 64 positions" in capsys.readouterr().err
    assert main(["train", str(folder), str(tmp_path / "run"), *args, "--sequence-length", "64"]) == 0


def test_a_broken_tokenizer_is_reported_not_replaced_by_random_ids(tiny_lm, tmp_path, capsys):
    """Tokenizer files that fail to load are an error for convert and eval; a folder without any stays fine."""
    folder = tmp_path / "dense"
    shutil.copytree(tiny_lm[0], folder)
    (folder / "tokenizer.json").write_text("{ not json")
    assert main(["convert", str(folder), str(tmp_path / "out"), "--num-experts", "2", "--top-k", "1",
                 "--quiet"]) == 2
    assert "tokenizer files there do not load" in capsys.readouterr().err
    assert main(["eval", str(folder), "--data", str(tiny_lm[3])]) == 2
    assert "tokenizer files there do not load" in capsys.readouterr().err
    bare = tmp_path / "bare"
    make_tiny("llama").save_pretrained(bare)                      # no tokenizer files at all
    assert main(["convert", str(bare), str(tmp_path / "out2"), "--num-experts", "2", "--top-k", "1",
                 "--quiet"]) == 0
