"""CLIP end to end through the command line, in CI time: tiny dense CLIP -> pretrain on digits -> upcycle both
towers (CLIP-UP recipe) -> continue with per-modality router losses -> zero-shot and retrieval; plus the
image-caption readers and the retrieval metric."""

from __future__ import annotations

import json

import pytest
import torch

from upcycle.cli import main
from upcycle.data.clip_pairs import digits_pairs, read_pairs
from upcycle.errors import UpcycleError
from upcycle.tasks.evaluate import recall_at


def _summary(capsys) -> dict:
    out = capsys.readouterr().out
    return json.loads(out[out.index("{"):])


@pytest.mark.slow      # over 15 s on 2 cores (tests/durations.json): the slow tier
def test_tiny_clip_protocol(tmp_path, capsys):
    assert main(["tiny-clip", str(tmp_path / "init")]) == 0
    capsys.readouterr()
    assert main(["train", str(tmp_path / "init"), str(tmp_path / "pre"), "--steps", "100", "--batch-size", "64",
                 "--lr", "1e-3", "--weight-decay", "0.2", "--warmup", "0.05", "--schedule", "cosine",
                 "--quiet"]) == 0
    pre = _summary(capsys)
    before, after = pre["eval_before"], pre["eval_after"]
    # pretraining learns the task: well above chance (10 classes) and above the random init
    assert after["zero_shot"]["accuracy"] > max(0.2, before["zero_shot"]["accuracy"] + 0.1)
    assert after["image_to_text"]["R@5"] > before["image_to_text"]["R@5"] + 0.2

    assert main(["convert", str(tmp_path / "pre" / "model"), str(tmp_path / "moe"), "--config",
                 "clip-up", "--quiet"]) == 0
    capsys.readouterr()
    assert main(["train", str(tmp_path / "moe"), str(tmp_path / "cont"), "--steps", "10", "--batch-size", "64",
                 "--lr", "2e-4", "--weight-decay", "0.05", "--quiet", "--set", "regularizers.load_balance=0.01",
                 "--set", "regularizers.z_loss=0.001"]) == 0
    cont = _summary(capsys)
    # the upcycled model starts where the dense one ended (copy; capacity 2.0 may drop a few tokens)
    assert cont["eval_before"]["zero_shot"]["accuracy"] == pytest.approx(after["zero_shot"]["accuracy"], abs=0.05)
    rows = [json.loads(line) for line in (tmp_path / "cont" / "log.jsonl").read_text().splitlines()]
    step = next(r for r in rows if "loss" in r)
    assert {"task", "load_balance", "z_loss"} <= set(step["loss"])
    towers = {name.split(".")[0] for name in step["layers"]}
    assert towers == {"text_model", "vision_model"}          # per-modality routing stats, both towers
    assert all(0 <= s["dropped"] < 1 and s["entropy"] > 0 for s in step["layers"].values())

    assert main(["eval", str(tmp_path / "cont"), "--out", str(tmp_path / "eval.json")]) == 0
    capsys.readouterr()
    evaluated = json.loads((tmp_path / "eval.json").read_text())
    assert evaluated["task"] == "clip" and evaluated["pairs"] == 359
    assert evaluated["zero_shot"] == cont["eval_after"]["zero_shot"]
    assert evaluated["image_to_text"] == cont["eval_after"]["image_to_text"]


def test_recall_counts_any_relevant_candidate():
    scores = torch.tensor([[0.9, 0.1, 0.5], [0.2, 0.3, 0.8]])
    relevant = torch.tensor([[False, False, True], [True, False, False]])
    r = recall_at(scores, relevant, ks=(1, 2, 3))
    assert r == {"R@1": 0.0, "R@2": 0.5, "R@3": 1.0}


def test_digits_split_and_captions():
    train, held = digits_pairs()
    assert len(train) + len(held) == 1797 and len(held) == 359
    assert all(name in caption for caption, y in zip(held.captions, held.labels, strict=True)
               for name in [held.class_names[y]])
    words = {w for c in train.captions for w in c.split()}
    assert {"bold", "thin", "wide", "narrow"} <= words and len(set(train.captions)) >= 30


def test_local_pairs_jsonl_and_folder(tmp_path):
    from PIL import Image

    for i, label in enumerate(["cat", "dog", "cat"]):
        (tmp_path / "folder" / label).mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (5, 7), (i * 40, 0, 0)).save(tmp_path / "folder" / label / f"{i}.png")
        (tmp_path / "folder" / label / f"{i}.txt").write_text(f"a picture of a {label} {i}\n")
    lines = [json.dumps({"image": f"folder/{lab}/{i}.png", "caption": f"{lab} {i}", "label": lab})
             for i, lab in enumerate(["cat", "dog", "cat"])]
    (tmp_path / "pairs.jsonl").write_text("\n".join(lines))
    folder, jsonl = read_pairs(tmp_path / "folder"), read_pairs(tmp_path / "pairs.jsonl")
    assert folder.class_names == jsonl.class_names == ["cat", "dog"]
    assert sorted(folder.labels) == sorted(jsonl.labels) == [0, 0, 1]
    assert jsonl.images[1].shape == (3, 7, 5) and int(jsonl.images[1][0, 0, 0]) == 40
    (tmp_path / "folder" / "dog" / "1.txt").unlink()
    with pytest.raises(UpcycleError, match="no caption file"):
        read_pairs(tmp_path / "folder")
    (tmp_path / "bad.jsonl").write_text('{"image": "x.png"}\n')
    with pytest.raises(UpcycleError, match="bad.jsonl:1"):
        read_pairs(tmp_path / "bad.jsonl")


def test_local_image_folder_trains_and_evaluates_like_digits(tmp_path, capsys):
    """A user's folder of images + captions (sub-folders as classes) goes through tiny-clip, train and eval."""
    from PIL import Image

    gen = torch.Generator().manual_seed(0)
    for label, channel in (("red", 0), ("green", 1)):
        (tmp_path / "data" / label).mkdir(parents=True)
        for i in range(12):
            pixels = torch.zeros(9, 9, 3, dtype=torch.uint8)
            pixels[..., channel] = int(torch.randint(120, 255, (), generator=gen))
            Image.fromarray(pixels.numpy()).save(tmp_path / "data" / label / f"{i}.png")
            (tmp_path / "data" / label / f"{i}.txt").write_text(f"a {'bright' if i % 2 else 'dark'} {label} square")
    data = str(tmp_path / "data")
    assert main(["tiny-clip", str(tmp_path / "init"), "--data", data, "--layers", "2"]) == 0
    assert main(["train", str(tmp_path / "init"), str(tmp_path / "run"), "--data", data, "--eval-data", data,
                 "--steps", "3", "--batch-size", "8", "--quiet"]) == 0
    summary = _summary(capsys)
    assert summary["eval_after"]["pairs"] == 24 and summary["eval_after"]["zero_shot"]["classes"] == 2
    assert summary["eval_after"]["zero_shot"]["templates"] == ["a photo of a {name}.", "{name}"]
    assert main(["eval", str(tmp_path / "run"), "--data", data]) == 0
    assert json.loads(capsys.readouterr().out)["zero_shot"] == summary["eval_after"]["zero_shot"]
