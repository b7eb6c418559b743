"""Inputs a new user gives, read as they meant them or refused at once with a message.

Numbers in `--set`, recipes and method arguments in every written form; malformed `--set` values and recipes
as messages, not tracebacks; and the conversion's checks that used to come too late or say the wrong thing:
an unwritable OUT, a local path typo tried as a hub id, CLIP with text calibration, `--probe-text` on a model
without a tokenizer.
"""

from __future__ import annotations

import importlib
import json
import os
import time
from pathlib import Path

import pytest
import yaml

from conftest import make_tiny
from upcycle.cli import main, parser
from upcycle.commands.convert import convert_config
from upcycle.config import ConvertConfig, TrainConfig
from upcycle.config_reader import build, load_recipe, set_override
from upcycle.conversion.pipeline import validate
from upcycle.errors import UpcycleError

# (as written, the number it means): YAML 1.1 reads only some of these as floats by itself
NUMBER_FORMS = [("1e-3", 1e-3), ("1E-3", 1e-3), (".5", 0.5), ("5.", 5.0), ("1e+3", 1000.0),
                ("-2.5E-4", -2.5e-4), ("0.25", 0.25), ("3", 3.0), ("+7.5e0", 7.5)]


def convert_cfg(*argv: str) -> ConvertConfig:
    """The config `upcycle convert MODEL OUT *argv` would run with (nothing is loaded)."""
    return convert_config(parser(every_command=True).parse_args(["convert", "some-model", "out", *argv]))


# ---- numbers in every written form ----------------------------------------------------------------------------

# These keys take no negative number: a negative form is read as that number, which the key's range then refuses
# (the message quotes the number read).
@pytest.mark.parametrize(("written", "number"), NUMBER_FORMS)
def test_float_key_takes_every_written_number_via_set(written, number):
    if number < 0:
        with pytest.raises(UpcycleError, match=rf"check.tolerance must be a finite number in \[0, inf\), got {number}"):
            convert_cfg("--set", f"check.tolerance={written}")
        return
    tolerance = convert_cfg("--set", f"check.tolerance={written}").check.tolerance
    assert type(tolerance) is float and tolerance == number


@pytest.mark.parametrize(("written", "number"), NUMBER_FORMS)
def test_float_key_takes_every_written_number_in_a_recipe(tmp_path, written, number):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"check:\n  tolerance: {written}\n")
    train = tmp_path / "t.yaml"        # train recipes: a top-level float, a nested one, and a tuple of floats
    beta = written if 0 <= number < 1 else "0.5"        # betas are in [0, 1)
    train.write_text(f"lr: {written}\nregularizers: {{z_loss: {written}}}\nbetas: [{beta}, 0.95]\n")
    if number < 0:
        with pytest.raises(UpcycleError, match=f"got {number}"):
            convert_cfg("--config", str(recipe))
        with pytest.raises(UpcycleError, match=f"got {number}"):
            build(TrainConfig, load_recipe(train))
        return
    tolerance = convert_cfg("--config", str(recipe)).check.tolerance
    assert type(tolerance) is float and tolerance == number
    cfg = build(TrainConfig, load_recipe(train))
    assert (cfg.lr, cfg.regularizers.z_loss, cfg.betas) == (number, number, (float(beta), 0.95))


@pytest.mark.parametrize(("method", "argument", "written", "number"),
                         [("drop", "ratio", ".25", 0.25), ("noise", "std", "1E-3", 1e-3),
                          ("noise", "std", "1e-3", 1e-3), ("drop_svd", "fraction", "5.e-1", 0.5),
                          ("copy", "router_std", "-2.5E-4", -2.5e-4), ("spri", "rho", "1e+0", 1.0)])
def test_method_argument_takes_every_written_number(tmp_path, method, argument, written, number):
    via_set = convert_cfg("--method", method, "--set", f"method_args.{argument}={written}")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"method: {method}\nmethod_args:\n  {argument}: {written}\n")
    via_recipe = convert_cfg("--config", str(recipe))
    for cfg in (via_set, via_recipe):
        _, args = validate(cfg)
        assert type(args[argument]) is float and args[argument] == number


def test_numbers_reach_the_conversion(tmp_path):
    """End to end: `--set check.tolerance=1e-3` (the key the preservation error tells users to raise) runs and
    lands in the report and the resolved config as the number 0.001."""
    model_dir, out = tmp_path / "m", tmp_path / "out"
    make_tiny("llama").save_pretrained(model_dir)
    assert main(["convert", str(model_dir), str(out), "--method", "noise", "--set", "check.tolerance=1e-3",
                 "--set", "method_args.std=1E-3", "--set", "check.tokens=1.6e1", "--quiet"]) == 0
    report = json.loads((out / "upcycle_report.json").read_text())
    assert report["preservation"]["tolerance"] == 1e-3 and report["method_args"]["std"] == 1e-3
    assert report["preservation"]["probe_shape"] == [4, 16]
    run_config = yaml.safe_load((out / "run_config.yaml").read_text())
    assert run_config["check"]["tolerance"] == 1e-3 and run_config["check"]["tokens"] == 16


