"""One home for each small idea, read from the source with ast (a comment or a docstring does not count): allowed
values (`config.Range`), keyed random streams (`core.keyed.keyed_generator`), the inputs of MoE layers gathered
while a model runs (`core.layer_inputs`), a merge source's held-out split (`data.held_out`), and every temporary
folder or file named by `outputs.staging` alone; and what each of those does."""

from __future__ import annotations

import ast
import os
import socket
from pathlib import Path

import pytest
import torch

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "upcycle"


def _trees():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path.relative_to(PACKAGE).as_posix(), ast.parse(path.read_text())


def _defined(kind, name: str) -> list[str]:
    return [where for where, tree in _trees() for node in ast.walk(tree)
            if isinstance(node, kind) and node.name == name]


def _calls(attribute: str) -> list[str]:
    """Modules that call `<anything>.attribute(...)` or `attribute(...)`."""
    found = []
    for where, tree in _trees():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == attribute:
                found.append(where)
    return sorted(set(found))


def test_one_range_for_config_keys_and_method_arguments():
    from upcycle import methods
    from upcycle.config import MoEConfig, Range

    assert _defined(ast.ClassDef, "Range") == ["config.py"]
    assert methods.Range is Range
    # the config's bound and the method's bound are one class with one rule
    capacity = next(f for f in MoEConfig.__dataclass_fields__.values() if f.name == "num_experts")
    assert isinstance(capacity.metadata["range"], Range)
    assert [Range(0, 1, low_open=True).contains(v) for v in (0.0, 1e-300, 1.0, 1.5, float("nan"))] == \
        [False, True, True, False, False]
    with pytest.raises(Exception, match="must be a finite number in \\(0, 1\\], got 0.0"):
        Range(0, 1, low_open=True).check(0.0, "x")
    with pytest.raises(Exception, match="must be at most 8, got 9"):
        Range(1, 8).check(9, "x")


def test_one_keyed_generator():
    """Every seeded stream a conversion keys by purpose is drawn from `keyed_generator`; its key is the parts
    joined by ':' under CRC-32, the scheme every earlier output was made with (byte-identical outputs)."""
    import zlib

    from upcycle.core.keyed import keyed_generator

    assert _defined(ast.FunctionDef, "keyed_generator") == ["core/keyed.py"]
    assert _calls("crc32") == ["core/keyed.py"]
    a = keyed_generator(7, "text", 3)
    b = torch.Generator().manual_seed(zlib.crc32(b"7:text:3"))
    assert torch.equal(torch.rand(5, generator=a), torch.rand(5, generator=b))
    assert not torch.equal(torch.rand(5, generator=keyed_generator(7, "text", 3)),
                           torch.rand(5, generator=keyed_generator(7, "text", 4)))


def test_layer_inputs_are_gathered_in_one_place():
    from upcycle.core.layer_inputs import layer_inputs

    assert _calls("register_forward_hook").count("core/layer_inputs.py") == 1
    assert "analyze/collect.py" not in _calls("register_forward_pre_hook")
    assert "compare/diagnostics.py" not in _calls("register_forward_hook")
    layer = torch.nn.Linear(3, 2)
    x = torch.arange(12.0).reshape(2, 2, 3)
    mask = torch.tensor([[1, 0], [1, 1]])
    with layer_inputs({"one": layer}, lambda module, x_TD: mask.reshape(-1)) as got:
        layer(x)
    layer(x)                    # the hook is gone after the block
    assert len(got["one"]) == 1 and torch.equal(got["one"][0], x.reshape(-1, 3)[mask.reshape(-1).bool()])


def test_the_held_out_split_has_one_home():
    from upcycle.data.held_out import held_out_split

    assert _defined(ast.FunctionDef, "held_out_split") == ["data/held_out.py"]
    docs = [f"d{i}" for i in range(10)]
    kept, held = held_out_split(docs, 0.3, seed=1)
    assert len(held) == 3 and sorted(kept + held) == sorted(docs) and held == held_out_split(docs, 0.3, seed=1)[1]
    assert held_out_split(docs, 0.0, seed=1) == (docs, [])


def test_every_temporary_is_named_by_the_staging_module():
    """No module but outputs/staging.py makes a temporary folder or file (mkdtemp, mkstemp) or spells a
    temporary's name (".tmp"), so ownership knows every temporary upcycle leaves."""
    makers = sorted(set(_calls("mkdtemp")) | set(_calls("mkstemp")))
    assert makers == ["outputs/staging.py"]
    spelled = [where for where, tree in _trees() for node in ast.walk(tree)
               if isinstance(node, ast.Constant) and isinstance(node.value, str)
               and (".tmp" in node.value or "tmp-" in node.value) and where != "outputs/staging.py"]
    assert spelled == []


def test_a_staged_directory_appears_whole_or_not_at_all(tmp_path):
    from upcycle.outputs.staging import staged_directory, temporary_owner

    out = tmp_path / "out"
    with staged_directory(out) as staging:
        (staging / "a.txt").write_text("a")
        assert not out.exists() and staging.parent == tmp_path and temporary_owner(staging.name) == "mine"
        assert f"{socket.gethostname()}-{os.getpid()}-" in staging.name         # its owner, for a later cleanup
    assert (out / "a.txt").read_text() == "a" and sorted(os.listdir(tmp_path)) == ["out"]
    with pytest.raises(RuntimeError), staged_directory(out) as staging:
        (staging / "b.txt").write_text("b")
        raise RuntimeError("failed half-way")
    assert sorted(os.listdir(out)) == ["a.txt"] and sorted(os.listdir(tmp_path)) == ["out"]
    # files moved into an existing folder, the named ones last and in that order
    order = []
    real_replace = os.replace

    def replace(src, dst):
        order.append(Path(dst).name)
        real_replace(src, dst)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(os, "replace", replace)
        with staged_directory(out, into=True, last=("upcycle_config.json", "config.json")) as staging:
            for name in ("config.json", "model.safetensors", "upcycle_config.json", "a.txt"):
                (staging / name).write_text(name)
    assert order == ["a.txt", "model.safetensors", "upcycle_config.json", "config.json"]
    assert sorted(os.listdir(out)) == ["a.txt", "config.json", "model.safetensors", "upcycle_config.json"]
