"""Streaming conversion: a dense checkpoint read tensor by tensor and the output written shard by
shard, one block in memory, gives the same tensors and the same per-layer reports as converting the model loaded
whole; the written folder loads and computes what the in-memory model computes."""

from __future__ import annotations

import gc
import json
import os
from pathlib import Path

import pytest
import torch
from test_calibration import batches_for

import upcycle
from conftest import make_tiny, write_tiny_lm
from upcycle import ConvertConfig, MoEConfig, convert
from upcycle.checkpoint.reader import INDEX_FILE, CheckpointReader
from upcycle.config import CheckConfig, PlacementConfig
from upcycle.errors import UpcycleError


def _tensors(folder):
    reader = CheckpointReader(folder)
    return {name: reader.get(name) for name in reader.names()}


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """The tiny Llama of conftest saved by transformers as 3 shards, and its probe text."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("stream")
    dense, _, held = write_tiny_lm(root)
    sharded = root / "sharded"
    AutoModelForCausalLM.from_pretrained(dense).save_pretrained(sharded, max_shard_size="80KB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (sharded / name).write_bytes((dense / name).read_bytes())
    assert len(set(json.loads((sharded / INDEX_FILE).read_text())["weight_map"].values())) == 3
    return sharded, held


@pytest.mark.parametrize("method", ["copy", "drop", "spri"])
def test_streaming_writes_the_in_memory_conversion_byte_for_byte(sharded, tmp_path, method):
    source, held = sharded
    outs, reports = {}, {}
    for streaming in (True, False):
        cfg = ConvertConfig(model=str(source), method=method, moe=MoEConfig(num_experts=4, top_k=2),
                            placement=PlacementConfig(every=2), check=CheckConfig(text=str(held)),
                            streaming=streaming, shard_size="100KB")
        out = tmp_path / f"out-{streaming}"
        reports[streaming] = convert(cfg, out, progress=False).report.to_dict()
        outs[streaming] = out
    assert reports[True]["streamed"] and not reports[False]["streamed"]
    assert len(list(outs[True].glob("model-*.safetensors"))) >= 3 and (outs[True] / INDEX_FILE).exists()
    streamed, in_memory = _tensors(outs[True]), _tensors(outs[False])
    assert streamed.keys() == in_memory.keys()
    for name, tensor in in_memory.items():
        assert streamed[name].dtype == tensor.dtype and torch.equal(streamed[name], tensor), name
    # the per-layer reports, checks included, are the same numbers (the same arithmetic on the same inputs)
    assert reports[True]["layers"] == reports[False]["layers"]
    assert all("max_abs_diff" in layer for layer in reports[True]["layers"])
    for key in ("parameters", "moe_layers", "max_abs_logit_diff", "kl_to_dense"):
        assert reports[True][key] == reports[False][key], key
    # the streamed folder loads and computes what the in-memory conversion's folder computes
    a, b = upcycle.load(outs[True]), upcycle.load(outs[False])
    ids = torch.arange(3, 35).reshape(2, 16)
    with torch.no_grad():
        assert torch.equal(a(input_ids=ids).logits, b(input_ids=ids).logits)


def test_streaming_cluster_matches_the_in_memory_conversion(tmp_path):
    """Calibration replayed block by block from disk gives the same activations, hence the same experts."""
    model_dir = tmp_path / "m"
    make_tiny("llama").save_pretrained(model_dir)
    from safetensors.torch import save_file

    batches = batches_for("llama")
    calib = tmp_path / "calib.safetensors"
    save_file({k: torch.cat([b[k] for b in batches]) for k in batches[0]}, str(calib))
    outs = {}
    for streaming in (True, False):
        cfg = ConvertConfig(model=str(model_dir), method="cluster", moe=MoEConfig(num_experts=4, top_k=2),
                            streaming=streaming)
        cfg = type(cfg)(**{**cfg.__dict__, "calibration": type(cfg.calibration)(data=str(calib), tokens=200,
                                                                                  batch_size=4)})
        convert(cfg, tmp_path / f"out-{streaming}", progress=False)
        outs[streaming] = _tensors(tmp_path / f"out-{streaming}")
    assert outs[True].keys() == outs[False].keys()
    for name in outs[False]:
        assert torch.equal(outs[True][name], outs[False][name]), name


def test_a_broken_promise_is_refused_per_layer_and_nothing_is_written(sharded, tmp_path, monkeypatch):
    """A promised method whose experts drift fails the per-layer check while streaming; OUT never appears."""
    from upcycle.conversion.report import PreservationError
    from upcycle.methods import METHODS, registry

    source, held = sharded
    copy = METHODS["copy"]
    broken = registry.Method(**{**copy.__dict__, "fn": METHODS["noise"].fn, "args": METHODS["noise"].args,
                                "args_class": METHODS["noise"].args_class})
    monkeypatch.setitem(METHODS, "copy", broken)
    cfg = ConvertConfig(model=str(source), method="copy", moe=MoEConfig(num_experts=4, top_k=2),
                        check=CheckConfig(text=str(held), end_to_end=False), streaming=True)
    with pytest.raises(PreservationError, match=r"MoE layer text\.\d+ differs from the dense FFN"):
        convert(cfg, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists() and list(tmp_path.iterdir()) == []


def test_streaming_true_refuses_what_cannot_stream(tmp_path):
    model_dir = tmp_path / "m"
    make_tiny("llama").save_pretrained(model_dir, safe_serialization=True)
    (model_dir / "model.safetensors").rename(model_dir / "weights.bin")
    cfg = ConvertConfig(model=str(model_dir), method="copy", moe=MoEConfig(num_experts=4, top_k=2), streaming=True)
    with pytest.raises(UpcycleError, match="cannot stream"):
        convert(cfg, tmp_path / "out", progress=False)


@pytest.mark.parametrize("streaming", [True, False])
def test_a_wrong_architecture_row_fails_the_per_layer_check(tmp_path, monkeypatch, streaming):
    """An extraction that does not compute the model's own MLP (here: the wrong activation) passes the
    end-to-end check, whose allowance is measured with the same extraction, but not the per-layer check, whose
    reference is the model's own FFN module."""
    import dataclasses

    from upcycle.conversion.report import PreservationError
    from upcycle.core import architectures

    model_dir = tmp_path / "m"
    make_tiny("llama").save_pretrained(model_dir)
    row = next(f for f in architectures.FAMILIES if "llama" in f.model_types)

    def wrong(block, cfg):
        return dataclasses.replace(row.extract(block, cfg), activation="gelu")

    monkeypatch.setattr(architectures, "FAMILIES", tuple(dataclasses.replace(f, extract=wrong) if f is row else f
                                                         for f in architectures.FAMILIES))
    cfg = ConvertConfig(model=str(model_dir), method="copy", moe=MoEConfig(num_experts=4, top_k=2),
                        streaming=streaming)
    with pytest.raises(PreservationError, match="differs from the dense FFN it replaces"):
        convert(cfg, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("export_class, every", [("mixtral", 1), ("qwen2_moe", 2)])
def test_a_streamed_stock_export_equals_the_in_memory_one(tmp_path, export_class, every):
    """With --export hf and streaming: true the shards are written in the stock class's layout directly; plain
    transformers loads them, and they hold the tensors the in-memory export writes."""
    from transformers import AutoModelForCausalLM

    model_dir = tmp_path / "m"
    make_tiny("llama").save_pretrained(model_dir)
    outs = {}
    for streaming in (True, False):
        cfg = ConvertConfig(model=str(model_dir), method="copy", moe=MoEConfig(num_experts=4, top_k=2),
                            placement=PlacementConfig(every=every), export="hf", export_class=export_class,
                            streaming=streaming)
        report = convert(cfg, tmp_path / f"out-{streaming}", progress=False).report.to_dict()
        assert report["export"]["class"] == AutoModelForCausalLM.from_pretrained(
            tmp_path / f"out-{streaming}").__class__.__name__
        outs[streaming] = tmp_path / f"out-{streaming}"
    assert report["streamed"] is False          # the last one ran in memory
    a, b = _tensors(outs[True]), _tensors(outs[False])
    assert a.keys() == b.keys()
    for name in b:
        assert torch.equal(a[name], b[name]), name
    ids = torch.arange(3, 35).reshape(2, 16)
    with torch.no_grad():
        la = AutoModelForCausalLM.from_pretrained(outs[True])(input_ids=ids).logits
        lb = AutoModelForCausalLM.from_pretrained(outs[False])(input_ids=ids).logits
    assert torch.equal(la, lb)


def test_a_low_precision_output_is_checked_in_float32_on_its_rounded_weights(tmp_path):
    """Streamed, a bfloat16 output is computed in float32 from the weights as stored (rounded to bfloat16), so
    the dense reference is the rounded model and copy passes with a float32 allowance."""
    make_tiny("llama").save_pretrained(tmp_path / "m")
    cfg = ConvertConfig(model=str(tmp_path / "m"), method="copy", moe=MoEConfig(num_experts=4, top_k=2),
                        dtype="bfloat16", streaming=True)
    report = convert(cfg, tmp_path / "out", progress=False).report.to_dict()
    p = report["preservation"]
    assert p["passed"] and p["end_to_end"] and report["streamed"]
    assert p["allowed_max_abs_logit_diff"] < 1e-3          # float32 rounding, not bfloat16's (eps 7.8e-3)
    loaded = upcycle.load(tmp_path / "out")
    assert loaded.dtype == torch.bfloat16


def test_without_the_per_layer_check_the_same_bytes_and_the_report_says_nothing_was_checked(sharded, tmp_path):
    """check.per_layer=false skips the probe's replay (a copy conversion then only reads and writes): the same
    tensors as the checked run, no per-layer entries, and with the end-to-end check off too, `passed` is null
    (not true: nothing was compared)."""
    source, held = sharded
    reports, tensors = {}, {}
    for per_layer, end_to_end in ((True, False), (False, False), (False, True)):
        check = CheckConfig(text=str(held), per_layer=per_layer, end_to_end=end_to_end)
        cfg = ConvertConfig(model=str(source), moe=MoEConfig(num_experts=4, top_k=2),
                            placement=PlacementConfig(every=2), check=check, streaming=True)
        out = tmp_path / f"out-{per_layer}-{end_to_end}"
        reports[per_layer, end_to_end] = convert(cfg, out, progress=False).report.to_dict()
        tensors[per_layer, end_to_end] = _tensors(out)
    checked, unchecked, e2e = reports[True, False], reports[False, False], reports[False, True]
    assert all("max_abs_diff" in layer for layer in checked["layers"]) and checked["preservation"]["passed"]
    assert not any("max_abs_diff" in layer for layer in unchecked["layers"])
    assert unchecked["preservation"]["passed"] is None and e2e["preservation"]["passed"] is True
    for name, t in tensors[True, False].items():
        assert torch.equal(tensors[False, False][name], t) and torch.equal(tensors[False, True][name], t), name
    with pytest.raises(UpcycleError, match="check.per_layer must be true or false"):
        convert(ConvertConfig(model=str(source), check=CheckConfig(per_layer="no")), tmp_path / "x", progress=False)


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads the process's memory maps (Linux)")
def test_a_released_block_keeps_no_view_of_the_checkpoint_file(tmp_path):
    """A materialized buffer survives `release` (it may be computed, not stored); as a view of the reader's
    memory map it would keep the whole file mapped, and every page the stream read from it resident (the
    multi-source export held its 1.2 GB folder that way, twice). It owns its bytes instead."""
    from safetensors.torch import save_file

    from upcycle.checkpoint.lazy import materialize, release

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(64, 64))
            self.register_buffer("bias", torch.zeros(8))

    save_file({"b.weight": torch.randn(64, 64), "b.bias": torch.arange(8.0)}, str(tmp_path / "model.safetensors"))
    with torch.device("meta"):
        block = Block()
    reader = CheckpointReader(tmp_path)
    materialize(block, "b.", reader, {"b.weight": "b.weight", "b.bias": "b.bias"}, torch.float32)
    assert torch.equal(block.bias, torch.arange(8.0)) and not block.weight.is_meta
    release(block)
    reader.close()
    gc.collect()
    assert torch.equal(block.bias, torch.arange(8.0)) and block.weight.is_meta
    assert str(tmp_path / "model.safetensors") not in Path("/proc/self/maps").read_text()


