"""`upcycle convert` end to end on tiny random models of every family: preservation, determinism,
save/load identity, placement, and bad inputs, each refused with a message that names it."""

from __future__ import annotations

import json
import os

import pytest
import torch

import upcycle
from conftest import make_tiny
from upcycle import methods as registry
from upcycle.cli import main
from upcycle.config import CheckConfig, ConvertConfig
from upcycle.config_reader import build
from upcycle.conversion.pipeline import PreservationError, convert, upcycle_model
from upcycle.core.moe import moe_layers
from upcycle.errors import UpcycleError
from upcycle.probe import make_probe, probe_output


def cfg(model="x", **overrides) -> ConvertConfig:
    data = {"model": str(model), "moe": {"num_experts": 4, "top_k": 2}, "check": {"tokens": 16}}
    for key, value in overrides.items():
        node = data
        *parents, leaf = key.split("__")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return build(ConvertConfig, data)


def test_copy_preserves_every_family(family):
    model = make_tiny(family)
    report = upcycle_model(model, cfg(), progress=False).to_dict()
    assert report["preservation"]["promised"] and report["preservation"]["passed"]
    assert report["max_abs_logit_diff"] <= 1e-4
    if family != "bert":      # a bare encoder's hidden states are not a distribution
        assert report["kl_to_dense"] < 1e-8
    assert report["num_moe_layers"] == (8 if family == "clip" else 4)     # every block; CLIP: both towers
    assert len(moe_layers(model)) == report["num_moe_layers"]


def test_parameter_counts(family):
    model = make_tiny(family)
    report = upcycle_model(model, cfg(placement__every=2), progress=False).to_dict()
    before, after = report["parameters"]["before"], report["parameters"]["after"]
    assert before["total"] == before["active_per_token"]
    per_expert = next(iter(moe_layers(model).values())).experts.weights().num_params()
    router = 4 * 32
    n = report["num_moe_layers"]
    assert after["total"] == before["total"] + n * (3 * per_expert + router)          # 4 experts replace 1 FFN
    assert after["active_per_token"] == before["active_per_token"] + n * (per_expert + router)   # k=2 active


@pytest.mark.parametrize("method", ["noise", "drop"])
def test_perturbing_methods_report_drift_but_write(method, tmp_path):
    model_dir = tmp_path / "m"
    make_tiny("llama").save_pretrained(model_dir)
    result = convert(cfg(model_dir, method=method), tmp_path / "out", progress=False)
    r = result.report.to_dict()
    assert not r["preservation"]["promised"] and r["preservation"]["passed"] is None
    assert r["max_abs_logit_diff"] > 1e-6 and r["kl_to_dense"] > 0


def test_written_folder_round_trips_to_identical_logits(tiny_path, tmp_path, family):
    out = tmp_path / "out"
    result = convert(cfg(tiny_path, method="drop", placement__every=2), out, progress=False)
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "upcycle_config.json", "model.safetensors", "run_config.yaml",
            "upcycle_report.json"} <= names
    report = json.loads((out / "upcycle_report.json").read_text())
    assert report["method"] == "drop" and report["num_moe_layers"] == len(moe_layers(result.model))
    loaded = upcycle.load(out)
    probe = make_probe(loaded, None, None, CheckConfig(tokens=16), seed=3)
    torch.testing.assert_close(probe_output(loaded, probe).values_NC, probe_output(result.model, probe).values_NC,
                               atol=0, rtol=0)


@pytest.mark.parametrize("method", ["noise", "drop"])
def test_same_seed_same_bytes(tiny_path, tmp_path, method):
    outs = []
    for i, seed in enumerate([5, 5, 6]):
        convert(cfg(tiny_path, method=method, seed=seed), tmp_path / f"o{i}", progress=False)
        outs.append((tmp_path / f"o{i}" / "model.safetensors").read_bytes())
    assert outs[0] == outs[1] and outs[0] != outs[2]


def test_placement_every_layers_and_towers():
    model = make_tiny("llama", layers=6)
    report = upcycle_model(model, cfg(placement__every=2), progress=False).to_dict()
    assert report["moe_layers"] == ["text.1", "text.3", "text.5"]
    model = make_tiny("llama", layers=6)
    report = upcycle_model(model, cfg(placement__layers=[0, -1]), progress=False)
    assert report.moe_layers == ["text.0", "text.5"]
    clip = make_tiny("clip")
    report = upcycle_model(clip, cfg(placement__towers=["vision"], placement__every=2), progress=False).to_dict()
    assert report["moe_layers"] == ["vision.1", "vision.3"]
    assert all("vision_model" in name for name in moe_layers(clip))


def test_padding_mask_reaches_the_layers():
    model = make_tiny("llama")
    upcycle_model(model, cfg(), progress=False)
    ids = torch.randint(0, 128, (2, 5))
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
    model(input_ids=ids, attention_mask=mask)
    for layer in moe_layers(model).values():
        assert layer.last_record.mask_T.tolist() == mask.bool().view(-1).tolist()


