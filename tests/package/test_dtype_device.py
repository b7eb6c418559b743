"""The conversion's dtype and device settings: the default stores weights in the checkpoint's
own dtype, and the device is validated before anything is read or written."""

from __future__ import annotations

import json
import types

import pytest
import torch

from conftest import write_tiny_lm
from upcycle import ConvertConfig, MoEConfig, convert
from upcycle.checkpoint.loading import resolve_dtype
from upcycle.checkpoint.reader import CheckpointReader
from upcycle.config import CalibrationConfig, CheckConfig, PlacementConfig
from upcycle.core.devices import resolve_device
from upcycle.errors import UpcycleError


@pytest.mark.parametrize(("stated", "expected"), [
    ({"dtype": "bfloat16"}, "bfloat16"),                    # transformers 5 writes `dtype`
    ({"torch_dtype": torch.float16}, "float16"),            # transformers 4 `torch_dtype`, as a torch dtype
    ({"dtype": "torch.bfloat16"}, "bfloat16"),
    ({}, "float32"),                                        # states none
    ({"dtype": "int8"}, "float32"),                         # not a dtype we store weights in
])
def test_auto_dtype_is_the_checkpoints_own(stated, expected):
    assert resolve_dtype("auto", types.SimpleNamespace(**stated)) == expected
    assert resolve_dtype("float16", types.SimpleNamespace(**stated)) == "float16"     # an explicit choice wins


