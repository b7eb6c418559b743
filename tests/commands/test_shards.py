"""Sharded safetensors written tensor by tensor at planned offsets, and read lazily."""

from __future__ import annotations

import json
import random

import pytest
import torch
from safetensors.torch import load_file, save_file

from upcycle.checkpoint.reader import INDEX_FILE, SINGLE_FILE, CheckpointReader
from upcycle.checkpoint.writer import ShardedWriter, parse_size, plan_shards
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


@pytest.mark.parametrize("pending", [None, 1000], ids=["in-line", "background"])
@pytest.mark.parametrize("max_bytes", [10**9, 4000])
def test_written_in_any_order_reads_back_exactly(tmp_path, max_bytes, pending):
    tensors = _tensors()
    writer = ShardedWriter(tmp_path, _specs(tensors), max_shard_bytes=max_bytes, max_pending_bytes=pending)
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


def test_the_background_writer_bounds_queued_bytes_and_raises_a_failed_write(tmp_path, monkeypatch):
    """Queued tensors hold memory: `write` waits while more than max_pending_bytes would be queued (one tensor
    larger than the limit is still accepted alone); a write that failed on the thread is raised, not lost."""
    import threading

    import upcycle.checkpoint.writer as shards

    tensors = {f"t{i}": torch.full((100,), float(i)) for i in range(6)}        # 400 bytes each
    gate, queued, most = threading.Event(), [], [0]
    real = shards._write_tensor

    def slow(fd, tensor, offset):
        gate.wait(5)
        real(fd, tensor, offset)

    monkeypatch.setattr(shards, "_write_tensor", slow)
    writer = ShardedWriter(tmp_path, _specs(tensors), max_pending_bytes=1000)
    for name, t in tensors.items():
        if name == "t2":
            gate.set()          # the first two are queued (800 bytes); t2 must wait for one of them
        writer.write(name, t)
        queued.append(writer._pending_bytes)
        most[0] = max(most[0], writer._pending_bytes)
    assert most[0] <= 1000 and queued[:2] == [400, 800]
    writer.close()
    assert all(torch.equal(load_file(tmp_path / SINGLE_FILE)[n], t) for n, t in tensors.items())

    def broken(fd, tensor, offset):
        raise OSError("disk full")

    monkeypatch.setattr(shards, "_write_tensor", broken)
    writer = ShardedWriter(tmp_path / ".." / tmp_path.name, _specs(tensors), max_pending_bytes=10**6)
    for name, t in tensors.items():
        writer.write(name, t)
    with pytest.raises(OSError, match="disk full"):
        writer.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_non_finite_weights_are_found_and_finite_ones_whose_sum_overflows_are_not(dtype):
    """`check_finite` asks a tensor's sum first (a NaN or an infinity makes it non-finite) and looks term by term
    only when the sum is not finite: large finite weights whose sum overflows pass, and +inf beside -inf (whose
    sum is NaN), one NaN or one infinity are refused with their count."""
    from upcycle.checkpoint.reader import check_finite

    big = torch.finfo(dtype).max
    check_finite(torch.full((4, 3), big, dtype=dtype), "w", "here")            # sum is inf; every term finite
    check_finite(torch.full((4, 3), -big, dtype=dtype), "w", "here")
    check_finite(torch.randn(5, 7).to(dtype), "w", "here")
    for bad, count in (([float("inf"), float("-inf")], 2), ([float("nan")], 1), ([float("inf")], 1)):
        t = torch.randn(5, 7).to(dtype)
        t.view(-1)[:len(bad)] = torch.tensor(bad, dtype=dtype)
        with pytest.raises(UpcycleError, match=f"here: tensor w holds {count} NaN or infinite"):
            check_finite(t, "w", "here")
    check_finite(torch.tensor([1, 2]), "ids", "here")          # integers: nothing to check


def test_float8_weights_are_checked_through_float16():
    from upcycle.checkpoint.reader import check_finite

    t = torch.tensor([448.0, -448.0, 1.0]).to(torch.float8_e4m3fn)
    check_finite(t, "w", "here")
    t = torch.tensor([1.0, float("nan")]).to(torch.float8_e4m3fn)
    with pytest.raises(UpcycleError, match="holds 1 NaN"):
        check_finite(t, "w", "here")
