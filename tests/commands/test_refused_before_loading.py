"""What cannot work is refused before a weight is loaded: an OUT that cannot be written (under a file, on a file
system without folders, read-only), a local path typo tried as a hub id, CLIP with text calibration or without
images, probe or calibration text for a model without a tokenizer, probe text for a vision model.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from conftest import make_tiny
from upcycle.cli import main
from upcycle.errors import UpcycleError


def test_out_under_a_file_is_refused_before_loading(tmp_path, tiny_llama, capsys, no_weights_loaded):
    blocker = tmp_path / "notes.txt"
    blocker.write_text("a file where a folder would go")
    assert main(["convert", str(tiny_llama), str(blocker / "sub" / "out"), "--quiet"]) == 2
    assert f"cannot write output {blocker / 'sub' / 'out'}: {blocker} is a file, not a folder" in \
        capsys.readouterr().err
    assert blocker.read_text() == "a file where a folder would go"


def test_out_on_a_file_system_that_takes_no_folders_is_refused_before_loading(tmp_path, tiny_llama, capsys,
                                                                              no_weights_loaded):
    out = Path("/proc/upcycle-no-such-place/out")     # /proc refuses new folders, even to root
    assert main(["convert", str(tiny_llama), str(out), "--quiet"]) == 2
    assert f"cannot write output {out}: a folder cannot be created in /proc" in capsys.readouterr().err


def test_read_only_out_folder_is_refused_before_loading(tmp_path, tiny_llama, capsys, monkeypatch,
                                                        no_weights_loaded):
    """A folder without write permission (simulated: the tests run as root, whom chmod does not stop)."""
    read_only = tmp_path / "read-only"
    read_only.mkdir()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode, **kw: Path(path) != read_only and real_access(path, mode))
    assert main(["convert", str(tiny_llama), str(read_only / "new" / "out"), "--quiet"]) == 2
    assert f"no permission to create files in {read_only}" in capsys.readouterr().err
    assert list(read_only.iterdir()) == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through chmod; the simulated test above covers it")
def test_read_only_out_folder_is_refused_for_real(tmp_path, tiny_llama, capsys, no_weights_loaded):
    read_only = tmp_path / "read-only"
    read_only.mkdir(mode=0o555)
    assert main(["convert", str(tiny_llama), str(read_only / "out"), "--quiet"]) == 2
    assert f"no permission to create files in {read_only}" in capsys.readouterr().err


def test_export_checks_out_before_reading_the_source(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    # the source does not exist either: the OUT message shows the check ran first
    assert main(["export", str(tmp_path / "no-such-model"), str(blocker / "out")]) == 2
    assert f"{blocker} is a file, not a folder" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["./typo-model", "/nonexistent/x", "~/upcycle-no-such-model", "models/typo",
                                  "../models/typo"])
def test_local_path_typo_is_a_missing_folder_at_once(tmp_path, monkeypatch, capsys, name):
    """A name that looks local and does not exist is never tried as a hub id (30 s of retries offline)."""
    from upcycle.checkpoint.loading import load_dense

    (tmp_path / "work" / "models").mkdir(parents=True)
    (tmp_path / "models").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    start = time.perf_counter()
    with pytest.raises(UpcycleError, match=r"could not load model .*: no such folder"):
        load_dense(name)                          # what convert, train and eval load dense models with
    assert main(["convert", name, str(tmp_path / "out"), "--quiet"]) == 2
    assert main(["eval", name]) == 2
    assert time.perf_counter() - start < 1.0
    err = capsys.readouterr().err
    assert err.count(f"could not load model {name!r}: no such folder") == 2, err


def test_hub_ids_and_files_as_model_names(tmp_path, monkeypatch):
    from upcycle.data import model_names
    from upcycle.data.model_names import resolve_model_name

    monkeypatch.chdir(tmp_path)
    # no folder `HuggingFaceTB` here: a hub id, passed on untouched when the hub can be reached
    monkeypatch.setattr(model_names, "hub_reachable", lambda: True)
    assert resolve_model_name("HuggingFaceTB/SmolLM2-135M") == "HuggingFaceTB/SmolLM2-135M"
    assert resolve_model_name("gpt2") == "gpt2"
    # and refused at once when it cannot (no half-minute of retries)
    monkeypatch.setattr(model_names, "hub_reachable", lambda: False)
    with pytest.raises(UpcycleError, match="the hub .* cannot be reached from this machine"):
        resolve_model_name("gpt2")
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(UpcycleError, match="'model.safetensors': it is a file; a model is a folder"):
        resolve_model_name("model.safetensors")
    (tmp_path / "real").mkdir()
    assert resolve_model_name("real") == "real" and resolve_model_name("./real") == "real"


def _tiny_clip_with_tokenizer(folder: Path) -> Path:
    from upcycle.data.clip_pairs import caption_tokenizer

    make_tiny("clip").save_pretrained(folder)
    caption_tokenizer(["a photo of a cat", "a photo of a dog"], max_length=16).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("with_tokenizer", [True, False])
def test_clip_with_text_calibration_is_refused_before_loading(tmp_path, capsys, no_weights_loaded,
                                                              with_tokenizer):
    model = tmp_path / "clip"
    if with_tokenizer:      # a tokenizer must not let caption text pass as CLIP calibration data
        _tiny_clip_with_tokenizer(model)
    else:
        make_tiny("clip").save_pretrained(model)
    text = tmp_path / "captions.txt"
    text.write_text("a photo of a cat\n\na photo of a dog\n")
    assert main(["convert", str(model), str(tmp_path / "out"), "--method", "cluster", "--calibration", str(text),
                 "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "is a two-tower CLIP model, which calibrates on images, not text" in err
    assert "image-caption pairs as a .safetensors file of model inputs (pixel_values, input_ids" in err
    assert not (tmp_path / "out").exists()


def test_clip_model_inputs_without_images_are_refused_before_loading(tmp_path, capsys, no_weights_loaded):
    import torch
    from safetensors.torch import save_file

    model = _tiny_clip_with_tokenizer(tmp_path / "clip")
    captions_only = tmp_path / "captions.safetensors"
    save_file({"input_ids": torch.ones(4, 8, dtype=torch.long)}, captions_only)
    assert main(["convert", str(model), str(tmp_path / "out"), "--method", "cluster", "--calibration",
                 str(captions_only), "--quiet"]) == 2
    assert "needs pixel_values in every batch" in capsys.readouterr().err


def test_probe_text_without_a_tokenizer_is_refused_before_loading(tmp_path, tiny_llama, capsys,
                                                                  no_weights_loaded):
    probe = tmp_path / "probe.txt"
    probe.write_text("held-out text the user wants the check to run on\n")
    assert main(["convert", str(tiny_llama), str(tmp_path / "out"), "--probe-text", str(probe), "--quiet"]) == 2
    assert f"check.text (--probe-text) {probe}: model {str(tiny_llama)!r} has no tokenizer to read it with" in \
        capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_text_calibration_without_a_tokenizer_is_refused_before_loading(tmp_path, tiny_llama, capsys,
                                                                        no_weights_loaded):
    text = tmp_path / "calibration.txt"
    text.write_text("some text\n")
    assert main(["convert", str(tiny_llama), str(tmp_path / "out"), "--method", "cluster", "--calibration",
                 str(text), "--quiet"]) == 2
    assert "has no tokenizer, so calibration text cannot be tokenized" in capsys.readouterr().err


def test_probe_text_for_a_vision_model_is_refused(tmp_path, capsys, no_weights_loaded):
    import transformers

    from upcycle.data.clip_pairs import caption_tokenizer

    vision = tmp_path / "vision"
    transformers.CLIPVisionModel(make_tiny("clip").config.vision_config).save_pretrained(vision)
    caption_tokenizer(["a photo of a cat"], max_length=16).save_pretrained(vision)   # so the text is readable
    probe = tmp_path / "probe.txt"
    probe.write_text("text a vision tower cannot read\n")
    assert main(["convert", str(vision), str(tmp_path / "out"), "--probe-text", str(probe), "--quiet"]) == 2
    assert "is a vision model and takes no text" in capsys.readouterr().err


@pytest.mark.parametrize("streaming", [False, True])
def test_an_export_class_that_cannot_fit_is_refused_before_a_weight_is_read(tmp_path, tiny_llama, monkeypatch,
                                                                           streaming):
    """Mixtral needs every block MoE: with every other block, `--export-class mixtral` is refused on the planned
    (weightless) model, whichever path converts, before the dense weights load (in memory) or a tensor is read
    from the checkpoint (streamed); both counted."""
    import importlib

    from upcycle.checkpoint.reader import CheckpointReader
    from upcycle.config import ConvertConfig, PlacementConfig
    from upcycle.conversion.pipeline import convert

    routes = importlib.import_module("upcycle.conversion.routes")
    reads = {"dense_weights": 0, "tensors": 0}
    real_weights, real_get = routes.dense_weights, CheckpointReader.get

    def dense_weights(*args, **kwargs):
        reads["dense_weights"] += 1
        return real_weights(*args, **kwargs)

    def get(self, name):
        reads["tensors"] += 1
        return real_get(self, name)

    monkeypatch.setattr(routes, "dense_weights", dense_weights)
    monkeypatch.setattr(CheckpointReader, "get", get)
    cfg = ConvertConfig(model=str(tiny_llama), method="copy", placement=PlacementConfig(every=2), export="hf",
                        export_class="mixtral", streaming=streaming)
    with pytest.raises(UpcycleError, match="needs every block to be MoE"):
        convert(cfg, tmp_path / "out", progress=False)
    assert reads == {"dense_weights": 0, "tensors": 0}
    assert not (tmp_path / "out").exists()
