"""Token ids outside the model's embedding are refused on the host, before any forward: on a GPU the lookup would
be a device-side assert that leaves the process's CUDA context unusable (upcycle.data.token_ids)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from conftest import make_tiny
from upcycle.data.token_ids import check_token_ids, embedding_rows, is_cuda_failure
from upcycle.errors import UpcycleError


def test_the_first_bad_id_is_named_with_its_position():
    check_token_ids(torch.tensor([[0, 5], [9, 1]]), 10, "ok")
    with pytest.raises(UpcycleError, match=r"^f\.safetensors: token id 10 at position \[1, 0\] is outside the "
                                           r"model's embedding of 10 rows \(ids 0 to 9\)"):
        check_token_ids(torch.tensor([[0, 5], [10, 12]]), 10, "f.safetensors")
    with pytest.raises(UpcycleError, match=r"token id -1 at position \[2\]"):
        check_token_ids(torch.tensor([3, 4, -1]), 10, "ids")
    assert embedding_rows(make_tiny("clip").config) == make_tiny("clip").config.text_config.vocab_size


def test_a_calibration_file_of_foreign_ids_is_refused_before_the_weights_load(tmp_path, no_weights_loaded):
    from upcycle import ConvertConfig, convert
    from upcycle.config_reader import build

    model = make_tiny("llama")
    model.save_pretrained(tmp_path / "dense")
    rows = model.config.vocab_size
    ids = torch.randint(0, rows, (4, 8))
    ids[2, 5] = rows + 7
    save_file({"input_ids": ids, "attention_mask": torch.ones(4, 8, dtype=torch.long)}, tmp_path / "ids.safetensors")
    with pytest.raises(UpcycleError, match=rf"ids.safetensors \(batch 1\): token id {rows + 7} at position \[2, 5\]"):
        convert(build(ConvertConfig, {"model": str(tmp_path / "dense"), "method": "cluster",
                                      "calibration": {"data": str(tmp_path / "ids.safetensors")}}),
                tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_training_pairs_tokenized_past_the_embedding_are_refused_before_any_forward(tmp_path, monkeypatch):
    """A tokenizer with more tokens than the model's embedding (ids past its rows): the task refuses its table
    at start-up, and the model is never called."""
    from test_contrastive import tokenizer, toy_pairs, write_pairs

    from upcycle.config import TrainConfig
    from upcycle.config_reader import build
    from upcycle.tasks.contrastive import ContrastiveTask

    model, tok = make_tiny("bert"), tokenizer()
    write_pairs(tmp_path / "pairs.jsonl", toy_pairs(32))
    model.resize_token_embeddings(5)            # fewer rows than the tokenizer's ids
    called = []
    model.register_forward_pre_hook(lambda *a: called.append(1))
    cfg = build(TrainConfig, {"model": "unused", "data": str(tmp_path / "pairs.jsonl"),
                              "eval_data": str(tmp_path / "pairs.jsonl"), "batch_size": 4,
                              "sequence_length": 64, "eval_pairs": 4})
    with pytest.raises(UpcycleError, match=r"pairs.jsonl as tokenized: token id \d+ at position .* outside the "
                                           r"model's embedding of 5 rows"):
        ContrastiveTask(cfg, model, tok)
    assert called == []


def test_a_cuda_failure_is_recognised_for_its_message():
    assert is_cuda_failure(RuntimeError("CUDA error: device-side assert triggered"))
    assert not is_cuda_failure(IndexError("index out of range in self"))


def big_vocabulary_tokenizer(words: int = 300):
    """A word-level tokenizer whose ids run past the tiny models' 128 embedding rows, and a text that uses them."""
    from upcycle.data.clip_pairs import caption_tokenizer

    vocabulary = [f"w{i:03d}" for i in range(words)]
    return caption_tokenizer([" ".join(vocabulary)], max_length=64), " ".join(reversed(vocabulary))


def test_a_probe_text_tokenized_past_the_embedding_is_refused_before_the_model_sees_it():
    from upcycle.config import CheckConfig
    from upcycle.probe import make_probe

    model = make_tiny("llama")
    called = []
    model.register_forward_pre_hook(lambda *a: called.append(1))
    tok, text = big_vocabulary_tokenizer()
    with pytest.raises(UpcycleError, match=r"^the probe text \(probe.txt\) as tokenized: token id \d{3} at position "
                                           r"\[0, \d+\] is outside the model's embedding of 128 rows"):
        make_probe(model, tok, [text], CheckConfig(sequences=2, tokens=16), seed=0, text_source="probe.txt")
    assert called == []
    ok = make_probe(model, tok, [" ".join(f"w{i:03d}" for i in range(100))] * 2, CheckConfig(sequences=2, tokens=16),
                    seed=0)
    assert int(ok.inputs["input_ids"].max()) < 128        # ids inside the rows pass


