"""Every reader of a user's data is bounded by what the work needs, or refuses in one line before the allocation:
pair files (a huge query, millions of short lines, gzip bombs), CLIP images (large photos, a decompression bomb),
long lines read for a few tokens; a lone surrogate escaped in JSON is refused on every JSONL text path.

The memory bounds are measured in a child process (tests/bounded_worker.py) under an address-space limit of its
size after the imports plus a budget: the read either fits in the budget or is refused with an UpcycleError.
Large inputs are gzip files of repeated members (a member compressed once and written many times decompresses to
their concatenation), so that a test writes megabytes for gigabytes."""

from __future__ import annotations

import gzip
import json
import os
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

from conftest import fails, make_tiny

ROOT = Path(__file__).resolve().parents[2]
MB = 2**20


def bounded_read(kind: str, path: Path, budget_mb: int, *extra: str) -> dict:
    env = os.environ | {"PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "bounded_worker.py"), kind, str(path),
                           str(budget_mb), *extra], capture_output=True, text=True, env=env, timeout=300,
                          cwd=path.parent)
    assert done.returncode == 0 and done.stdout.strip(), done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def repeated_gzip(path: Path, head: bytes, block: bytes, times: int, tail: bytes = b"") -> Path:
    """A gzip file decompressing to head + block * times + tail."""
    body = gzip.compress(block, compresslevel=9)
    with open(path, "wb") as f:
        f.write(gzip.compress(head))
        for _ in range(times):
            f.write(body)
        f.write(gzip.compress(tail))
    return path


# each case's budget: the pairs the limits let through, held as Python strings, with room to spare (2 M short
# pairs take about 0.4 GB); the old reader went past 4 GB on each
PAIR_BOMBS = {
    "a 200 MB query": (b'{"query": "', b"a" * (16 * MB), 13, b'", "document": "d"}\n', "longer than 1,048,576 bytes"),
    "1.5 GB of short lines": (b"", b"".join(b'{"query": "question %07d", "document": "the document of %07d"}\n'
                                            % (i, i) for i in range(256)) * 256, 384, b"", "more than 2,000,000 pairs"),
    "8 GiB of zeros": (b"", b"\0" * (64 * MB), 128, b"", "longer than 1,048,576 bytes"),
    "8 GiB of newlines": (b"", b"\n" * (64 * MB), 128, b"", "more than 4,000,000 lines"),
}


# the 1.5 GB case takes over 15 s on 2 cores (tests/durations.json): the slow tier
@pytest.mark.parametrize("case", [pytest.param(case, marks=pytest.mark.slow) if case == "1.5 GB of short lines"
                                  else case for case in PAIR_BOMBS])
def test_a_pair_file_is_read_within_its_memory_bound_or_refused_in_one_line(tmp_path, case):
    head, block, times, tail, refusal = PAIR_BOMBS[case]
    path = repeated_gzip(tmp_path / "pairs.jsonl.gz", head, block, times, tail)
    assert path.stat().st_size < 64 * MB
    got = bounded_read("pairs", path, 1024)
    assert got["exception"] is None, got
    assert got["error"] is not None and refusal in got["error"] and str(path.name) in got["error"], got


def test_pairs_under_the_limits_are_read_whole_and_long_texts_cut_as_they_are_read(tmp_path):
    """What passes the limits is data: 100k pairs with a 500 kB document each 1,000th, in 256 MB; each text is
    cut to text_chars(128) characters as it is read."""
    from upcycle.data.text_pairs import text_chars

    long = "w " * 250_000
    rows = [{"query": f"q{i}", "document": long if i % 1000 == 0 else f"d{i}"} for i in range(100_000)]
    path = tmp_path / "pairs.jsonl.gz"
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    got = bounded_read("pairs", path, 256)
    assert (got["error"], got["count"], got["exception"]) == (None, 100_000, None)
    from upcycle.data.text_pairs import read_text_pairs

    pairs = read_text_pairs(path, max_chars=text_chars(128))
    assert len(pairs.documents[0]) == text_chars(128) and pairs.documents[1] == "d1"


def test_a_pair_file_past_its_decompressed_size_is_refused(tmp_path, monkeypatch):
    from upcycle.data import text_pairs
    from upcycle.errors import UpcycleError

    path = tmp_path / "pairs.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.writelines(json.dumps({"query": f"q{i}", "document": f"d{i}"}) + "\n" for i in range(1000))
    monkeypatch.setattr(text_pairs, "MAX_PAIR_FILE_BYTES", 10_000)
    with pytest.raises(UpcycleError, match="more than a pair file may hold \\(10,000 bytes, decompressed\\)"):
        text_pairs.read_text_pairs(path)