# ---- bad input: a clear error, raised before anything is mutated or written -------------------------------

@pytest.mark.parametrize("overrides,message", [
    ({"moe__top_k": 5}, "top_k must be between 1 and num_experts"),
    ({"placement__every": 9}, "matched zero layers"),
    ({"placement__layers": [1, 4]}, r"layer indices \[4\] are out of range"),
    ({"method_args": {"rate": 0.1}, "method": "drop"}, "no argument"),
    ({"method_args": {"ratio": "big"}, "method": "drop"}, "must be float"),
    ({"method": "magic"}, "unknown method"),
    ({"placement__towers": ["vision"]}, "towers"),
])
def test_bad_input_is_refused_before_mutation(overrides, message):
    model = make_tiny("llama")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(UpcycleError, match=message):
        upcycle_model(model, cfg(**overrides), progress=False)
    assert not moe_layers(model)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_config_refuses_unknown_keys_and_types():
    with pytest.raises(UpcycleError, match="moe.num_expert"):
        build(ConvertConfig, {"moe": {"num_expert": 4}})
    with pytest.raises(UpcycleError, match="moe.top_k must be int"):
        build(ConvertConfig, {"moe": {"top_k": "two"}})


def test_unsupported_architecture_lists_supported(tmp_path):
    import transformers as T
    T.OPTForCausalLM(T.OPTConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, ffn_dim=32,
                                 num_attention_heads=2, word_embed_proj_dim=16)).save_pretrained(tmp_path / "opt")
    with pytest.raises(UpcycleError, match="unsupported architecture 'opt'.*llama.*clip"):
        convert(cfg(tmp_path / "opt"), None, progress=False)


def test_model_path_that_does_not_load(tmp_path):
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{ not json")
    for bad in (tmp_path / "missing", tmp_path / "broken"):
        with pytest.raises(UpcycleError, match="could not load model"):
            convert(cfg(bad), None, progress=False)


def test_missing_probe_text_is_refused(tmp_path):
    with pytest.raises(UpcycleError, match=r"check.text .*nope.txt: no such file"):
        convert(cfg(tmp_path, check__text=str(tmp_path / "nope.txt")), None, progress=False)


def test_existing_output_is_refused_unless_overwrite(tmp_path):
    model_dir, out = tmp_path / "m", tmp_path / "out"
    make_tiny("gpt2").save_pretrained(model_dir)
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(UpcycleError, match="already exists"):
        convert(cfg(model_dir), out, progress=False)
    # --overwrite replaces only what upcycle wrote: a folder of the user's is never deleted
    with pytest.raises(UpcycleError, match="only upcycle's own outputs"):
        convert(cfg(model_dir), out, overwrite=True, progress=False)
    assert (out / "keep.txt").read_text() == "mine"
    (out / "keep.txt").unlink()
    convert(cfg(model_dir), out, progress=False)              # an empty folder made for the output is taken
    convert(cfg(model_dir), out, overwrite=True, progress=False)
    assert (out / "model.safetensors").exists()
    assert sorted(os.listdir(tmp_path)) == ["m", "out"]        # no temporary folders or locks left


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, RuntimeError])
def test_interrupted_conversion_leaves_nothing(tmp_path, monkeypatch, interrupt):
    model_dir, out = tmp_path / "m", tmp_path / "out"
    make_tiny("bert").save_pretrained(model_dir)

    def fail(*args, **kwargs):
        raise interrupt("stopped while writing")

    # a weight half-written: in memory (bert's folder) and streaming (a llama's), the folder never appears
    monkeypatch.setattr("upcycle.checkpoint.writer.ShardedWriter.write", fail)
    with pytest.raises(interrupt):
        convert(cfg(model_dir), out, progress=False)
    assert sorted(os.listdir(tmp_path)) == ["m"]


def test_broken_preservation_refuses_to_write(tmp_path, monkeypatch):
    """A method that promises preservation but perturbs the experts must not reach the disk."""
    model_dir, out = tmp_path / "m", tmp_path / "out"
    make_tiny("llama").save_pretrained(model_dir)
    copy = registry.METHODS["copy"]
    broken = registry.Method(**{**copy.__dict__, "fn": registry.METHODS["noise"].fn,
                                "args": registry.METHODS["noise"].args,
                                "args_class": registry.METHODS["noise"].args_class})
    monkeypatch.setitem(registry.METHODS, "copy", broken)
    with pytest.raises(PreservationError, match="refusing to write") as err:
        convert(cfg(model_dir, method="copy"), out, progress=False)
    assert err.value.report.to_dict()["max_abs_logit_diff"] > 1e-4
    assert not out.exists()


def test_copy_with_capacity_dropping_is_not_promised():
    model = make_tiny("llama")
    report = upcycle_model(model, cfg(moe__capacity_factor_eval=0.5), progress=False).to_dict()
    assert report["preservation"]["promised"] is False