def test_int_key_takes_whole_numbers_in_any_form_and_refuses_fractions():
    """The choice for int keys: a whole number written as a float (`1e5` tokens, `2.0` experts) is that int;
    a fraction is refused, never rounded."""
    cfg = convert_cfg("--set", "calibration.tokens=1e5", "--set", "moe.top_k=2.0", "--set", "seed=7")
    assert (cfg.calibration.tokens, cfg.moe.top_k, cfg.seed) == (100000, 2, 7)
    assert all(type(v) is int for v in (cfg.calibration.tokens, cfg.moe.top_k, cfg.seed))
    _, args = validate(convert_cfg("--method", "granular", "--set", "method_args.granularity=2e0"))
    assert args["granularity"] == 2 and type(args["granularity"]) is int
    with pytest.raises(UpcycleError, match=r"moe.top_k must be a whole number \(int\), got 2.5"):
        convert_cfg("--set", "moe.top_k=2.5")
    with pytest.raises(UpcycleError, match=r"calibration.tokens must be a whole number \(int\), got 0.001"):
        convert_cfg("--set", "calibration.tokens=1e-3")


def test_strings_and_bools_are_not_numbers(tmp_path, capsys):
    """Only number-typed keys convert: a number-looking value stays a string for a str key (and is then refused
    by what checks that key); a word is never a number; bools are YAML's, and 1 is not true."""
    assert convert_cfg("--set", "method=1e3").method == "1e3"
    assert main(["convert", str(tmp_path / "m"), str(tmp_path / "o"), "--set", "method=1e3", "--quiet"]) == 2
    assert "unknown method '1e3'" in capsys.readouterr().err
    assert convert_cfg("--set", "check.text=1e-3").check.text == "1e-3"
    with pytest.raises(UpcycleError, match="argument 'placement' must be one of 'down', 'gate', 'up', got '1e3'"):
        validate(convert_cfg("--method", "spri", "--set", "method_args.placement=1e3"))   # the string '1e3'
    for bad in ("check.tolerance=1e", "check.tolerance=one", "check.tolerance=true", "check.tolerance=infinite"):
        with pytest.raises(UpcycleError, match="check.tolerance must be float"):
            convert_cfg("--set", bad)
    assert convert_cfg("--set", "moe.normalize_topk=no").moe.normalize_topk is False
    with pytest.raises(UpcycleError, match=r"check.tolerance must be a finite number in \[0, inf\), got inf"):
        convert_cfg("--set", "check.tolerance=.inf")     # YAML's own number, read, then refused by the range
    with pytest.raises(UpcycleError, match="moe.normalize_topk must be true or false, got 1"):
        convert_cfg("--set", "moe.normalize_topk=1")
    with pytest.raises(UpcycleError, match="argument 'relative_std' must be true or false"):
        validate(convert_cfg("--method", "noise", "--set", "method_args.relative_std=0"))


def test_a_yaml_boolean_word_for_a_string_key_says_to_quote_it(tmp_path):
    """`mixed_precision: no` (Accelerate's spelling) is YAML 1.1's false: the refusal says why and how to write it,
    and the quoted word is the string."""
    with pytest.raises(UpcycleError, match=r"mixed_precision must be a string, got False: YAML reads .* quote the "
                                           r"word \(mixed_precision: 'no'\)"):
        build(TrainConfig, {"mixed_precision": yaml.safe_load("no")})
    recipe = tmp_path / "r.yaml"
    recipe.write_text("mixed_precision: 'no'\n")
    assert build(TrainConfig, load_recipe(recipe)).mixed_precision == "no"
    data = {}
    set_override(data, "mixed_precision='no'")
    assert build(TrainConfig, data).mixed_precision == "no"


def test_inf_and_nan_are_floats_that_range_checks_refuse():
    """`inf` and `nan` (any case, signed) read as on the command line (`--lr inf`) and as YAML's `.inf`/`.nan`:
    non-finite floats, refused by the key's range check (when the config is built) where a finite number is
    needed, with that message."""
    for written, shown in (("inf", "inf"), ("-Inf", "-inf"), ("+INFINITY", "inf"), (".inf", "inf"), ("NaN", "nan"),
                           ("nan", "nan")):
        with pytest.raises(UpcycleError, match=rf"check.tolerance must be a finite number in \[0, inf\), got {shown}"):
            convert_cfg("--set", f"check.tolerance={written}")
    with pytest.raises(UpcycleError, match=r"moe.top_k must be a whole number \(int\), got inf"):
        convert_cfg("--set", "moe.top_k=inf")
    with pytest.raises(UpcycleError, match=r"method 'noise' argument 'std' must be in \[0, inf\), got nan"):
        validate(convert_cfg("--method", "noise", "--set", "method_args.std=nan"))
    with pytest.raises(UpcycleError, match=r"moe.capacity_factor_eval must be a finite number in \(0, inf\)"):
        convert_cfg("--set", "moe.capacity_factor_eval=inf")