def png_header_only(path: Path, width: int, height: int) -> Path:
    """A PNG that says it is width x height (its pixel data is one row): PIL refuses or accepts it by its header."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr)
                     + chunk(b"IDAT", zlib.compress(b"\0" * (1 + 3 * width))) + chunk(b"IEND", b""))
    return path


def test_large_photos_are_resized_as_they_are_read(tmp_path):
    """40 photos of 4000 x 3000 for a 16-pixel model fit in 400 MB (the old reader held each full-size in float32:
    144 MB each, 5.4 GB in all); what is kept is each image at the model's size."""
    from PIL import Image

    Image.linear_gradient("L").resize((4000, 3000)).convert("RGB").save(tmp_path / "big.jpg", quality=90)
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps({"image": "big.jpg", "caption": f"photo {i}"}) + "\n"
                                                  for i in range(40)))
    got = bounded_read("images", tmp_path / "pairs.jsonl", 400, "16")
    assert (got["error"], got["count"], got["exception"]) == (None, 40, None)
    from upcycle.data.clip_pairs import read_pairs

    pairs = read_pairs(tmp_path / "pairs.jsonl", image_size=16)
    assert all(img.shape == (3, 16, 16) for img in pairs.images)
    # PIL's gradient, from top (dark) to bottom (light), survives the resize
    assert int(pairs.images[0][0, 0, 8]) < 40 < 215 < int(pairs.images[0][0, 15, 8])


def test_a_decompression_bomb_image_is_refused_in_one_line(tmp_path):
    """A 20000 x 20000 PNG (400 M pixels, over PIL's limit on decoded pixels) is refused by its header: one
    UpcycleError naming the file, within a budget far below its decoded 1.2 GB."""
    (tmp_path / "data").mkdir()
    png_header_only(tmp_path / "data" / "bomb.png", 20_000, 20_000)
    (tmp_path / "data" / "bomb.txt").write_text("a bomb")
    got = bounded_read("images", tmp_path / "data", 400, "16")
    assert got["exception"] is None and "bomb.png is too large to decode safely" in got["error"], got


# --- long lines: only the text the budget takes is tokenized ---------------------------------------------------


@pytest.fixture
def tokenized_chars(monkeypatch):
    """The characters every transformers tokenizer call is given, summed."""
    import transformers

    seen = [0]
    call = transformers.PreTrainedTokenizerBase.__call__

    def counting(self, text=None, *args, **kwargs):
        if isinstance(text, str):
            seen[0] += len(text)
        elif isinstance(text, list):
            seen[0] += sum(len(t) for t in text if isinstance(t, str))
        return call(self, text, *args, **kwargs)

    monkeypatch.setattr(transformers.PreTrainedTokenizerBase, "__call__", counting)
    return seen


