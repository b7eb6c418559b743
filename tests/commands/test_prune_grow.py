"""`upcycle prune` and `upcycle grow` on an upcycle folder, end to end: the new folder loads with its new expert
count, its report says what was removed or copied and the KL to the source; pruning to E changes no logit; every
impossible request is refused before OUT is claimed."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys

import pytest
import torch
import transformers

import upcycle
from upcycle.cli import main
from upcycle.core.moe import moe_layers


def _flags(train) -> list[str]:
    return ["--calibration", str(train), "--calibration-tokens", "256", "--quiet"]


def _logits(folder, ids):
    model = upcycle.load(str(folder)).eval()
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits


def _stock_logits_without_upcycle(folder, ids: torch.Tensor, tmp_path) -> torch.Tensor:
    """The logits transformers' Auto class computes for `folder`, in an isolated interpreter (`python -I`, run
    from tmp_path) that never imports upcycle: what a user without upcycle gets from the folder."""
    code = ("import json, sys, torch, transformers\n"
            "model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).eval()\n"
            "ids = torch.tensor(json.loads(sys.argv[2]))\n"
            "with torch.no_grad():\n"
            "    logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits\n"
            "assert 'upcycle' not in sys.modules\n"
            "torch.save(logits, sys.argv[3])\n")
    done = subprocess.run([sys.executable, "-I", "-c", code, str(folder), json.dumps(ids.tolist()),
                           str(tmp_path / "logits.pt")], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    return torch.load(tmp_path / "logits.pt", weights_only=True)


def test_prune_writes_a_folder_with_fewer_experts_and_says_what_went(tiny_lm, tmp_path):
    _, moe, train, _ = tiny_lm
    out = tmp_path / "pruned"
    assert main(["prune", str(moe), str(out), "--num-experts", "3", *_flags(train)]) == 0
    report = json.loads((out / "resize_report.json").read_text())
    model = upcycle.load(str(out))
    layers = moe_layers(model)
    assert layers and all(layer.num_experts == 3 and layer.top_k == 2 for layer in layers.values())
    assert set(report["layers"]) == set(layers)
    assert all(len(r["removed"]) == 1 and len(r["saliency"]) == 4 for r in report["layers"].values())
    assert report["kind"] == "prune" and report["request"]["by"] == "reap" and report["function_preserving"] is False
    assert report["kl_to_source"] is not None and report["kl_to_source"] >= 0
    assert report["calibration"]["tokens"] >= 256



@pytest.mark.parametrize("streaming", [False, True])
def test_prune_shows_each_phase_unless_quiet_and_always_says_what_it_wrote(tiny_lm, tmp_path, capsys, streaming):
    _, moe, train, _ = tiny_lm
    flags = [f for f in _flags(train) if f != "--quiet"] + ["--streaming"] * streaming
    assert main(["prune", str(moe), str(tmp_path / "shown"), "--num-experts", "3", *flags]) == 0
    said = capsys.readouterr()
    phases = 7 if streaming else 5
    assert f"{phases}/{phases}" in said.err and f"written to {tmp_path / 'shown'}" in said.err
    assert "calibration text read" in said.err and "compared with the source" not in said.out
    assert json.loads(said.out.splitlines()[0])["kind"] == "prune"
    assert main(["prune", str(moe), str(tmp_path / "quiet"), "--num-experts", "3", *flags, "--quiet"]) == 0
    said = capsys.readouterr()
    assert "upcycle prune" not in said.err and "phase" not in said.err
    assert json.loads(said.out.splitlines()[0])["kind"] == "prune" and "wrote" in said.out.splitlines()[1]

def test_pruning_to_every_expert_writes_the_same_function(tiny_lm, tmp_path):
    _, moe, train, _ = tiny_lm
    out = tmp_path / "same"
    assert main(["prune", str(moe), str(out), "--num-experts", "4", "--by", "frequency", *_flags(train)]) == 0
    ids = torch.randint(3, 60, (2, 12), generator=torch.Generator().manual_seed(0))
    assert torch.equal(_logits(out, ids), _logits(moe, ids))
    report = json.loads((out / "resize_report.json").read_text())
    assert report["function_preserving"] is True and report["kl_to_source"] == pytest.approx(0, abs=1e-9)
    # held-out perplexity on the report's probe, before and after, is what `upcycle eval`'s function computes
    from upcycle.resize.run import held_out_probe
    from upcycle.tasks.evaluate import perplexity

    source = upcycle.load(str(moe))
    probe = held_out_probe(source, transformers.AutoTokenizer.from_pretrained(moe), 0)
    expected = perplexity(source, probe.inputs["input_ids"], probe.inputs["attention_mask"])["perplexity"]
    assert report["held_out_perplexity"]["before"] == pytest.approx(expected, rel=1e-5)
    assert report["held_out_perplexity"]["after"] == pytest.approx(expected, rel=1e-5)


def test_grow_adds_copies_and_says_it_is_not_function_preserving(tiny_lm, tmp_path):
    _, moe, train, _ = tiny_lm
    out = tmp_path / "grown"
    assert main(["grow", str(moe), str(out), "--num-experts", "6", "--by", "utility", "--perturb", "drop",
                 *_flags(train)]) == 0
    report = json.loads((out / "resize_report.json").read_text())
    assert report["request"]["perturb"] == "drop" and all(r["perturbed"] == "drop" for r in report["layers"].values())
    assert all(layer.num_experts == 6 for layer in moe_layers(upcycle.load(str(out))).values())
    assert all(len(r["copied"]) == 2 and len(set(r["copied"])) == 2 for r in report["layers"].values())
    assert report["kind"] == "grow" and report["function_preserving"] is False


@pytest.mark.parametrize(("command", "n", "said"), [
    ("prune", "1", "keeps at least 2 experts"), ("prune", "5", "use grow"), ("grow", "3", "use prune")])
def test_an_impossible_count_is_refused_before_out_is_claimed(tiny_lm, tmp_path, capsys, command, n, said):
    _, moe, train, _ = tiny_lm
    out = tmp_path / "out"
    assert main([command, str(moe), str(out), "--num-experts", n, *_flags(train)]) == 2
    assert said in capsys.readouterr().err and not out.exists()


def test_a_dense_model_is_refused_before_out_is_claimed(tiny_lm, tmp_path, capsys):
    dense, _, train, _ = tiny_lm
    assert main(["prune", str(dense), str(tmp_path / "out"), "--num-experts", "2", *_flags(train)]) == 2
    assert "is not an MoE folder" in capsys.readouterr().err and not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", ["prune", "grow"])
def test_a_training_run_folder_or_a_missing_one_is_refused_naming_what_to_pass(tiny_lm, tmp_path, capsys, command):
    import shutil

    _, moe, train, _ = tiny_lm
    run = tmp_path / "run"
    shutil.copytree(moe, run / "model")
    out = tmp_path / "out"
    assert main([command, str(run), str(out), "--num-experts", "5" if command == "grow" else "3", *_flags(train)]) == 2
    assert f"pass its model, {run / 'model'}" in capsys.readouterr().err and not out.exists()
    assert main([command, str(tmp_path / "nowhere"), str(out), "--num-experts", "3", *_flags(train)]) == 2
    assert "does not exist" in capsys.readouterr().err and not out.exists()


@pytest.mark.slow      # over 15 s on 2 cores (tests/durations.json): the slow tier
@pytest.mark.parametrize("export_class", ["mixtral", "qwen2_moe"])
def test_a_pruned_stock_folder_stays_its_class_and_computes_what_the_pruned_upcycle_folder_computes(
        tiny_lm, tmp_path, export_class):
    """The stock export of the upcycle folder, pruned, is the stock class again with the new count in its config;
    transformers loads it in a process that never imports upcycle, and its logits are those of the upcycle folder
    pruned the same way (the same experts removed: the routing and the experts are the same)."""

    _, moe, train, _ = tiny_lm
    stock, pruned_stock, pruned = tmp_path / "stock", tmp_path / "pruned-stock", tmp_path / "pruned"
    assert main(["export", str(moe), str(stock), "--export-class", export_class]) == 0
    flags = ["--num-experts", "3", "--by", "frequency", *_flags(train)]
    assert main(["prune", str(stock), str(pruned_stock), *flags]) == 0
    assert main(["prune", str(moe), str(pruned), *flags]) == 0
    removed = json.loads((pruned / "resize_report.json").read_text())["layers"]
    removed_stock = json.loads((pruned_stock / "resize_report.json").read_text())["layers"]
    assert [r["removed"] for r in removed_stock.values()] == [r["removed"] for r in removed.values()]
    config = json.loads((pruned_stock / "config.json").read_text())
    assert config["model_type"] == export_class and 3 in (config.get("num_local_experts"), config.get("num_experts"))
    ids = torch.randint(3, 60, (2, 12), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(_stock_logits_without_upcycle(pruned_stock, ids, tmp_path), _logits(pruned, ids),
                               atol=1e-4, rtol=1e-4)


@pytest.mark.slow      # over 15 s on 2 cores (tests/durations.json): the slow tier
def test_a_stock_folder_cannot_grow_but_its_upcycle_folder_grows_and_exports(tiny_lm, tmp_path, capsys):
    """The refusal says what works: grow the upcycle folder, then export the grown one; the grown folder (copies
    with their sources' logits, no router bias) exports to Mixtral, which transformers loads without upcycle and
    computes what upcycle's grown model computes."""
    _, moe, train, _ = tiny_lm
    assert main(["export", str(moe), str(tmp_path / "stock"), "--export-class", "mixtral"]) == 0
    assert main(["grow", str(tmp_path / "stock"), str(tmp_path / "out"), "--num-experts", "6", *_flags(train)]) == 2
    err = capsys.readouterr().err
    assert "grow the upcycle folder the stock one was exported from, then export the grown folder" in err
    assert not (tmp_path / "out").exists()
    grown, stock = tmp_path / "grown", tmp_path / "grown-stock"
    assert main(["grow", str(moe), str(grown), "--num-experts", "6", *_flags(train)]) == 0
    assert main(["export", str(grown), str(stock), "--export-class", "mixtral"]) == 0
    ids = torch.randint(3, 60, (2, 12), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(_stock_logits_without_upcycle(stock, ids, tmp_path), _logits(grown, ids),
                               atol=1e-4, rtol=1e-4)


def _trained(moe, train, held, tmp_path):
    """The MoE folder `moe` after 8 training steps at a high learning rate (routers moved off their init)."""
    run = tmp_path / "trained"
    assert main(["train", str(moe), str(run), "--data", str(train), "--eval-data", str(held), "--steps", "8",
                 "--batch-size", "4", "--sequence-length", "32", "--quiet", "--set", "eval_tokens=64",
                 "--set", "lr=0.01", "--set", "warmup=0"]) == 0
    return run / "model"


@pytest.mark.parametrize("source", ["noise top-1", "trained"])
@pytest.mark.parametrize(("n", "by", "streaming"), [("6", "utility", False), ("12", "uniform", False),
                                                    ("6", "utility", True)])
def test_every_grown_copy_is_reached_on_the_probe_and_the_report_gives_each_load(tiny_lm, tmp_path, source, n, by,
                                                                               streaming):
    """The report gives each layer's per-expert load on the probe through the source and the grown model, and
    every copy of an expert holding a fifth of the probe's slots takes tokens (copies whose logits were shifted by
    -log n took none:
    [256, 256, 0, 0, 0, 0]), for a freshly converted top-1 model and for it trained, calibrated on text of the
    probe's kind (the embedded Wikipedia); the slots the probe fills are the same before and after (top-k is
    fixed), and the warnings name exactly the layers with a copy no token reached (copies of experts the probe
    hardly reaches, or whose few tokens a dominant expert's copies took: the tiny random model routes most tokens
    to one expert, its logits nearly tied)."""
    dense, _, train, held = tiny_lm
    folder = tmp_path / "source"
    assert main(["convert", str(dense), str(folder), "--method", "noise", "--num-experts", "4", "--top-k", "1",
                 "--quiet"]) == 0
    if source == "trained":
        folder = _trained(folder, train, held, tmp_path)
    out = tmp_path / "grown"
    assert main(["grow", str(folder), str(out), "--num-experts", n, "--by", by, "--calibration-tokens", "2048",
                 "--quiet", *["--streaming"] * streaming]) == 0
    report = json.loads((out / "resize_report.json").read_text())
    silent = []
    for name, layer in report["layers"].items():
        before, after = layer["load_before"], layer["load_after"]
        assert len(before) == 4 and len(after) == int(n) and sum(before) == sum(after) > 0, name
        for c, e in enumerate(layer["copied"], start=4):
            # an expert the probe reaches, copied once: its copy is reached too (split three ways, the few tokens
            # of a tiny model's minor expert may leave one member empty: the warning below says so)
            if before[e] >= 0.2 * sum(before) and layer["copied"].count(e) == 1:
                assert after[c] > 0, (name, e, before, after)
        if any(after[c] == 0 for c in range(4, int(n))):
            silent.append(name)
    assert [w.split(":")[0] for w in report["warnings"]] == silent


def test_a_copy_no_token_reaches_is_warned_of(tiny_lm, tmp_path, capsys):
    """An expert switched off by its selection bias, copied: its copy is switched off too, and the command says
    so on stderr and in the report's warnings (and still writes the folder it was asked for)."""
    from safetensors.torch import load_file, save_file

    _, moe, train, _ = tiny_lm
    off = tmp_path / "off"
    shutil.copytree(moe, off)
    tensors = load_file(off / "model.safetensors")
    for name in [k for k in tensors if k.endswith("selection_bias")]:
        tensors[name][0] = -1e4
    save_file(tensors, off / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "grown"
    capsys.readouterr()
    assert main(["grow", str(off), str(out), "--num-experts", "8", "--by", "uniform", *_flags(train)]) == 0
    err = capsys.readouterr().err
    report = json.loads((out / "resize_report.json").read_text())
    assert len(report["warnings"]) == len(report["layers"]) > 0
    assert "WARNING" in err and "no token of the probe reaches the copies [4] (of [0])" in err
    assert all(layer["load_after"][0] == layer["load_after"][4] == 0 for layer in report["layers"].values())


def test_add_makes_one_expert_per_layer_from_another_fine_tune(tiny_lm, tmp_path):
    """The new expert of each layer is the fine-tune's FFN of that block, exactly; its router row is the centroid
    of the layer's inputs on the fine-tune's text, on the scale of the other rows; the rest is the model's."""
    from conftest import fine_tune
    from upcycle.core.architectures import family_of

    dense, moe, train, held = tiny_lm
    tuned = fine_tune(dense, tmp_path / "tuned", seed=5)
    out = tmp_path / "added"
    assert main(["grow", str(moe), str(out), "--add", str(tuned), "--calibration", str(held),
                 "--calibration-tokens", "256", "--quiet"]) == 0
    before, after = moe_layers(upcycle.load(str(moe))), moe_layers(upcycle.load(str(out)))
    report = json.loads((out / "resize_report.json").read_text())
    import transformers

    ft = transformers.AutoModelForCausalLM.from_pretrained(tuned, dtype=torch.float32)
    for name, layer in after.items():
        old = before[name]
        assert layer.num_experts == old.num_experts + 1 and report["layers"][name]["added"] == old.num_experts
        block = name.rsplit(".", 1)[0]
        expected = family_of(ft.config).extract(ft.get_submodule(block), ft.config)
        added = layer.experts.weights().expert(old.num_experts)
        for key, t in expected.tensors().items():
            assert torch.equal(added.tensors()[key], t.detach()), (name, key)
        assert torch.equal(layer.router.weight[:-1], old.router.weight)
        norms = torch.linalg.vector_norm(old.router.weight.detach(), dim=-1)
        assert float(torch.linalg.vector_norm(layer.router.weight[-1].detach())) == pytest.approx(
            float(norms.mean()), rel=1e-5)
        assert 0 <= report["layers"][name]["top1_share_of_its_text"] <= 1
    assert report["request"]["add"] == str(tuned) and report["function_preserving"] is False


def test_add_refuses_a_fine_tune_of_another_base_or_tokenizer_before_out_is_claimed(tiny_lm, tmp_path, capsys):
    import transformers

    from conftest import fine_tune, make_tiny
    from upcycle.data.clip_pairs import caption_tokenizer

    dense, moe, train, held = tiny_lm
    other_words = fine_tune(dense, tmp_path / "other-words", seed=1)
    caption_tokenizer(["entirely", "other", "words"], max_length=64).save_pretrained(other_words)
    narrow = tmp_path / "narrow"
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**make_tiny("llama").config.to_dict(),
                                                               "intermediate_size": 48})).save_pretrained(narrow)
    for finetune, said in ((other_words, "does not share"), (narrow, "does not have the architecture")):
        out = tmp_path / "out"
        assert main(["grow", str(moe), str(out), "--add", str(finetune), "--calibration", str(held), "--quiet"]) == 2
        assert said in capsys.readouterr().err and not out.exists()
    assert main(["grow", str(moe), str(tmp_path / "out"), "--add", str(other_words), "--quiet"]) == 2
    assert "--calibration" in capsys.readouterr().err
    assert main(["grow", str(moe), str(tmp_path / "out"), "--add", str(other_words), "--num-experts", "6",
                 "--calibration", str(held), "--quiet"]) == 2
    assert "one of them" in capsys.readouterr().err and not (tmp_path / "out").exists()
    assert main(["grow", str(moe), str(tmp_path / "out"), "--add", str(other_words), "--perturb", "noise",
                 "--calibration", str(held), "--quiet"]) == 2
    assert "--perturb" in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_a_streamed_prune_writes_what_the_in_memory_prune_writes(tiny_lm, tmp_path):
    """--streaming scores each layer while its block is read for the calibration batch's forward, then copies the
    tensors one at a time: the same kept experts, the same tensors, the same report numbers."""
    from safetensors.torch import load_file

    _, moe, train, _ = tiny_lm
    flags = ["--num-experts", "3", "--by", "reap", "--calibration", str(train), "--calibration-tokens", "200",
             "--quiet"]
    assert main(["prune", str(moe), str(tmp_path / "memory"), *flags]) == 0
    assert main(["prune", str(moe), str(tmp_path / "streamed"), *flags, "--streaming"]) == 0
    memory, streamed = (load_file(tmp_path / f / "model.safetensors") for f in ("memory", "streamed"))
    assert memory.keys() == streamed.keys()
    assert all(torch.equal(memory[k], streamed[k]) for k in memory)
    a, b = (json.loads((tmp_path / f / "resize_report.json").read_text()) for f in ("memory", "streamed"))
    # the same experts kept; the scores from other batch shapes agree to rounding
    for name, layer in a["layers"].items():
        assert (layer["kept"], layer["removed"]) == (b["layers"][name]["kept"], b["layers"][name]["removed"])
        assert layer["saliency"] == pytest.approx(b["layers"][name]["saliency"], rel=1e-4, abs=1e-9)
    assert a["kl_to_source"] == pytest.approx(b["kl_to_source"], rel=1e-3, abs=1e-9)
    assert b["calibration"]["streamed"] is True
    ids = torch.randint(3, 60, (2, 12), generator=torch.Generator().manual_seed(1))
    assert torch.equal(_logits(tmp_path / "memory", ids), _logits(tmp_path / "streamed", ids))