# ---- CLI ---------------------------------------------------------------------------------------------------

def test_cli_convert_and_recipe_and_set(tmp_path, capsys):
    model_dir, out = tmp_path / "m", tmp_path / "out"
    make_tiny("mistral").save_pretrained(model_dir)
    recipe = tmp_path / "r.yaml"
    recipe.write_text("method: drop\nmoe: {num_experts: 8, top_k: 1}\nmethod_args: {ratio: 0.5}\n")
    code = main(["convert", str(model_dir), str(out), "--config", str(recipe), "--top-k", "2", "--every", "2",
                 "--set", "method_args.ratio=0.25", "--set", "check.tokens=8", "--quiet"])
    assert code == 0
    report = json.loads((out / "upcycle_report.json").read_text())
    assert (report["method"], report["num_experts"], report["top_k"]) == ("drop", 8, 2)
    assert report["method_args"]["ratio"] == 0.25 and report["moe_layers"] == ["text.1", "text.3"]
    run_config = (out / "run_config.yaml").read_text()
    assert "ratio: 0.25" in run_config and "top_k: 2" in run_config
    assert json.loads(capsys.readouterr().out.split("\nwrote")[0])["method"] == "drop"


def test_cli_errors_exit_2_with_message(tmp_path, capsys):
    model_dir = tmp_path / "m"
    make_tiny("llama").save_pretrained(model_dir)
    assert main(["convert", str(model_dir), str(tmp_path / "o"), "--top-k", "9", "--quiet"]) == 2
    assert "top_k must be between" in capsys.readouterr().err
    assert main(["convert", str(model_dir), str(tmp_path / "o"), "--set", "nokey", "--quiet"]) == 2
    assert "key=value" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_cli_methods_lists_arguments_and_papers(capsys):
    assert main(["methods"]) == 0
    text = capsys.readouterr().out
    for needle in ("copy:", "noise:", "drop:", "2212.05055", "2502.19261", "method_args.ratio=<float>"):
        assert needle in text


def test_a_method_failing_on_a_later_layer_leaves_the_model_untouched(monkeypatch):
    model = make_tiny("llama")
    copy = registry.METHODS["copy"]
    calls = []

    def flaky(ffn, layer, args):
        calls.append(1)
        if len(calls) == 3:
            raise UpcycleError("third layer failed")
        return copy.fn(ffn, layer, args)

    monkeypatch.setitem(registry.METHODS, "copy", registry.Method(**{**copy.__dict__, "fn": flaky}))
    with pytest.raises(UpcycleError, match="third layer"):
        upcycle_model(model, cfg(), progress=False)
    assert not moe_layers(model)


def test_output_has_ordinary_permissions(tmp_path):
    model_dir, out = tmp_path / "m", tmp_path / "out"
    make_tiny("qwen2").save_pretrained(model_dir)
    convert(cfg(model_dir), out, progress=False)
    umask = os.umask(0)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o777 & ~umask
    assert (out / "model.safetensors").stat().st_mode & 0o777 == 0o666 & ~umask


@pytest.mark.parametrize("normalize", [True, False])
def test_granular_conversion_preserves_and_reports_its_fold(family, normalize):
    model = make_tiny(family)
    report = upcycle_model(model, cfg(method="granular", method_args={"granularity": 2},
                                      moe__normalize_topk=normalize), progress=False).to_dict()
    assert report["preservation"]["promised"] and report["max_abs_logit_diff"] <= 1e-4
    assert report["folded_scales"][0]["scale"] == (2.0 if normalize else 4 * 2 / 2)


def test_single_tower_clip_vision_model_converts_and_round_trips(tmp_path):
    import transformers as T
    vision = T.CLIPVisionModel(T.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                  num_attention_heads=4, image_size=16, patch_size=8)).eval()
    vision.save_pretrained(tmp_path / "v")
    result = convert(cfg(tmp_path / "v"), tmp_path / "out", progress=False)
    report = result.report
    assert report.moe_layers == ["vision.0", "vision.1"] and report.max_abs_logit_diff <= 1e-4
    assert report.preservation.compared_output == "last_hidden_state"
    upcycle.load(tmp_path / "out")


def test_single_tower_clip_text_model_tracks_its_padding_mask(tmp_path):
    import transformers as T
    text = T.CLIPTextModel(T.CLIPTextConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                                            num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=32,
                                            bos_token_id=1, eos_token_id=2)).eval()
    report = upcycle_model(text, cfg(), progress=False).to_dict()
    assert report["moe_layers"] == ["text.0", "text.1"] and report["max_abs_logit_diff"] <= 1e-4
    mask = torch.tensor([[1, 1, 1, 0]])
    text(input_ids=torch.randint(0, 128, (1, 4)), attention_mask=mask)
    assert next(iter(moe_layers(text).values())).last_record.mask_T.tolist() == [True, True, True, False]
