"""`upcycle analyze` on tiny models: an upcycle folder, its stock export (the same numbers), a training run's
checkpoints, the outputs (analysis.json, figures, a self-contained report.html) and the refusals."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path

import pytest
import torch

from upcycle import ConvertConfig, MoEConfig, TrainConfig, convert
from upcycle.analyze.run import AnalyzeOptions, analyze
from upcycle.analyze.target import resolve_target, select_checkpoints
from upcycle.cli import main
from upcycle.config import CheckConfig
from upcycle.errors import UpcycleError
from upcycle.export.from_folder import export_folder
from upcycle.training.trainer import train


def _options(train_txt: Path, held: Path, **kw) -> AnalyzeOptions:
    base = dict(sources=(f"toy={train_txt}", f"held={held}"), tokens=192, sequence_length=32, output_tokens=64,
                shuffles=5)
    return AnalyzeOptions(**{**base, **kw})


def _drop_folder(tiny_lm, tmp_path_factory) -> Path:
    dense, _, _, held = tiny_lm
    out = tmp_path_factory.mktemp("drop") / "moe"
    convert(ConvertConfig(model=str(dense), method="drop", moe=MoEConfig(num_experts=4, top_k=2),
                          check=CheckConfig(text=str(held))), out, progress=False)
    return out


@pytest.fixture(scope="module")
def drop_moe(tiny_lm, tmp_path_factory) -> Path:
    return _drop_folder(tiny_lm, tmp_path_factory)


def test_analyze_an_upcycle_folder_writes_json_figures_and_a_self_contained_report(tiny_lm, tmp_path):
    dense, moe, train_txt, held = tiny_lm
    result = analyze(str(moe), str(tmp_path / "a"), _options(train_txt, held), progress=False)
    out = tmp_path / "a"
    assert json.loads((out / "analysis.json").read_text()) == json.loads(json.dumps(result))
    assert result["target"] == {"path": str(moe), "kind": "upcycle", "dense": str(dense), "dense_from": "recorded",
                                "notes": []}
    assert [s["name"] for s in result["inputs"]["sources"]] == ["toy", "held"]
    assert all(s["tokens"] == 192 for s in result["inputs"]["sources"])
    (snapshot,) = result["snapshots"]
    assert len(snapshot["layers"]) == 4                           # every block of the tiny Llama is MoE
    for m in snapshot["layers"].values():
        # copy-upcycled: identical experts, so similarity 1 everywhere and diversity 0
        assert m["weight_similarity"]["down"]["mean"] == pytest.approx(1.0, abs=1e-6)
        assert m["output_similarity"]["mean"] == pytest.approx(1.0, abs=1e-6)
        assert m["diversity"] == pytest.approx(0.0, abs=1e-6)
        assert m["tokens"] == 384 and m["specialization"]["sources"] == ["toy", "held"]
    # copy preserves the dense function: KL to the recorded dense source is rounding noise
    assert snapshot["kl_to_dense"]["all"] < 1e-8 and set(snapshot["kl_to_dense"]["per_source"]) == {"toy", "held"}
    html = (out / "report.html").read_text()
    images = re.findall(r'<img [^>]*src="([^"]*)"', html)
    assert len(images) == len(list(out.glob("*.png"))) >= 5
    for src in images:
        assert src.startswith("data:image/png;base64,")
        assert base64.b64decode(src.split(",", 1)[1])[:8] == b"\x89PNG\r\n\x1a\n"
    assert "<script" not in html.lower() and not re.search(r"(src|href)=\"(?!data:|#)", html)
    assert "http://" not in html and "https://" not in html


def test_a_stock_export_gives_the_numbers_of_the_upcycle_folder(tiny_lm, drop_moe, tmp_path):
    _, _, train_txt, held = tiny_lm
    export_folder(drop_moe, tmp_path / "hf")
    options = _options(train_txt, held)
    ours = analyze(str(drop_moe), str(tmp_path / "a"), options, progress=False)["snapshots"][0]
    stock = analyze(str(tmp_path / "hf"), str(tmp_path / "b"), options, progress=False)
    assert stock["target"]["kind"] == "stock" and stock["target"]["dense"] is not None
    stock = stock["snapshots"][0]
    assert list(stock["layers"]) == list(ours["layers"])
    for name, m in ours["layers"].items():
        s = stock["layers"][name]
        for proj in ("gate", "up", "down"):
            assert torch.tensor(s["weight_similarity"][proj]["matrix"]) == pytest.approx(
                torch.tensor(m["weight_similarity"][proj]["matrix"]), abs=1e-6)
        assert m["weight_similarity"]["down"]["mean"] < 0.99               # drop made the experts differ
        assert s["routing_entropy"] == pytest.approx(m["routing_entropy"], abs=1e-5)
        assert s["router_load"] == pytest.approx(m["router_load"], abs=0.01)
        assert s["specialization"]["nmi"] == pytest.approx(m["specialization"]["nmi"], abs=0.02)
    assert stock["kl_to_dense"]["all"] == pytest.approx(ours["kl_to_dense"]["all"], rel=1e-3, abs=1e-7)


@pytest.mark.slow      # over 15 s on 2 cores (tests/durations.json): the slow tier
def test_a_training_run_is_analyzed_at_every_checkpoint(tiny_lm, tmp_path):
    _, moe, train_txt, held = tiny_lm
    train(TrainConfig(model=str(moe), data=str(train_txt), eval_data=str(held), steps=4, batch_size=4,
                      sequence_length=16, lr=3e-3, checkpoint_every=2, keep_checkpoints=10, eval_every=0,
                      eval_tokens=64), tmp_path / "run", progress=False)
    result = analyze(str(tmp_path / "run"), str(tmp_path / "a"), _options(train_txt, held), progress=False)
    assert result["target"]["kind"] == "run"
    assert [(s["label"], s["step"]) for s in result["snapshots"]] == [("step 0 (init)", 0), ("step 2", 2),
                                                                     ("step 4", 4)]
    assert (tmp_path / "a" / "steps.png").is_file()
    assert "Over training" in (tmp_path / "a" / "report.html").read_text()
    # step 0 is the upcycled input itself: the same numbers as analyzing that folder
    alone = analyze(str(moe), str(tmp_path / "b"), _options(train_txt, held), progress=False)["snapshots"][0]
    assert result["snapshots"][0]["layers"] == alone["layers"]
    assert result["snapshots"][2]["layers"] != alone["layers"]           # training moved the router
    every = resolve_target(str(tmp_path / "run"), "every:4")
    assert [s.label for s in every.snapshots] == ["step 0 (init)", "step 4"]
    assert [s.label for s in resolve_target(str(tmp_path / "run"), "last").snapshots] == ["step 4"]


def test_checkpoint_selection_rules():
    found = [Path(f"step-{n:07d}") for n in (5, 10, 15, 20, 23)]
    assert select_checkpoints(found, "all") == found
    assert select_checkpoints(found, "last") == found[-1:]
    assert [p.name for p in select_checkpoints(found, "every:10")] == ["step-0000010", "step-0000020",
                                                                       "step-0000023"]
    for bad in ("every:0", "every", "some", "every:x"):
        with pytest.raises(UpcycleError, match="--checkpoints"):
            select_checkpoints(found, bad)


def test_refusals_come_before_anything_is_written(tiny_lm, tmp_path):
    dense, moe, train_txt, held = tiny_lm
    with pytest.raises(UpcycleError, match="dense model has no experts"):
        analyze(str(dense), str(tmp_path / "x"), _options(train_txt, held), progress=False)
    with pytest.raises(UpcycleError, match="is not a folder"):
        analyze(str(tmp_path / "missing"), str(tmp_path / "x"), _options(train_txt, held), progress=False)
    with pytest.raises(UpcycleError, match="names must differ"):
        analyze(str(moe), str(tmp_path / "x"), _options(train_txt, held, sources=(f"a={train_txt}", f"a={held}")),
                progress=False)
    with pytest.raises(UpcycleError, match="no.txt: no such file"):
        analyze(str(moe), str(tmp_path / "x"), _options(train_txt, held, data=(str(tmp_path / "no.txt"),)),
                progress=False)
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "keep").write_text("mine")
    with pytest.raises(UpcycleError, match="exists"):
        analyze(str(moe), str(tmp_path / "x"), _options(train_txt, held), progress=False)
    with pytest.raises(UpcycleError, match="input"):
        analyze(str(moe), str(moe.parent), _options(train_txt, held), overwrite=True, progress=False)
    assert (tmp_path / "x" / "keep").read_text() == "mine"


def test_cli_analyze_with_data_files_and_an_explicit_dense_model(tiny_lm, tmp_path, capsys):
    dense, moe, train_txt, held = tiny_lm
    argv = ["analyze", str(moe), str(tmp_path / "a"), "--data", str(train_txt), "--data", str(held), "--tokens",
            "128", "--sequence-length", "32", "--output-tokens", "32", "--dense", str(dense), "--quiet"]
    assert main(argv) == 0
    assert "report.html" in capsys.readouterr().out
    result = json.loads((tmp_path / "a" / "analysis.json").read_text())
    assert [s["name"] for s in result["inputs"]["sources"]] == ["train", "held"]
    assert result["target"]["dense_from"] == "--dense" and result["inputs"]["command"] == "upcycle " + " ".join(argv)
    assert main(argv) == 2 and "exists" in capsys.readouterr().err                      # OUT exists


def test_a_recorded_dense_source_that_is_gone_skips_the_kl_with_a_note(tiny_lm, tmp_path):
    import shutil

    _, moe, train_txt, held = tiny_lm
    moved = tmp_path / "moe"
    shutil.copytree(moe, moved)
    report = json.loads((moved / "upcycle_report.json").read_text())
    report["source_model"] = report["source_path"] = str(tmp_path / "gone")
    (moved / "upcycle_report.json").write_text(json.dumps(report))
    result = analyze(str(moved), str(tmp_path / "a"), _options(train_txt, held), progress=False)
    assert result["target"]["dense"] is None and result["snapshots"][0]["kl_to_dense"] is None
    assert "does not load" in result["target"]["notes"][0]
    with pytest.raises(UpcycleError, match="gone"):          # named on the command line: an error, before any work
        analyze(str(moved), str(tmp_path / "b"), _options(train_txt, held, dense=str(tmp_path / "gone")),
                progress=False)
    assert not (tmp_path / "b").exists()
    # --dense given an MoE folder: the message is about --dense, not about convert
    with pytest.raises(UpcycleError, match="--dense takes the dense model") as refused:
        analyze(str(moved), str(tmp_path / "b"), _options(train_txt, held, dense=str(moe)), progress=False)
    assert "convert takes" not in str(refused.value)
