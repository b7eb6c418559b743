"""The contrastive task for encoders: InfoNCE by hand, retrieval metrics on known answers, preservation of a
copy-upcycled encoder's embeddings and retrieval, the split by document, bad pair files, `train` and `eval`."""

from __future__ import annotations

import gzip
import json
import math
import random

import pytest
import torch

from conftest import make_tiny
from upcycle.data.text_pairs import (
    PACKAGED,
    TextPairs,
    group_of,
    load_text_pairs,
    read_text_pairs,
    split_by_document,
)
from upcycle.errors import UpcycleError
from upcycle.tasks.contrastive import InfoNCE, PairBatches, info_nce, pair_loss
from upcycle.tasks.embedding import embed_texts, last_hidden, mean_pool
from upcycle.tasks.kind import uses_contrastive
from upcycle.tasks.retrieval import pair_retrieval, retrieval_metrics

WORDS = "the a cat dog bird sat ran flew on under over mat tree roof red blue big small".split()


def toy_pairs(n: int = 48, seed: int = 0) -> TextPairs:
    """Documents of random words; a query is two of its document's words; two sources, some shared documents."""
    rng = random.Random(seed)
    docs = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12))) for _ in range(n // 2)]
    queries, documents, sources, ids = [], [], [], []
    for i in range(n):
        d = i % len(docs)                          # every document has two pairs
        words = docs[d].split()
        queries.append(f"{words[0]} {words[-1]} {i}")
        documents.append(docs[d])
        sources.append("first" if i < n // 2 else "second")
        ids.append(f"doc{d}")
    return TextPairs(queries, documents, sources, ids)


def tokenizer():
    from upcycle.data.clip_pairs import caption_tokenizer

    return caption_tokenizer(WORDS + [str(i) for i in range(64)], max_length=64)


def write_pairs(path, pairs: TextPairs) -> None:
    rows = zip(pairs.queries, pairs.documents, pairs.sources, pairs.doc_ids, strict=True)
    path.write_text("".join(json.dumps({"query": q, "document": d, "source": s, "doc_id": i}) + "\n"
                            for q, d, s, i in rows))


def test_info_nce_equals_the_hand_computed_loss_with_duplicates_masked():
    q = torch.tensor([[1.0, 0.0], [0.6, 0.8], [0.0, 2.0]])
    d = torch.tensor([[3.0, 4.0], [1.0, 0.0], [0.0, 1.0]])
    tau = 0.5
    cos = [[sum(a * b for a, b in zip(qi, dj, strict=True)) / math.hypot(*qi) / math.hypot(*dj) for dj in d.tolist()]
           for qi in q.tolist()]

    def ce(rows, keep):        # mean over i of -log softmax(rows[i] / tau)[i] over the kept columns
        return sum(-rows[i][i] / tau + math.log(sum(math.exp(rows[i][j] / tau) for j in range(3) if keep(i, j)))
                   for i in range(3)) / 3

    transposed = [[cos[j][i] for j in range(3)] for i in range(3)]
    everything = (ce(cos, lambda i, j: True) + ce(transposed, lambda i, j: True)) / 2
    assert float(info_nce(q, d, tau)) == pytest.approx(everything, abs=1e-6)
    # pairs 0 and 2 share a document: neither is a negative of the other, in either direction
    same = torch.tensor([[1, 0, 1], [0, 1, 0], [1, 0, 1]], dtype=torch.bool)
    negative = lambda i, j: i == j or {i, j} != {0, 2}        # noqa: E731
    kept = (ce(cos, negative) + ce(transposed, negative)) / 2
    assert float(info_nce(q, d, tau, same)) == pytest.approx(kept, abs=1e-6)
    assert kept != pytest.approx(everything)
    # the module: fixed temperature = the function; learned, its log-scale gets a gradient
    assert float(InfoNCE(tau)(q, d, same)) == pytest.approx(kept, abs=1e-6)
    learned = InfoNCE(tau, learn=True)
    learned(q, d).backward()
    assert learned.log_scale.grad is not None and float(learned.log_scale.grad) != 0.0
    assert list(InfoNCE(tau).parameters()) == []


def test_pair_loss_is_info_nce_of_the_mean_pooled_queries_and_documents():
    model, tok = make_tiny("bert"), tokenizer()
    pairs = toy_pairs()
    batch = PairBatches(tok, pairs, 8, seed=0, max_length=64).batch(3)
    loss = pair_loss(model, batch, 0.05).detach()

    def side(k):        # queries (0) or documents (1) in a forward of their own, padded only among themselves
        ids, mask = batch["input_ids"][:, k], batch["attention_mask"][:, k]
        length = int(mask.sum(1).max())
        return mean_pool(last_hidden(model, ids[:, :length], mask[:, :length]), mask[:, :length])

    doc, query = batch["doc_index"], batch["query_index"]
    same = (doc[:, None] == doc[None]) | (query[:, None] == query[None])
    assert bool((same & ~torch.eye(8, dtype=torch.bool)).any())      # the batch holds a shared document
    with torch.no_grad():
        expected = float(info_nce(side(0), side(1), 0.05, same))
    assert float(loss) == pytest.approx(expected, abs=1e-5)


def test_retrieval_metrics_on_constructed_cases():
    scores = torch.tensor([[0.9, 0.1, 0.3, 0.2],      # relevant 0 first: rank 1
                           [0.9, 0.1, 0.3, 0.2],      # relevant 3: beaten by 0 and 2: rank 3
                           [0.5, 0.5, 0.1, 0.0],      # relevant 1 ties with 0: the tie counts against, rank 2
                           [0.1, 0.2, 0.8, 0.7]])     # relevant 1 and 3: the best (3) is beaten by 2: rank 2
    relevant = torch.zeros(4, 4, dtype=torch.bool)
    relevant[0, 0] = relevant[1, 3] = relevant[2, 1] = relevant[3, 1] = relevant[3, 3] = True
    got = retrieval_metrics(scores, relevant, ks=(1, 2, 3))
    assert got == {"R@1": 0.25, "R@2": 0.75, "R@3": 1.0, "MRR": pytest.approx((1 + 1 / 3 + 1 / 2 + 1 / 2) / 4)}
    # a collapsed encoder (all scores equal) ranks last, not first
    assert retrieval_metrics(torch.zeros(2, 5), torch.eye(2, 5, dtype=torch.bool), ks=(1, 5)) == \
        {"R@1": 0.0, "R@5": 1.0, "MRR": 0.2}
    with pytest.raises(UpcycleError, match="no relevant candidate"):
        retrieval_metrics(scores, torch.zeros(4, 4, dtype=torch.bool))


def test_pair_retrieval_counts_repeated_texts_once_and_reports_per_source():
    model, tok = make_tiny("bert"), tokenizer()
    pairs = toy_pairs(16)
    got = pair_retrieval(model, tok, pairs, max_length=64)
    assert (got["pairs"], got["queries"], got["documents"]) == (16, 16, 8)
    assert {k: v["queries"] for k, v in got["per_source"].items()} == {"first": 8, "second": 8}
    for direction in ("query_to_document", "document_to_query"):
        assert set(got[direction]) == {"R@1", "R@5", "R@10", "MRR"}
    assert got["document_to_query"]["R@10"] >= got["document_to_query"]["R@5"] >= got["document_to_query"]["R@1"]


@pytest.fixture(scope="module")
def encoder_pair(tmp_path_factory):
    """(dense tiny BERT folder, its 4-expert copy-upcycled folder, a pair file) with a word-level tokenizer."""
    from upcycle import ConvertConfig, MoEConfig, convert
    from upcycle.config import CheckConfig

    root = tmp_path_factory.mktemp("encoder")
    model, tok = make_tiny("bert"), tokenizer()
    model.save_pretrained(root / "dense")
    tok.save_pretrained(root / "dense")
    pairs = toy_pairs(64)
    write_pairs(root / "pairs.jsonl", pairs)
    (root / "probe.txt").write_text("\n\n".join(dict.fromkeys(pairs.documents)))
    cfg = ConvertConfig(model=str(root / "dense"), method="copy", moe=MoEConfig(num_experts=4, top_k=2),
                        check=CheckConfig(text=str(root / "probe.txt"), tokens=24))
    convert(cfg, root / "moe", progress=False)
    return root / "dense", root / "moe", root / "pairs.jsonl"


def test_copy_upcycled_encoder_gives_the_dense_embeddings_and_the_same_retrieval(encoder_pair):
    from upcycle.checkpoint.loading import load_model
    from upcycle.core.moe import moe_layers

    dense, moe, data = encoder_pair
    (dense_model, tok), (moe_model, _) = load_model(str(dense)), load_model(str(moe))
    assert len(moe_layers(moe_model)) == 4 and not moe_layers(dense_model)
    pairs = read_text_pairs(data)
    texts = pairs.queries + list(dict.fromkeys(pairs.documents))
    a = embed_texts(dense_model, tok, texts, max_length=64)
    b = embed_texts(moe_model, tok, texts, max_length=64)
    assert float((a - b).abs().max()) < 1e-5
    assert pair_retrieval(moe_model, tok, pairs, max_length=64) == pair_retrieval(dense_model, tok, pairs,
                                                                                  max_length=64)


def test_train_and_eval_an_upcycled_encoder_with_every_router_regularizer(encoder_pair, tmp_path):
    from upcycle.config import TrainConfig
    from upcycle.config_reader import build
    from upcycle.runs.log import read_log
    from upcycle.tasks.evaluate import evaluate_model
    from upcycle.training.trainer import train

    _, moe, data = encoder_pair
    cfg = build(TrainConfig, {"model": str(moe), "data": str(data), "steps": 3, "batch_size": 8, "lr": 1e-3,
                              "sequence_length": 64, "eval_pairs": 16,
                              "regularizers": {"load_balance": 0.01, "z_loss": 0.001, "dpsl": 0.01, "eesd": 1.0}})
    assert cfg.task is None                     # an encoder gets the contrastive task without asking
    summary = train(cfg, tmp_path / "run", progress=False)
    steps = [r for r in map(json.loads, read_log(tmp_path / "run" / "log.jsonl", 1 << 62)) if "loss" in r]
    assert len(steps) == 3
    for row in steps:
        assert {"task", "load_balance", "z_loss", "dpsl", "eesd", "total"} <= set(row["loss"])
        assert all(math.isfinite(v) for v in row["loss"].values()) and row["layers"]
    held = load_text_pairs(str(data))[1]           # eval_pairs caps the held-out split
    assert summary["eval_before"]["pairs"] == min(16, len(held)) and "query_to_document" in summary["eval_after"]
    assert summary["eval_before"] != summary["eval_after"]
    result = evaluate_model(str(tmp_path / "run" / "model"), data=str(data), sequence_length=64, pairs=10,
                            task="contrastive")
    assert result["task"] == "contrastive" and result["pairs"] == 10
    assert set(result["per_source"]) <= {"first", "second"}


def test_a_forward_without_negatives_is_refused_before_anything_is_written(encoder_pair, tmp_path):
    """One pair per forward (batch_size 1, or batch_size / grad_accum = 1) or pairs that all share one document
    train nothing (loss 0, gradient 0: no in-batch negative): refused, naming why, with OUT left unmade."""
    from upcycle.config import TrainConfig
    from upcycle.config_reader import build
    from upcycle.training.trainer import train

    _, moe, data = encoder_pair
    base = {"model": str(moe), "data": str(data), "steps": 1, "sequence_length": 64, "eval_pairs": 4}
    for extra in ({"batch_size": 1}, {"batch_size": 4, "grad_accum": 4}):
        with pytest.raises(UpcycleError, match="at least 2 pairs in each forward"):
            train(build(TrainConfig, base | extra), tmp_path / "run", progress=False)
        assert not (tmp_path / "run").exists()
    one_document = tmp_path / "one.jsonl"
    one_document.write_text("".join(json.dumps({"query": f"q{i}", "document": "the only document",
                                                "source": "s", "doc_id": "d"}) + "\n" for i in range(8)))
    with pytest.raises(UpcycleError, match="same document"):
        train(build(TrainConfig, base | {"data": str(one_document), "eval_data": str(data), "batch_size": 4}),
              tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()


def test_a_batch_whose_pairs_share_one_document_is_refused_naming_the_step():
    pairs = TextPairs([f"q{i}" for i in range(6)], ["the cat"] * 4 + ["a dog", "the bird"], ["s"] * 6,
                      [f"d{i}" for i in range(6)])
    batches = PairBatches(tokenizer(), pairs, 2, 0, 16)
    found = []
    for step in range(12):
        try:
            batches.batch(step)
        except UpcycleError as e:
            found.append(str(e))
    # some seeded batch draws two pairs of the shared document: it has no negative and is refused
    assert found and all("no negative pair" in m for m in found)


def test_the_task_is_refused_for_a_model_that_is_not_an_encoder():
    assert uses_contrastive(make_tiny("bert"), None) and not uses_contrastive(make_tiny("bert"), "causal_lm")
    assert not uses_contrastive(make_tiny("llama"), None)
    with pytest.raises(UpcycleError, match="text encoder"):
        uses_contrastive(make_tiny("llama"), "contrastive")
    with pytest.raises(UpcycleError, match="CLIP's own contrastive task is 'clip'"):
        uses_contrastive(make_tiny("clip"), "contrastive")


def test_the_split_never_puts_one_documents_pairs_on_both_sides():
    ids = [f"wiki:Article{i % 37}#s{i % 5}" for i in range(300)] + [f"wordnet:n{i % 113}" for i in range(300)]
    pairs = TextPairs([f"q{i}" for i in range(600)], [f"text of {d}" for d in ids], ["s"] * 600, ids)
    train, held = split_by_document(pairs, held_out=0.2)
    assert len(train) + len(held) == 600 and len(held) > 0 and len(train) > 0
    assert not {group_of(d) for d in train.doc_ids} & {group_of(d) for d in held.doc_ids}
    # the side of a document depends on its id alone: shuffled, or half the file, the same documents are held out
    order = list(range(600))
    random.Random(1).shuffle(order)
    assert set(split_by_document(pairs.subset(order), held_out=0.2)[1].doc_ids) == set(held.doc_ids)
    assert set(split_by_document(pairs.subset(order[:300]), held_out=0.2)[1].doc_ids) <= set(held.doc_ids)


def test_the_packaged_pairs_have_several_sources_and_a_document_split():
    train, held = load_text_pairs(None)
    provenance = json.loads((PACKAGED.parent / "provenance.json").read_text())
    assert len(train) + len(held) == provenance["pairs"]
    assert len(set(train.sources)) >= 2 and set(held.sources) == set(provenance["per_source"])
    assert not {group_of(d) for d in train.doc_ids} & {group_of(d) for d in held.doc_ids}
    assert (PACKAGED.parent / "WORDNET-LICENSE").read_text().count("Princeton University") >= 2


@pytest.mark.parametrize(("content", "message"), [
    ('{"query": "a", "document": "b"}\nnot json\n', r"pairs\.jsonl:2: invalid JSON"),
    ('["a", "b"]\n', r":1: expected a JSON object"),
    ('{"query": "a"}\n', r':1: "document" must be a non-empty string'),
    ('{"query": "  ", "document": "b"}\n', r':1: "query" must be a non-empty string'),
    ('{"query": "a", "document": "b", "source": 3}\n', r':1: "source" must be a non-empty string'),
    ('{"query": "a", "document": "b", "doc_id": true}\n', r':1: "doc_id" must be'),
    ('{"query": "a", "document": "b", "doc_id": 1}\n{"query": "c", "document": "d", "doc_id": 1}\n',
     "names two different documents"),
    ("\n\n", "no pairs"),
    # JSON nested past Python's recursion limit, and an integer past its digit limit: one line naming file and
    # line, no RecursionError traceback
    ('{"query": ' + "[" * 100_000 + "]" * 100_000 + ', "document": "b"}\n', r"pairs\.jsonl:1: .*nested too deeply"),
    ('{"query": "a", "document": "b", "doc_id": ' + "9" * 5000 + "}\n", r"pairs\.jsonl:1: invalid JSON"),
])
def test_a_bad_pair_file_is_refused_naming_the_line(tmp_path, content, message):
    path = tmp_path / "pairs.jsonl"
    path.write_text(content)
    with pytest.raises(UpcycleError, match=message):
        read_text_pairs(path)


def test_unreadable_pair_files_are_refused(tmp_path):
    with pytest.raises(UpcycleError, match="no such file"):
        read_text_pairs(tmp_path / "missing.jsonl")
    with pytest.raises(UpcycleError, match="expected a .jsonl"):
        read_text_pairs(tmp_path / "pairs.txt")
    (tmp_path / "folder.jsonl").mkdir()
    with pytest.raises(UpcycleError, match="not a regular file"):
        read_text_pairs(tmp_path / "folder.jsonl")
    (tmp_path / "bad.jsonl.gz").write_bytes(b"not gzip")
    with pytest.raises(UpcycleError, match="cannot be read"):
        read_text_pairs(tmp_path / "bad.jsonl.gz")
    (tmp_path / "latin.jsonl").write_bytes('{"query": "caf\xe9", "document": "b"}\n'.encode("latin-1"))
    with pytest.raises(UpcycleError, match="not UTF-8"):
        read_text_pairs(tmp_path / "latin.jsonl")
    with pytest.raises(UpcycleError, match="^text pairs [^ ]+missing.jsonl: no such file"):     # said once
        read_text_pairs(tmp_path / "missing.jsonl")


def test_a_compressed_pair_file_is_bounded_by_what_it_decompresses_to(tmp_path, monkeypatch):
    """The size bound holds for the text a .gz expands to, not only for the compressed file (a 10 KB file of
    zeros that expands to 10 MB, with the bound lowered to 1 MB here)."""
    from upcycle.data import text_pairs

    monkeypatch.setattr(text_pairs, "MAX_PAIR_FILE_BYTES", 2**20)
    bomb = tmp_path / "bomb.jsonl.gz"
    with gzip.open(bomb, "wb") as f:
        f.write(b" \n" * 5 * 2**20)
    assert bomb.stat().st_size < 2**20
    with pytest.raises(UpcycleError, match="more than a pair file may hold .* decompressed"):
        read_text_pairs(bomb)
    with gzip.open(bomb, "wb") as f:           # one endless line: refused at the line's bound
        f.write(b" " * 10 * 2**20)
    with pytest.raises(UpcycleError, match="bomb.jsonl.gz:1: the line is longer than"):
        read_text_pairs(bomb)
    (tmp_path / "ok.jsonl.gz").write_bytes(gzip.compress(b'{"query": "a", "document": "b"}\n'))
    assert read_text_pairs(tmp_path / "ok.jsonl.gz") == TextPairs(["a"], ["b"], ["pairs"], ["b"])


def test_a_sequence_length_that_cannot_hold_a_text_is_refused(encoder_pair, tmp_path):
    """The tokenizer cannot cut a text below its special tokens: at sequence length 1 it left every text whole, so a
    run trained on full-length texts while its config said 1. Training and evaluation refuse such a length (one
    line, before anything is written); the least that holds one token of text trains."""
    from upcycle.checkpoint.loading import load_model
    from upcycle.config import TrainConfig
    from upcycle.config_reader import build
    from upcycle.tasks.contrastive import evaluate_encoder
    from upcycle.training.trainer import train

    _, moe, data = encoder_pair
    base = {"model": str(moe), "data": str(data), "steps": 1, "batch_size": 4, "eval_pairs": 4}
    for length in (1, 2):
        with pytest.raises(UpcycleError, match=f"sequence_length {length} cannot hold a text"):
            train(build(TrainConfig, base | {"sequence_length": length}), tmp_path / "run", progress=False)
        assert not (tmp_path / "run").exists()
    model, tok = load_model(str(moe))
    with pytest.raises(UpcycleError, match="cannot hold a text"):
        evaluate_encoder(model, tok, str(data), sequence_length=1, pairs=4)
    train(build(TrainConfig, base | {"sequence_length": 3}), tmp_path / "run", progress=False)


def test_a_batch_without_a_negative_is_refused_at_start_up_naming_its_step(encoder_pair, tmp_path):
    """The seeded order of every epoch is known before the first step: a run whose batch at step 16 of 40 has no
    negative pair is refused before anything is written (it was refused at that step, 15 steps in), naming the
    step the batch would have come at."""
    from upcycle.config import TrainConfig
    from upcycle.config_reader import build
    from upcycle.training.trainer import train

    _, moe, data = encoder_pair
    pairs = TextPairs([f"q{i}" for i in range(6)], ["the cat"] * 4 + ["a dog", "the bird"], ["s"] * 6,
                      [f"d{i}" for i in range(6)])
    path = tmp_path / "pairs.jsonl"
    write_pairs(path, pairs)
    expected = PairBatches(tokenizer(), pairs, 2, 0, 16).first_without_negative(40)
    assert expected is not None and expected > 0
    cfg = build(TrainConfig, {"model": str(moe), "data": str(path), "eval_data": str(data), "steps": 40,
                              "batch_size": 2, "sequence_length": 16, "eval_pairs": 4, "seed": 0})
    with pytest.raises(UpcycleError, match=rf"the training batch of step {expected + 1} of 40 has no negative pair"):
        train(cfg, tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()