@pytest.mark.parametrize(("by", "perturb"), [("utility", "noise"), ("uniform", "drop"), ("utility", "none")])
def test_a_streamed_grow_writes_what_the_in_memory_grow_writes(tiny_lm, tmp_path, by, perturb):
    """--streaming grows layer by layer from the folder's tensors: the same copies, no router bias made, the same
    perturbation draws, router rows equal to rounding, so the same tensors and logits (to rounding) as the
    in-memory grow, once and again when the grown folder grows once more."""
    from safetensors.torch import load_file

    _, moe, train, _ = tiny_lm
    flags = ["--by", by, "--perturb", perturb, "--calibration", str(train), "--calibration-tokens", "200", "--quiet"]
    for source, n, tag in ((moe, "6", "a"), (None, "7", "b")):
        for how in ("memory", "streamed"):
            given = source or tmp_path / f"a-{how}"
            assert main(["grow", str(given), str(tmp_path / f"{tag}-{how}"), "--num-experts", n, *flags,
                         *(["--streaming"] if how == "streamed" else [])]) == 0
        memory, streamed = (load_file(tmp_path / f"{tag}-{how}" / "model.safetensors")
                            for how in ("memory", "streamed"))
        assert memory.keys() == streamed.keys() and not any(k.endswith("router.bias") for k in memory)
        # the copies' router rows come from the calibration forward, run in batches of 8 rows in memory and in one
        # batch streamed: equal to rounding; every other tensor bit for bit
        rows = [k for k in memory if k.endswith("router.weight")]
        assert all(torch.equal(memory[k], streamed[k]) for k in memory if k not in rows), \
            [k for k in memory if not torch.equal(memory[k], streamed[k])]
        for k in rows:
            torch.testing.assert_close(memory[k], streamed[k], atol=1e-5, rtol=1e-4)
        a, b = (json.loads((tmp_path / f"{tag}-{how}" / "resize_report.json").read_text())
                for how in ("memory", "streamed"))
        assert [r["copied"] for r in a["layers"].values()] == [r["copied"] for r in b["layers"].values()]
        assert a["kl_to_source"] == pytest.approx(b["kl_to_source"], rel=1e-3, abs=1e-9)
        assert (tmp_path / f"{tag}-streamed" / "upcycle_config.json").read_text() == \
            (tmp_path / f"{tag}-memory" / "upcycle_config.json").read_text()
    ids = torch.randint(3, 60, (2, 12), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(_logits(tmp_path / "b-memory", ids), _logits(tmp_path / "b-streamed", ids),
                               atol=1e-4, rtol=1e-4)



@pytest.mark.parametrize(("command", "n"), [("prune", "3"), ("grow", "6")])
def test_a_streamed_resize_keeps_the_shared_expert_as_the_in_memory_one_does(tiny_lm, tmp_path, command, n):
    """SPRI's layers have a shared expert beside the routed ones: streamed or not, it is written unchanged and the
    routed experts are resized alike."""
    from safetensors.torch import load_file

    dense, _, train, _ = tiny_lm
    spri = tmp_path / "spri"
    assert main(["convert", str(dense), str(spri), "--method", "spri", "--num-experts", "4", "--top-k", "2",
                 "--quiet"]) == 0
    for how in ("memory", "streamed"):
        assert main([command, str(spri), str(tmp_path / how), "--num-experts", n, *_flags(train),
                     *(["--streaming"] if how == "streamed" else [])]) == 0
    source, memory, streamed = (load_file(tmp_path / f / "model.safetensors") for f in ("spri", "memory", "streamed"))
    shared = [k for k in source if ".shared_experts." in k]
    assert shared and all(torch.equal(memory[k], source[k]) and torch.equal(streamed[k], source[k]) for k in shared)
    # a grown copy's router row comes from a forward of another batch shape: equal to rounding
    rows = [k for k in memory if k.endswith("router.weight")] if command == "grow" else []
    assert memory.keys() == streamed.keys() and all(torch.equal(memory[k], streamed[k]) for k in memory
                                                    if k not in rows)
    for k in rows:
        torch.testing.assert_close(memory[k], streamed[k], atol=1e-5, rtol=1e-4)
    assert all(memory[k].shape[0] == int(n) for k in memory if k.endswith(".experts.w_down"))


def _tensor_bytes_and_count(folder) -> tuple[int, int]:
    from upcycle.checkpoint.reader import CheckpointReader

    reader = CheckpointReader(folder, check_values=False)
    sizes = [(math.prod(reader.shape(n)), torch.empty((), dtype=reader.dtype(n)).element_size())
             for n in reader.names()]
    return sum(c * b for c, b in sizes), sum(c for c, _ in sizes)


@pytest.mark.parametrize(("command", "n", "stock"), [("prune", "3", False), ("grow", "6", False),
                                                     ("prune", "2", True)])
def test_dry_run_writes_nothing_and_plans_the_sizes_the_command_then_writes(tiny_lm, tmp_path, capsys, command, n,
                                                                             stock):
    """The plan's parameters and bytes after are those of the folder the command then writes, exactly (a grow
    of a folder without a router bias gains one); before, those of the source."""
    _, moe, train, _ = tiny_lm
    source = moe
    if stock:
        source = tmp_path / "stock"
        assert main(["export", str(moe), str(source), "--export-class", "qwen2_moe"]) == 0
    out = tmp_path / "out"
    capsys.readouterr()
    assert main([command, str(source), str(out), "--num-experts", n, *_flags(train), "--dry-run"]) == 0
    said = capsys.readouterr().out
    assert not out.exists() and f"{command} plan for {source}" in said and f"4 -> {n}" in said
    plan = {line.split()[0]: line.split() for line in said.splitlines()[1:]}
    assert main([command, str(source), str(out), "--num-experts", n, *_flags(train)]) == 0
    (b0, p0), (b1, p1) = _tensor_bytes_and_count(source), _tensor_bytes_and_count(out)
    assert plan["parameters"][1] == f"{p0 / 1e9:.3f}" and plan["parameters"][4] == f"{p1 / 1e9:.3f}"
    from upcycle.resize.expert_count import ExpertCount
    from upcycle.resize.plan import plan_resize

    exact = plan_resize(str(source), ExpertCount(int(n), "reap" if command == "prune" else "utility"),
                        grow=command == "grow", streaming=False)
    assert exact.parameters == (p0, p1) and exact.bytes_on_disk == (b0, b1) and p1 != p0


def test_dry_run_refuses_what_the_command_would_refuse(tiny_lm, tmp_path, capsys):
    dense, moe, train, _ = tiny_lm
    assert main(["prune", str(moe), str(tmp_path / "out"), "--num-experts", "1", *_flags(train), "--dry-run"]) == 2
    assert "keeps at least 2 experts" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_an_added_expert_is_planned_by_its_dry_run(tiny_lm, tmp_path, capsys):
    """grow --add plans one more expert per layer (the fine-tune's), as it then writes."""
    dense, moe, train, _ = tiny_lm
    out = tmp_path / "out"
    assert main(["grow", str(moe), str(out), "--add", str(dense), "--calibration", str(train), "--dry-run"]) == 0
    said = capsys.readouterr().out
    assert f"grow plan for {moe} (--add {dense})" in said and "experts 4 -> 5" in said and not out.exists()
    assert main(["grow", str(moe), str(out), "--add", str(dense), "--calibration", str(train)]) == 0
    written = json.loads((out / "upcycle_config.json").read_text())["layers"]
    assert written and all(layer["num_experts"] == 5 for layer in written)

def test_streaming_refuses_add_and_stock_folders_before_out_is_claimed(tiny_lm, tmp_path, capsys):
    dense, moe, train, _ = tiny_lm
    out = tmp_path / "out"
    assert main(["grow", str(moe), str(out), "--add", str(dense), "--calibration", str(train), "--streaming",
                 "--quiet"]) == 2
    assert "adding and stock folders run in memory" in capsys.readouterr().err and not out.exists()
    stock = tmp_path / "stock"
    assert main(["export", str(moe), str(stock), "--export-class", "mixtral"]) == 0
    assert main(["prune", str(stock), str(out), "--num-experts", "3", *_flags(train), "--streaming"]) == 2
    assert "adding and stock folders run in memory" in capsys.readouterr().err and not out.exists()

PEAK = """
import sys, threading, time
from upcycle.checkpoint.heap import anonymous_resident_bytes as anon
from upcycle.cli import main
import upcycle.resize.run, upcycle.resize.streamed, upcycle.checkpoint.upcycle_format   # imported before measuring
import transformers
transformers.LlamaForCausalLM(transformers.LlamaConfig(vocab_size=8, hidden_size=8, intermediate_size=8,
                              num_hidden_layers=1, num_attention_heads=2))   # the class's first-use costs, too
base, peak, done = anon(), [0], []
def watch():
    while not done:
        peak[0] = max(peak[0], anon() - base)
        time.sleep(0.002)
threading.Thread(target=watch, daemon=True).start()
code = main(sys.argv[1:])
done.append(1)
time.sleep(0.01)
print(code, peak[0])
"""


def _peak(argv: list[str], cwd) -> tuple[int, int]:
    import os
    from pathlib import Path

    # glibc's malloc raises its mmap threshold as large blocks are freed (up to 32 MB), after which freed tensors
    # stay in the heap as resident memory, more or less of it by the order of frees: the same streamed grow then
    # measured 80, 110 or 137 MB from run to run. A fixed threshold returns every freed block of 64 KiB or more, so
    # the figure is what the command holds (grow: 80-84 MB in each of 7 runs, prune 44-45 MB).
    env = os.environ | {"PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src"), "OMP_NUM_THREADS": "1",
                        "MALLOC_ARENA_MAX": "1", "MALLOC_MMAP_THRESHOLD_": "65536"}
    done = subprocess.run([sys.executable, "-c", PEAK, *argv], capture_output=True, text=True, timeout=600, cwd=cwd,
                          env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    code, peak = map(int, done.stdout.split()[-2:])
    return code, peak


@pytest.mark.slow      # over 15 s on 2 cores (tests/durations.json): the slow tier
@pytest.mark.parametrize(("command", "n"), [("prune", "2"), ("grow", "6")])
def test_a_streamed_prune_or_grow_holds_far_less_than_the_model(tiny_lm, tmp_path, command, n):
    """A model of 4 MoE blocks whose tensors are ~200 MB: pruned or grown --streaming, the process's anonymous
    memory grows by well under half of that (one block and one tensor at a time); the in-memory prune or grow of
    the same folder holds more than the whole model. Measured in fresh interpreters, file-backed pages left out
    (a checkpoint read through mmap is not the heap)."""
    import shutil

    import transformers

    from upcycle.checkpoint.heap import anonymous_resident_bytes
    from upcycle.config import ConvertConfig, MoEConfig
    from upcycle.conversion.pipeline import upcycle_model

    if anonymous_resident_bytes() is None:
        pytest.skip("no /proc/self/statm here")
    dense, _, train, _ = tiny_lm
    tokenizer = transformers.AutoTokenizer.from_pretrained(dense)
    config = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=512, intermediate_size=2048,
                                      num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                                      max_position_embeddings=128, pad_token_id=tokenizer.pad_token_id,
                                      bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    upcycle_model(model, ConvertConfig(model="x", method="noise", moe=MoEConfig(num_experts=4, top_k=2)),
                  progress=False)
    folder = tmp_path / "big"
    upcycle.save(model, folder, tokenizer=tokenizer)
    weights = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    del model
    assert weights > 190 * 2**20
    flags = ["--num-experts", n, "--calibration", str(train), "--calibration-tokens", "128", "--quiet"]
    code, streamed = _peak([command, str(folder), str(tmp_path / "streamed"), *flags, "--streaming"], tmp_path)
    # pruning holds one block (measured 44-45 MB of 212); growing also makes a layer's largest grown tensor while the
    # source's is held (6/4 x 33.5 MB beside 33.5 MB here: measured 80-84 MB), about 2/5 of this 4-block model's
    # weights (of a 32-block model's, a twentieth)
    assert code == 0 and streamed < weights * (0.5 if command == "prune" else 0.6), (streamed, weights)
    code, whole = _peak([command, str(folder), str(tmp_path / "memory"), *flags], tmp_path)
    assert code == 0 and whole > weights, (whole, weights)
    shutil.rmtree(folder)


def _random_stock(kind: str, folder, tokenizer_from) -> None:
    """A random 2-block Qwen3-MoE or OLMoE of 4 experts, top-2 (not from an upcycle export), with the tiny
    tokenizer, saved to `folder`."""
    import shutil

    from upcycle.checkpoint.loading import TOKENIZER_FILES

    sizes = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64, num_experts=4, num_experts_per_tok=2,
                 bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(5)
    if kind == "qwen3_moe":
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**sizes, moe_intermediate_size=48,
                                                                             head_dim=8, norm_topk_prob=True))
    else:                   # OLMoE: top-k weights not renormalized (its default)
        model = transformers.OlmoeForCausalLM(transformers.OlmoeConfig(**sizes))
    model.save_pretrained(folder)
    for name in TOKENIZER_FILES:
        if (tokenizer_from / name).is_file():
            shutil.copy(tokenizer_from / name, folder / name)


