"""Sharded safetensors written tensor by tensor at planned offsets, and read lazily (issue 13)."""

from __future__ import annotations

import json
import random

import pytest
import torch
from safetensors.torch import load_file, save_file

from upcycle.conversion.shards import (
    INDEX_FILE,
    SINGLE_FILE,
    CheckpointReader,
    ShardedWriter,
    parse_size,
    plan_shards,
)
from upcycle.errors import UpcycleError


def _tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(50, 16, generator=g),
        "layers.0.w": torch.randn(16, 16, generator=g).to(torch.bfloat16),
        "layers.0.b": torch.randn(16, generator=g).to(torch.float16),
        "layers.1.w": torch.randn(3, 16, 16, generator=g),
        "layers.1.mask": torch.rand(7, generator=g) > 0.5,
        "layers.1.count": torch.arange(5, dtype=torch.int64),
        "odd": torch.randn(3, generator=g).to(torch.bfloat16),       # 6 bytes: the next tensor must stay aligned
        "head.weight": torch.randn(50, 16, generator=g, dtype=torch.float64),
    }


def _specs(tensors):
    return [(n, tuple(t.shape), t.dtype) for n, t in tensors.items()]


@pytest.mark.parametrize("max_bytes", [10**9, 4000])
def test_written_in_any_order_reads_back_exactly(tmp_path, max_bytes):
    tensors = _tensors()
    writer = ShardedWriter(tmp_path, _specs(tensors), max_shard_bytes=max_bytes)
    order = list(tensors)
    random.Random(1).shuffle(order)
    for name in order:
        writer.write(name, tensors[name])
    weight_map = writer.close()
    files = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    if max_bytes > 10**6:
        assert files == [SINGLE_FILE] and not (tmp_path / INDEX_FILE).exists()
    else:
        assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
        index = json.loads((tmp_path / INDEX_FILE).read_text())
        assert index["weight_map"] == weight_map and set(weight_map.values()) == set(files)
        assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    # the reference reader (safetensors' own, which validates headers and offsets) gets the same tensors
    loaded = {}
    for file in files:
        loaded |= load_file(tmp_path / file)
    assert loaded.keys() == tensors.keys()
    for name, t in tensors.items():
        assert loaded[name].dtype == t.dtype and torch.equal(loaded[name], t), name
    reader = CheckpointReader(tmp_path)
    assert sorted(reader.names()) == sorted(tensors)
    for name, t in tensors.items():
        assert reader.shape(name) == tuple(t.shape) and reader.dtype(name) == t.dtype
        assert torch.equal(reader.get(name), t)


def test_shards_fill_in_order_up_to_the_limit():
    specs = [(f"t{i}", (10,), torch.float32) for i in range(5)] + [("big", (100,), torch.float32)]
    shards = plan_shards(specs, 100)       # 40 bytes each: two fit, the third starts a new shard
    assert [[s[0] for s in shard] for shard in shards] == [["t0", "t1"], ["t2", "t3"], ["t4"], ["big"]]


def test_the_writer_refuses_what_the_plan_does_not_hold(tmp_path):
    tensors = _tensors()
    writer = ShardedWriter(tmp_path, _specs(tensors))
    with pytest.raises(UpcycleError, match="not in the output plan"):
        writer.write("nope", torch.zeros(1))
    with pytest.raises(UpcycleError, match="planned torch.float32"):
        writer.write("embed.weight", torch.zeros(50, 16, dtype=torch.float16))
    writer.write("odd", tensors["odd"])
    with pytest.raises(UpcycleError, match="written twice"):
        writer.write("odd", tensors["odd"])
    with pytest.raises(UpcycleError, match="never written"):
        writer.close()


def test_the_reader_reads_a_single_file_and_refuses_missing_shards(tmp_path):
    tensors = {"a": torch.randn(3), "b": torch.randn(2, 2)}
    save_file(tensors, tmp_path / SINGLE_FILE)
    reader = CheckpointReader(tmp_path)
    assert torch.equal(reader.get("b"), tensors["b"])
    with pytest.raises(UpcycleError, match="no tensor 'c'"):
        reader.get("c")
    (tmp_path / INDEX_FILE).write_text(json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors"}}))
    with pytest.raises(UpcycleError, match="not there"):
        CheckpointReader(tmp_path)
    with pytest.raises(UpcycleError, match="no model.safetensors"):
        CheckpointReader(tmp_path / "missing")


def test_sizes():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 * 2**30 and parse_size(123) == 123
    assert parse_size("500mb") == 500 * 10**6
    with pytest.raises(UpcycleError, match="shard size"):
        parse_size("lots")