def test_calibration_text_tokenized_past_the_embedding_is_refused():
    from upcycle import ConvertConfig
    from upcycle.config_reader import build
    from upcycle.conversion.model_data import calibration_batches

    config = make_tiny("llama").config
    tok, text = big_vocabulary_tokenizer()
    cfg = build(ConvertConfig, {"model": "unused", "method": "cluster", "calibration": {"data": "cal.txt",
                                                                                         "tokens": 32}})
    with pytest.raises(UpcycleError, match=r"^calibration data cal.txt as tokenized: token id \d{3} at position "
                                           r"\[0, \d+\] is outside the model's embedding of 128 rows"):
        calibration_batches(cfg, tok, [text], config)
    small = " ".join(f"w{i:03d}" for i in range(100))
    assert int(calibration_batches(cfg, tok, [small], config)[0]["input_ids"].max()) < 128


def test_clip_captions_tokenized_past_the_text_embedding_are_refused_at_start_up():
    """CLIP training encodes every caption at start-up: ids past the text tower's rows are refused there, naming
    the pairs, and the model is never called."""
    from upcycle.config import TrainConfig
    from upcycle.config_reader import build
    from upcycle.data.clip_pairs import caption_tokenizer, load_pairs
    from upcycle.tasks.clip import CLIPTask

    model = make_tiny("clip")
    tok = caption_tokenizer(load_pairs("digits").captions, max_length=32)
    assert tok.vocab_size > 8
    model.config.text_config.vocab_size = 8        # the rows the check reads: fewer than the tokenizer's ids
    called = []
    model.register_forward_pre_hook(lambda *a: called.append(1))
    cfg = build(TrainConfig, {"model": "unused", "data": "digits", "batch_size": 4})
    with pytest.raises(UpcycleError, match=r"^image-caption pairs digits as tokenized: token id \d+ at position "
                                           r"\[\d+, \d+\] is outside the model's embedding of 8 rows"):
        CLIPTask(cfg, model, tok)
    assert called == []


def test_eval_refusals_of_token_ids_name_the_file(tmp_path, capsys):
    """`upcycle eval` on every task: an id past the embedding is refused naming the data file it came from (the
    contrastive refusal said "texts to embed", and the causal LM's was not made at all)."""
    import json

    from test_contrastive import tokenizer, toy_pairs, write_pairs

    from conftest import fails
    from upcycle.data.clip_pairs import caption_tokenizer, load_pairs

    llama = make_tiny("llama")
    llama.save_pretrained(tmp_path / "llama")
    tok, text = big_vocabulary_tokenizer()
    tok.save_pretrained(tmp_path / "llama")
    (tmp_path / "held.txt").write_text(text + "\n")
    fails(capsys, ["eval", str(tmp_path / "llama"), "--data", str(tmp_path / "held.txt"), "--tokens", "32",
                   "--sequence-length", "16", "--quiet", "--device", "cpu"],
          f"held-out text {tmp_path / 'held.txt'} as tokenized: token id")

    bert = make_tiny("bert")
    bert.resize_token_embeddings(5)
    bert.save_pretrained(tmp_path / "bert")
    tokenizer().save_pretrained(tmp_path / "bert")
    write_pairs(tmp_path / "pairs.jsonl", toy_pairs(16))
    fails(capsys, ["eval", str(tmp_path / "bert"), "--task", "contrastive", "--data", str(tmp_path / "pairs.jsonl"),
                   "--sequence-length", "32", "--quiet", "--device", "cpu"],
          f"the queries of held-out text pairs {tmp_path / 'pairs.jsonl'} as tokenized: token id")

    clip = make_tiny("clip")
    clip.save_pretrained(tmp_path / "clip")
    captions = caption_tokenizer(load_pairs("digits").captions + [f"word{i}" for i in range(200)], max_length=16)
    captions.save_pretrained(tmp_path / "clip")
    config = json.loads((tmp_path / "clip" / "config.json").read_text())
    assert captions.vocab_size > config["text_config"]["vocab_size"]
    fails(capsys, ["eval", str(tmp_path / "clip"), "--quiet", "--device", "cpu"],
          "held-out captions of digits test split as tokenized: token id")