def test_number_lists_take_written_numbers():
    data: dict = {}
    set_override(data, "regularizers.dpsl_alpha=[1e-1, .5]")
    assert build(TrainConfig, data).regularizers.dpsl_alpha == [0.1, 0.5]
    set_override(data, "regularizers.dpsl_alpha=[[1E0, 2e0], [3., 4]]")
    assert build(TrainConfig, data).regularizers.dpsl_alpha == [[1.0, 2.0], [3.0, 4.0]]
    set_override(data, "regularizers.dpsl_alpha=2e-1")
    assert build(TrainConfig, data).regularizers.dpsl_alpha == 0.2
    set_override(data, "regularizers.dpsl_alpha=[1, x]")
    with pytest.raises(UpcycleError, match=r"dpsl_alpha\[1\] must be float, got 'x'"):
        build(TrainConfig, data)


# ---- malformed configuration: a message naming the flag or file, exit 2 -------------------------------------

def _convert_fails(tmp_path, capsys, *argv: str) -> str:
    """Run `upcycle convert` on a model that does not exist (the config must fail first); return stderr."""
    assert main(["convert", str(tmp_path / "no-model"), str(tmp_path / "out"), *argv, "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("upcycle: error: ") and "Traceback" not in err and "could not load model" not in err
    assert not (tmp_path / "out").exists()
    return err


def test_malformed_yaml_in_set_is_a_message(tmp_path, capsys):
    err = _convert_fails(tmp_path, capsys, "--set", "moe.top_k=[1,")
    assert "--set moe.top_k=[1,: the value is not valid YAML" in err and len(err.splitlines()) == 1
    assert "the key must be dotted names" in _convert_fails(tmp_path, capsys, "--set", "moe..top_k=1")


def test_binary_file_as_config_is_a_message(tmp_path, capsys):
    binary = tmp_path / "weights.bin"
    binary.write_bytes(bytes(range(256)) * 4)
    assert f"recipe {binary} is not a text file" in _convert_fails(tmp_path, capsys, "--config", str(binary))
    nul = tmp_path / "nul.yaml"        # valid UTF-8, but characters YAML refuses
    nul.write_bytes(b"method: copy\x00\n")
    assert f"recipe {nul} is not valid YAML" in _convert_fails(tmp_path, capsys, "--config", str(nul))


def test_directory_as_config_is_a_message(tmp_path, capsys):
    err = _convert_fails(tmp_path, capsys, "--config", str(tmp_path))
    assert f"recipe {tmp_path} is a directory; --config takes a YAML file" in err


def test_recipe_whose_top_level_is_a_list_is_a_message(tmp_path, capsys):
    recipe = tmp_path / "list.yaml"
    recipe.write_text("- method: drop\n- seed: 3\n")
    err = _convert_fails(tmp_path, capsys, "--config", str(recipe))
    assert f"recipe {recipe} must be a mapping of config keys at the top level, got a list" in err
    broken = tmp_path / "broken.yaml"
    broken.write_text("moe: {top_k: 2\n")
    assert f"recipe {broken} is not valid YAML" in _convert_fails(tmp_path, capsys, "--config", str(broken))


def test_train_config_errors_are_messages_too(tmp_path, capsys):
    assert main(["train", str(tmp_path / "no-model"), str(tmp_path / "run"), "--config", str(tmp_path)]) == 2
    assert "is a directory; --config takes a YAML file" in capsys.readouterr().err
    assert main(["train", str(tmp_path / "no-model"), str(tmp_path / "run"), "--set", "lr=[1,"]) == 2
    assert "--set lr=[1,: the value is not valid YAML" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


# ---- checks that come before the work: OUT, model path, calibration and probe data --------------------------

@pytest.fixture
def tiny_llama(tmp_path) -> Path:
    """A tiny Llama folder without a tokenizer (as the conftest models are)."""
    make_tiny("llama").save_pretrained(tmp_path / "llama")
    return tmp_path / "llama"


@pytest.fixture
def no_weights_loaded(monkeypatch):
    """Fail the test if the conversion gets as far as loading the dense weights."""
    def refuse(*args, **kwargs):
        raise AssertionError("the dense weights were loaded before the input was refused")
    # the converter module (the package root exports a function `convert` of the same name)
    monkeypatch.setattr(importlib.import_module("upcycle.conversion.pipeline"), "dense_weights", refuse)


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
    if with_tokenizer:      # the case that used to fail with "'NoneType' has no attribute 'shape'"
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