def one_long_line(path: Path, megabytes: int) -> Path:
    from conftest import TOY_WORDS

    words = " ".join(TOY_WORDS)
    path.write_text((words + " ") * (megabytes * MB // (len(words) + 1)) + "\n")
    return path


def test_eval_tokenizes_only_the_text_its_tokens_take(lm, tmp_path, tokenized_chars, capsys):
    """`eval --tokens 64` on one 5 MB line: one piece (1 M characters) is tokenized, not the file (the old path
    tokenized all of it: 248 s for 200 MB)."""
    from upcycle.cli import main
    from upcycle.data.packing import MAX_PIECE_CHARS

    _, moe, _, _ = lm
    big = one_long_line(tmp_path / "big.txt", 5)
    head = tmp_path / "head.txt"
    head.write_text(big.read_text()[:10_000].rsplit(" ", 1)[0] + "\n")
    results = []
    for data in (big, head):
        tokenized_chars[0] = 0
        assert main(["eval", str(moe), "--data", str(data), "--tokens", "64", "--sequence-length", "32", "--quiet",
                     "--device", "cpu"]) == 0
        results.append(json.loads(capsys.readouterr().out))
        assert 0 < tokenized_chars[0] <= MAX_PIECE_CHARS
    # the same rows are evaluated from the 5 MB line as from its first 10 kB
    for result in results:
        del result["data"]
    assert results[0] == results[1] and results[0]["tokens"] == 62      # 2 rows of 32: 31 predicted each


def test_a_long_line_read_for_a_few_tokens_is_quick_within_its_memory_bound(lm, tmp_path):
    """One 100 MB line, read for 64 evaluation tokens and 512 calibration tokens, in a child under a memory limit:
    the text itself is held (read_texts holds the file's text), the tokens the budgets take are made, in seconds
    (the old path tokenized the whole line for each: 248 s for 200 MB). Bound: 60 s, far above what one 1 M
    character piece takes on any CPU (0.5 s here) and far below the whole line's tokenization."""
    dense, _, _, _ = lm
    big = one_long_line(tmp_path / "big.txt", 100)
    got = bounded_read("lines", big, 1024, str(dense))
    assert got["error"] is None and got["exception"] is None and got["count"] >= 64 + 512, got
    assert got["seconds"] < 60, got


def test_calibration_tokenizes_only_the_text_its_budget_takes(lm, tmp_path, tokenized_chars):
    from upcycle.config import CalibrationConfig
    from upcycle.data.model_inputs import text_batches
    from upcycle.data.packing import MAX_PIECE_CHARS
    from upcycle.data.text import read_texts

    dense, _, _, _ = lm
    from upcycle.checkpoint.loading import load_tokenizer

    tokenizer = load_tokenizer(str(dense))
    texts = read_texts(one_long_line(tmp_path / "big.txt", 5))
    tokenized_chars[0] = 0
    batches = text_batches(tokenizer, texts, CalibrationConfig(tokens=512, sequence_length=64))
    assert sum(int(b["attention_mask"].sum()) for b in batches) >= 512
    assert 0 < tokenized_chars[0] <= MAX_PIECE_CHARS


# --- a lone surrogate: one line on every JSONL text path ----------------------------------------------------------


SURROGATE_TEXT = '{"text": "the cat \\ud800 sat"}\n'
SURROGATE_PAIR = '{"query": "q \\ud800 x", "document": "the cat sat"}\n'


@pytest.fixture(scope="module")
def encoder(tmp_path_factory):
    from test_contrastive import tokenizer

    root = tmp_path_factory.mktemp("surrogate-encoder")
    make_tiny("bert").save_pretrained(root / "dense")
    tokenizer().save_pretrained(root / "dense")
    return root / "dense"


def test_a_lone_surrogate_is_refused_in_one_line_on_every_jsonl_text_path(lm, encoder, tmp_path, capsys):
    dense, moe, train, held = lm
    text, pairs = tmp_path / "bad.jsonl", tmp_path / "bad-pairs.jsonl"
    text.write_text(SURROGATE_TEXT)
    pairs.write_text(SURROGATE_PAIR * 8)
    out = tmp_path / "out"
    refusal = "a lone surrogate"
    fails(capsys, ["train", str(encoder), str(out), "--task", "contrastive", "--data", str(pairs), "--steps", "1",
                   "--sequence-length", "32", "--quiet"], refusal)
    fails(capsys, ["eval", str(encoder), "--task", "contrastive", "--data", str(pairs), "--sequence-length", "32",
                   "--quiet"], refusal)
    fails(capsys, ["train", str(moe), str(out), "--data", str(text), "--steps", "1", "--quiet"], refusal)
    fails(capsys, ["train", str(moe), str(out), "--data", str(train), "--eval-data", str(text), "--steps", "1",
                   "--quiet"], refusal)
    fails(capsys, ["eval", str(moe), "--data", str(text), "--quiet"], refusal)
    fails(capsys, ["convert", str(dense), str(out), "--expert", f"{dense}={train}", "--expert", f"{dense}={text}",
                   "--num-experts", "2", "--quiet"], refusal)
    fails(capsys, ["convert", str(dense), str(out), "--calibration", str(text), "--method", "cluster", "--num-experts",
                   "2", "--quiet"], refusal)
    assert not out.exists()


def test_a_lone_surrogate_in_a_caption_is_refused(tmp_path):
    from PIL import Image

    from upcycle.data.clip_pairs import read_pairs
    from upcycle.errors import UpcycleError

    Image.new("RGB", (4, 4)).save(tmp_path / "a.png")
    (tmp_path / "pairs.jsonl").write_text('{"image": "a.png", "caption": "a \\udfff cat"}\n')
    with pytest.raises(UpcycleError, match='pairs.jsonl:1: "caption" holds \\\\udfff, a lone surrogate'):
        read_pairs(tmp_path / "pairs.jsonl")
