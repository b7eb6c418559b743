"""Hostile files and careless paths: no code from a model folder, no file read outside it, no random weights with
exit 0, an input's cache never an output, recorded paths that mean the same from anywhere (no input overwritten:
tests/test_overwrite.py). Every case runs the command in-process, as a user would type it, and checks the exit
status, the one-line message, and that every input is byte for byte what it was."""

from __future__ import annotations

import io
import json
import os
import shutil
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from conftest import digest, fails, fake_run, make_tiny
from upcycle.cli import main
from upcycle.errors import UpcycleError

QUIET = ["--quiet"]
TRAIN = ["--steps", "1", "--batch-size", "2", "--sequence-length", "16", "--set", "eval_tokens=32", "--quiet"]


# ---- case 1: eval --out never overwrites an input --------------------------------------------------------------


# ---- case 2: the embedded model's cache is an input, and verified -----------------------------------------------

def _fake_default_cache(cache: Path) -> Path:
    """A tiny Llama where the embedded SmolLM2 is cached, with the record upcycle writes with it."""
    from upcycle.data.assets import SMOLLM2_CACHE, record_cache

    folder = cache / SMOLLM2_CACHE
    make_tiny("llama").save_pretrained(folder)
    record_cache(folder)
    return folder


def test_default_is_an_input_its_cache_is_never_an_output(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("UPCYCLE_CACHE", str(tmp_path / "cache"))
    folder = _fake_default_cache(tmp_path / "cache")
    before = digest(folder)
    fails(capsys, ["convert", "default", str(folder), "--overwrite", *QUIET], "embedded model's cache")
    fails(capsys, ["convert", "default", str(folder / "moe"), *QUIET], "lies inside the embedded model's cache")
    fails(capsys, ["train", "default", str(folder), "--overwrite", *TRAIN], "embedded model's cache")
    fails(capsys, ["eval", "default", "--out", str(folder / "config.json"), "--overwrite"], "embedded model's cache")
    assert digest(folder) == before


def test_a_cache_that_no_longer_matches_its_record_is_built_again(tmp_path, monkeypatch):
    from upcycle.data import assets

    monkeypatch.setenv("UPCYCLE_CACHE", str(tmp_path / "cache"))
    folder = _fake_default_cache(tmp_path / "cache")
    assert assets.cache_is_intact(folder)
    built = []
    monkeypatch.setattr(assets, "plain_from_gguf", lambda *args: built.append(args) or folder)
    monkeypatch.setattr(assets, "smollm2_gguf_folder", lambda: tmp_path)
    assert assets.default_model_path() == folder and built == []          # intact: used as it is
    # a weight replaced, a file removed: each is found, and the cache rebuilt (a file added, not upcycle's, is
    # refused instead: tests/test_beside_outputs.py)
    for tamper in (lambda: (folder / "model.safetensors").write_bytes(b"x" * 100),
                   lambda: (folder / "config.json").unlink()):
        snapshot = tmp_path / "snapshot"
        shutil.copytree(folder, snapshot)
        tamper()
        assert not assets.cache_is_intact(folder)
        assets.default_model_path()
        shutil.rmtree(folder)
        snapshot.rename(folder)
    assert len(built) == 2
    # an unchanged file whose time changed (copied back, touched) is checked by its content and passes
    os.utime(folder / "config.json", (1, 1))
    assert assets.cache_is_intact(folder)


# ---- case 3: --overwrite deletes only what upcycle wrote -------------------------------------------------------


# ---- case 4: a model folder's Python never runs, whatever stdin says -------------------------------------------

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


# ---- case 5: one writer per output -----------------------------------------------------------------------------


# ---- case 6: a weight index never reads outside its folder -----------------------------------------------------

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


# ---- case 7: a model is whole or refused -----------------------------------------------------------------------

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


# ---- case 8: recorded paths mean the same from anywhere --------------------------------------------------------

def test_a_run_is_analyzed_the_same_from_any_directory(lm, tmp_path, monkeypatch):
    from upcycle.analyze.run import AnalyzeOptions, analyze

    dense, _, train, held = lm
    work = tmp_path / "work"
    work.mkdir()
    shutil.move(str(dense), work / "llama")
    monkeypatch.chdir(work)
    # relative names, as people type them: the conversion and the run record where they really are
    assert main(["convert", "llama", "moe", "--num-experts", "2", "--top-k", "1", *QUIET]) == 0
    assert main(["train", "moe", "run", "--data", str(train), *TRAIN]) == 0
    options = AnalyzeOptions(data=(str(held),), tokens=64, sequence_length=16, output_tokens=16)
    here = analyze("run", str(tmp_path / "a1"), options, progress=False)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    there = analyze(str(work / "run"), str(tmp_path / "a2"), options, progress=False)
    assert [s["label"] for s in there["snapshots"]] == [s["label"] for s in here["snapshots"]]
    assert there["snapshots"][0]["label"] == "step 0 (init)"
    assert there["target"]["dense"] == here["target"]["dense"] == str(work / "llama")
    assert there["snapshots"][0]["kl_to_dense"] == here["snapshots"][0]["kl_to_dense"] is not None


def test_a_relative_name_recorded_before_is_never_looked_up_here_or_on_the_hub(lm, tmp_path, monkeypatch):
    from upcycle.analyze.run import AnalyzeOptions, analyze

    dense, moe, _, held = lm
    moved = tmp_path / "moe"
    shutil.copytree(moe, moved)
    report = json.loads((moved / "upcycle_report.json").read_text())
    report.pop("source_path")
    report["source_model"] = "llama"          # as an older version recorded it: relative to where it ran
    (moved / "upcycle_report.json").write_text(json.dumps(report))
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(dense, elsewhere / "llama")            # a same-named folder here must not be taken for it
    monkeypatch.chdir(elsewhere)
    options = AnalyzeOptions(data=(str(held),), tokens=64, sequence_length=16, output_tokens=16)
    started = time.perf_counter()
    result = analyze(str(moved), str(tmp_path / "a"), options, progress=False)
    assert time.perf_counter() - started < 60            # no half-minute of hub retries
    assert result["target"]["dense"] is None and result["snapshots"][0]["kl_to_dense"] is None
    assert any("relative to the folder that command ran in" in note for note in result["target"]["notes"])


def test_a_run_config_whose_model_is_not_a_name_is_a_note(lm, tmp_path):
    from upcycle.analyze.target import resolve_target

    _, moe, _, _ = lm
    run = fake_run(moe, tmp_path / "run")
    (run / "run_config.yaml").write_text("model: [1, 2]\n")
    target = resolve_target(str(run))
    assert target.skeleton == str(run / "model") and "not a model name" in " ".join(target.notes)


def test_the_output_claim_refuses_before_anything_exists(tmp_path):
    """The checks come before the lock and before any folder is made: a refused claim leaves nothing."""
    from upcycle.checkpoint.folders import claim_output, inputs

    data = tmp_path / "data.txt"
    data.write_text("text")
    (tmp_path / "d").mkdir()
    with pytest.raises(UpcycleError, match="lies inside the data"):
        with claim_output(tmp_path / "d" / "new" / "x", kind="convert", given=inputs(("data", tmp_path / "d"))):
            pass
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d", "data.txt"] and not any((tmp_path / "d").iterdir())
    hard = tmp_path / "hard.txt"
    os.link(data, hard)
    with pytest.raises(UpcycleError, match="the same file under another name"):
        with claim_output(hard, kind="eval", given=inputs(("data", data)), overwrite=True, file=True):
            pass


def test_ctrl_c_while_torch_loads_is_a_message_not_a_traceback(tmp_path):
    """The `upcycle` command imports torch and transformers inside `main`: an interrupt while they load (the
    first seconds of every command) exits 130 with one line."""
    import signal
    import subprocess

    code = ("import sys, upcycle.cli\nprint('ready', 'torch' in sys.modules, flush=True)\n"
            "sys.exit(upcycle.cli.main(['convert', 'default', '--dry-run']))\n")
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, cwd=tmp_path)
    assert process.stdout.readline().split() == ["ready", "False"]        # torch not loaded before main
    time.sleep(0.05)
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 130, err
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("upcycle: interrupted"), err
