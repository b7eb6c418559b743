"""Numbers are read as they are written: in `--set`, in recipes and in method arguments, in every form YAML 1.1
reads as a string (`1e-3`, `.5`, `+7.5e0`), whole numbers for integer keys, and a range check that quotes the number
it read; a string or a boolean is never a number.
"""

from __future__ import annotations

import json

import pytest
import yaml

from conftest import make_tiny
from upcycle.cli import main, parser
from upcycle.commands.convert import convert_config
from upcycle.config import ConvertConfig, TrainConfig
from upcycle.config_reader import build, load_recipe, set_override
from upcycle.conversion.validate import resolve_method
from upcycle.errors import UpcycleError

# (as written, the number it means): YAML 1.1 reads only some of these as floats by itself
NUMBER_FORMS = [("1e-3", 1e-3), ("1E-3", 1e-3), (".5", 0.5), ("5.", 5.0), ("1e+3", 1000.0),
                ("-2.5E-4", -2.5e-4), ("0.25", 0.25), ("3", 3.0), ("+7.5e0", 7.5)]


def validate(cfg):
    """The conversion's method check (`make_plan` runs it first), on a config alone."""
    return resolve_method(cfg.method, cfg.method_args, cfg.moe)


def convert_cfg(*argv: str) -> ConvertConfig:
    """The config `upcycle convert MODEL OUT *argv` would run with (nothing is loaded)."""
    return convert_config(parser(every_command=True).parse_args(["convert", "some-model", "out", *argv]))


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