def test_the_heap_is_trimmed_once_anonymous_memory_grew_past_the_allowance(monkeypatch):
    """Trimming returns the pages the next block's forwards would reuse, so it waits until the process's
    anonymous memory has grown by more than the allowance since the last trim; the first call always trims."""
    from upcycle.checkpoint import heap

    memory, trims = [500], []
    monkeypatch.setattr(heap, "anonymous_resident_bytes", lambda: memory[0])
    monkeypatch.setattr(heap, "trim_heap", lambda: trims.append(memory[0]) or memory.__setitem__(0, 400))
    trim = heap.HeapTrimmer(allowance=100, every=4)
    assert trim() and trims == [500]                    # after it: 400 is the floor
    for level, expected in ((450, False), (500, False), (501, True), (480, False), (520, True)):
        memory[0] = level
        assert trim() is expected, level
    assert trims == [500, 501, 520]
    memory[0] = 400                                     # counters that do not move: every fourth block anyway
    assert [trim() for _ in range(8)] == [False, False, False, True] * 2
    monkeypatch.setattr(heap, "anonymous_resident_bytes", lambda: None)     # no /proc: every time
    assert trim() and trim() and len(trims) == 7


def test_anonymous_memory_counts_the_heap_and_not_mapped_files(tmp_path):
    """Measured in a fresh interpreter: in a test process, an allocation may land in memory an earlier test freed
    and left resident, and grow nothing."""
    import subprocess
    import sys

    from upcycle.checkpoint.heap import anonymous_resident_bytes

    if anonymous_resident_bytes() is None:
        pytest.skip("no /proc/self/statm here")
    path = tmp_path / "file"
    path.write_bytes(b"\1" * 2**26)
    code = ("import mmap, sys, torch\n"
            "from upcycle.checkpoint.heap import anonymous_resident_bytes as anon\n"
            "before = anon()\n"
            "with open(sys.argv[1], 'rb') as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:\n"
            "    assert sum(mapped[i] for i in range(0, 2**26, 4096)) == 2**14\n"   # 64 MiB of the file resident
            "    mapped_growth = anon() - before\n"
            "block = torch.ones(2**24)\n"                                          # 64 MiB of heap, touched
            "print(mapped_growth, anon() - before)\n")
    done = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=120,
                          env=os.environ | {"PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")})
    mapped_growth, heap_growth = map(int, done.stdout.split())
    # bounds: the 64 MiB of file pages are not anonymous (a few MiB of interpreter noise allowed); the tensor is
    assert mapped_growth < 16 * 2**20 and heap_growth > 48 * 2**20, (mapped_growth, heap_growth)