def test_auto_dtype_reads_a_transformers_4_config_without_the_deprecation_warning(monkeypatch):
    """A config.json written by transformers 4 says `torch_dtype`; transformers 5 reads it into `dtype`, and
    reading its `torch_dtype` property only logs "`torch_dtype` is deprecated" (once per process)."""
    from transformers import BertConfig
    from transformers.configuration_utils import logger

    warned = []
    monkeypatch.setattr(logger, "warning_once", lambda *a, **k: warned.append(a))
    assert resolve_dtype("auto", BertConfig.from_dict({"torch_dtype": "bfloat16"})) == "bfloat16"
    assert resolve_dtype("auto", BertConfig()) == "float32"
    assert warned == []


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory):
    """The tiny Llama saved in bfloat16, its config saying so (as real checkpoints on the hub do)."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("bf16")
    dense, _, held = write_tiny_lm(root)
    folder = root / "bf16"
    AutoModelForCausalLM.from_pretrained(dense, dtype=torch.bfloat16).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((dense / name).read_bytes())
    config = json.loads((folder / "config.json").read_text())
    assert config.get("dtype", config.get("torch_dtype")) == "bfloat16"
    return folder, held


@pytest.mark.parametrize("streaming", [True, False])
def test_the_default_dtype_follows_the_checkpoint(bf16_checkpoint, tmp_path, streaming):
    folder, held = bf16_checkpoint
    cfg = ConvertConfig(model=str(folder), moe=MoEConfig(num_experts=4, top_k=2), placement=PlacementConfig(every=2),
                        check=CheckConfig(text=str(held)), streaming=streaming)
    assert cfg.dtype == "auto"
    report = convert(cfg, tmp_path / "out", progress=False).report
    assert report.dtype == "bfloat16" and report.preservation.passed
    reader = CheckpointReader(tmp_path / "out")
    dtypes = {reader.dtype(n) for n in reader.names() if "router" not in n and "selection_bias" not in n}
    assert dtypes == {torch.bfloat16}
    # routers stay float32 (MoELayer's rule) whatever the storage dtype
    assert {reader.dtype(n) for n in reader.names() if n.endswith("router.weight")} == {torch.float32}


def test_device_settings_are_checked_before_any_work(bf16_checkpoint, tmp_path):
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto") == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    for bad in ("tpu", "gpu", "cuda:x"):
        with pytest.raises(UpcycleError, match="device must be one of"):
            resolve_device(bad)
    folder, held = bf16_checkpoint
    wanted = "cuda:99" if torch.cuda.is_available() else "cuda"       # a GPU this machine does not have
    cfg = ConvertConfig(model=str(folder), moe=MoEConfig(num_experts=4, top_k=2), check=CheckConfig(text=str(held)),
                        device=wanted)
    with pytest.raises(UpcycleError, match="device 'cuda"):
        convert(cfg, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_an_explicit_cpu_device_writes_what_auto_writes_here(bf16_checkpoint, tmp_path):
    """On a machine without a GPU, `--device cpu` and `auto` are the same run (the same bytes)."""
    if torch.cuda.is_available():
        pytest.skip("auto picks the GPU on this machine")
    folder, held = bf16_checkpoint
    written = {}
    for device in ("cpu", "auto"):
        cfg = ConvertConfig(model=str(folder), method="drop", moe=MoEConfig(num_experts=4, top_k=2),
                            check=CheckConfig(text=str(held)), device=device)
        convert(cfg, tmp_path / device, progress=False)
        reader = CheckpointReader(tmp_path / device)
        written[device] = {n: reader.get(n) for n in reader.names()}
    assert written["cpu"].keys() == written["auto"].keys()
    assert all(torch.equal(written["cpu"][n], written["auto"][n]) for n in written["cpu"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the conversion's --device cuda path)")
@pytest.mark.parametrize("streaming", [True, False])
@pytest.mark.parametrize("method", ["copy", "drop", "cluster"])
def test_a_gpu_conversion_writes_what_the_cpu_one_writes(bf16_checkpoint, tmp_path, method, streaming):
    """--device cuda against --device cpu. copy does no arithmetic on the weights, so the bytes are the same.
    drop draws its neurons and values from the CPU generator but takes the matrix's mean and std on the GPU (a
    different reduction order), so its fresh values agree to float32 rounding. cluster's k-means and whitened SVD
    run on the GPU (other kernels, other rounding): the same partition, the experts equal to rounding.
    Run on an H100 (torch 2.11): this test found the expert-similarity Gram matrix built on the CPU."""
    folder, held = bf16_checkpoint
    train = folder.parent / "train.txt"
    written, reports = {}, {}
    for device in ("cpu", "cuda"):
        cfg = ConvertConfig(model=str(folder), method=method, moe=MoEConfig(num_experts=4, top_k=2),
                            placement=PlacementConfig(every=2), check=CheckConfig(text=str(held)), device=device,
                            streaming=streaming, dtype="float32",
                            calibration=CalibrationConfig(data=str(train), tokens=512))
        reports[device] = convert(cfg, tmp_path / device, progress=False).report.to_dict()
        reader = CheckpointReader(tmp_path / device)
        written[device] = {n: reader.get(n) for n in reader.names()}
    assert written["cpu"].keys() == written["cuda"].keys()
    assert reports["cuda"].preservation.passed == reports["cpu"].preservation.passed
    if method == "copy":
        different = [n for n in written["cpu"] if not torch.equal(written["cpu"][n], written["cuda"][n])]
        assert not different, different
        return
    if method == "drop":
        for name, w in written["cpu"].items():
            # a wrongly placed neuron would differ by the weights' own scale; rounding of mu and sigma by ~1e-7 of it
            scale = float(w.abs().max()) or 1.0
            assert float((w - written["cuda"][name]).abs().max()) <= 1e-5 * scale, name
        return
    for cpu_layer, gpu_layer in zip(reports["cpu"].layers, reports["cuda"].layers, strict=True):
        assert cpu_layer.method_facts["cluster_sizes"] == gpu_layer.method_facts["cluster_sizes"], cpu_layer.name
    for name, w in written["cpu"].items():
        # float32 k-means and float64 SVDs: 1e-3 of the tensor's scale is far above the kernels' rounding
        # differences and far below what a different partition or rank would change
        scale = float(w.abs().max()) or 1.0
        assert float((w - written["cuda"][name]).abs().max()) <= 1e-3 * scale, name


@pytest.mark.parametrize("streaming", [False, True])
def test_a_weight_past_float16s_range_is_refused_by_name_before_the_output_exists(tmp_path, capsys, streaming):
    """The inputs are finite (checked when read); a weight of 1e5 becomes inf when cast to float16. The writer
    refuses it naming the tensor and the dtype, not the temporary folder it was being written into, and nothing
    is left; bfloat16 (float32's range) writes the same model."""
    from safetensors.torch import load_file, save_file

    from conftest import write_tiny_lm
    from upcycle.cli import main

    dense, _, _ = write_tiny_lm(tmp_path / "lm")
    tensors = load_file(dense / "model.safetensors")
    name = next(n for n in tensors if "mlp.up_proj" in n)
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] = 1e5
    save_file(tensors, dense / "model.safetensors", metadata={"format": "pt"})
    argv = ["convert", str(dense), str(tmp_path / "out"), "--num-experts", "2", "--top-k", "1", "--quiet",
            *(["--set", "streaming=true"] if streaming else [])]
    assert main([*argv, "--dtype", "float16"]) == 2
    err = capsys.readouterr().err
    assert "tensor model.layers.0.mlp.experts.w_gate_up holds values that are not finite in float16" in err
    assert ".tmp-" not in err and len([line for line in err.splitlines() if "upcycle:" in line]) == 1
    assert not (tmp_path / "out").exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    assert main([*argv, "--dtype", "bfloat16"]) == 0