@pytest.mark.parametrize("kind", ["qwen3_moe", "olmoe"])
def test_a_pruned_qwen3_moe_or_olmoe_folder_loads_without_upcycle_and_is_the_class_with_those_experts_cut(
        tiny_lm, tmp_path, kind):
    """A stock Qwen3-MoE / OLMoE folder pruned 4 -> 3 stays its class and loads in a process that never imports
    upcycle; its logits are those of the source model with, in every block, the report's kept experts' router
    rows and expert tensors taken by hand from its state dict (an independent reference: transformers' own class
    with the count set to 3)."""
    import copy

    _, moe, train, _ = tiny_lm
    source, pruned = tmp_path / "source", tmp_path / "pruned"
    _random_stock(kind, source, moe)
    assert main(["prune", str(source), str(pruned), "--num-experts", "3", "--by", "reap", *_flags(train)]) == 0
    report = json.loads((pruned / "resize_report.json").read_text())
    kept = {name: r["kept"] for name, r in report["layers"].items()}
    assert len(kept) == 2 and all(len(k) == 3 for k in kept.values())
    config = json.loads((pruned / "config.json").read_text())
    assert config["model_type"] == kind and config.get("num_experts", config.get("num_local_experts")) == 3

    original = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    state = original.state_dict()
    for name, keep in kept.items():                  # e.g. model.layers.0.mlp: its router and its experts
        index = torch.tensor(keep)
        for key in [k for k in state if k.startswith(f"{name}.gate.") or k.startswith(f"{name}.experts.")]:
            assert state[key].shape[0] == 4, key
            state[key] = state[key].index_select(0, index)
    config = copy.deepcopy(original.config)
    config.num_experts = 3                  # Qwen3-MoE maps it to num_local_experts
    expected = type(original)(config).eval()
    expected.load_state_dict(state, strict=True)

    ids = torch.randint(3, 60, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = expected(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    torch.testing.assert_close(_stock_logits_without_upcycle(pruned, ids, tmp_path), reference, atol=1e-5, rtol=1e-5)
    with torch.no_grad():            # and the cut is not the identity: the source computes otherwise
        assert not torch.allclose(original.eval()(input_ids=ids).logits, reference, atol=1e-3)


@pytest.mark.parametrize("command, flags", [("prune", ["--num-experts", "2"]), ("grow", ["--num-experts", "6"]),
                                            ("grow", ["--add", "{dense}"])])
def test_the_dry_run_prints_the_plan_the_resize_executes(tiny_lm, tmp_path, capsys, monkeypatch, command, flags):
    """prune and grow execute the very plan their dry run prints (`run.make_resize_plan`, then the runner): the
    plan the run hands to its executor is described by the same lines, and holds the same values."""
    from upcycle.resize import run as resize_run

    dense, moe, train, _ = tiny_lm
    flags = [f.replace("{dense}", str(dense)) for f in flags]
    out = tmp_path / "out"
    assert main([command, str(moe), str(out), *flags, *_flags(train), "--dry-run"]) == 0
    printed = capsys.readouterr().out.strip()
    executed = []
    real = resize_run.execute
    monkeypatch.setattr(resize_run, "execute", lambda plan, claim, progress=True: executed.append(plan) or
                        real(plan, claim, progress))
    assert main([command, str(moe), str(out), *flags, *_flags(train)]) == 0
    (plan,) = executed
    assert plan.describe() == printed and plan.kind == command
    written = json.loads((out / "upcycle_config.json").read_text())["layers"]
    assert [layer["num_experts"] for layer in written] == [after for _, after in plan.layers.values()]
