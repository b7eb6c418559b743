"""Image-caption pairs for CLIP training and evaluation.

No pretrained CLIP or image-caption set installs offline, so the offline task is scikit-learn's 8x8 handwritten
digits (1,797 images; UCI optdigits) with templated captions. A caption names the digit and, so that text carries
more than the class, two things visible in the image relative to other images of that digit ("a wide handwritten
seven with thin strokes"). Every 5th image is held out. Local data works the same way: a JSONL file of
{"image": path, "caption": text[, "label": class name]} (paths relative to the file), or a folder of images each
with a same-name .txt caption (a sub-folder name is its class label).

Images are made RGB, resized to the model's `image_size` as they are read (a JPEG decoded at the smallest scale
that still covers it), kept as bytes, and scaled to [-1, 1] when batched: 40 photos of 4000x3000 hold 40 small
images, never 40 full-size float copies. Captions use a word-level
tokenizer built from the training captions (`[BOS] words [EOS]`, padded), saved with the model.
Shape suffixes: N pairs, L caption length, C channels, H and W image height and width.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ..errors import UpcycleError
from .token_ids import check_token_ids

DIGIT_NAMES = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
# Everything a caption says is visible in its image: the digit, and against the median of that digit's images
# whether it is wide or narrow (columns holding ink) and bold or thin (total ink). 40 distinct captions.
CAPTION_TEMPLATE = "a {width} handwritten {name} with {stroke} strokes"
# zero-shot prompts name only the class, in words the captions taught (prompt ensembling, as in CLIP)
ZERO_SHOT_TEMPLATES = ("a handwritten {name}", "a {name}", "{name} with strokes")
# for a user's data: CLIP's own default prompt, and the bare class name
GENERIC_TEMPLATES = ("a photo of a {name}.", "{name}")
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp")
SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[BOS]", "[EOS]")
HELDOUT_EVERY = 5


@dataclass
class Pairs:
    images: list                      # [C, H, W]: float in [0, 1] or uint8 (any size; resized when batched)
    captions: list[str]
    labels: list[int] | None = None   # class index per pair, for zero-shot classification
    class_names: list[str] | None = None
    templates: tuple[str, ...] = GENERIC_TEMPLATES   # zero-shot prompts, "{name}" = a class name

    def __len__(self) -> int:
        return len(self.captions)

    def subset(self, keep: list[int]) -> Pairs:
        return Pairs([self.images[i] for i in keep], [self.captions[i] for i in keep],
                     None if self.labels is None else [self.labels[i] for i in keep], self.class_names, self.templates)


def digits_pairs() -> tuple[Pairs, Pairs]:
    """(train, held-out) digits pairs (every 5th image held out); the data fix the split and the captions."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32) / 16.0      # [N, 8, 8], ink in [0, 1]
    labels = torch.tensor(digits.target, dtype=torch.long)
    ink = images.sum((1, 2))
    columns = images.amax(1) > 0.25                                      # [N, 8]: columns holding ink
    width = columns.sum(1).float()
    captions = []
    for i, y in enumerate(labels.tolist()):
        same = labels == y
        captions.append(CAPTION_TEMPLATE.format(
            name=DIGIT_NAMES[y], width="wide" if width[i] > width[same].median() else "narrow",
            stroke="bold" if ink[i] > ink[same].median() else "thin"))
    pairs = Pairs([img.expand(3, 8, 8) for img in images], captions, labels.tolist(), list(DIGIT_NAMES),
                  ZERO_SHOT_TEMPLATES)
    held = [i for i in range(len(pairs)) if i % HELDOUT_EVERY == HELDOUT_EVERY - 1]
    return pairs.subset([i for i in range(len(pairs)) if i % HELDOUT_EVERY != HELDOUT_EVERY - 1]), pairs.subset(held)


def _image(path: Path, image_size: int | None = None) -> torch.Tensor:
    """[3, H, W] uint8; with `image_size`, resized to it here so that a large photo is never held full-size.
    PIL's own limit on decoded pixels stands (a decompression bomb is refused in one line)."""
    from PIL import Image

    if not path.is_file():          # a pipe or a device would block the read, or never end
        raise UpcycleError(f"image {path}: no such regular file")
    try:
        with Image.open(path) as img:
            if image_size is not None:
                img.draft("RGB", (image_size, image_size))    # JPEG: decode at 1/2, 1/4 or 1/8 scale
                rgb = img.convert("RGB").resize((image_size, image_size), Image.Resampling.BILINEAR)
            else:
                rgb = img.convert("RGB")
    except Image.DecompressionBombError as e:
        raise UpcycleError(f"image {path} is too large to decode safely: {e}") from None
    except (OSError, ValueError, SyntaxError) as e:
        raise UpcycleError(f"cannot read image {path}: {e}") from None
    data = torch.frombuffer(bytearray(rgb.tobytes()), dtype=torch.uint8)
    return data.view(rgb.height, rgb.width, 3).permute(2, 0, 1).contiguous()


def _caption(text: str, where: str) -> str:
    from .text import check_text

    try:
        return check_text(text, f'{where}: "caption"')
    except ValueError as e:
        raise UpcycleError(str(e)) from None


def _with_labels(images: list, captions: list[str], names: list[str | None]) -> Pairs:
    if all(n is None for n in names):
        return Pairs(images, captions)
    if any(n is None for n in names):
        raise UpcycleError("either every pair has a label or none does")
    classes = sorted(set(names))
    return Pairs(images, captions, [classes.index(n) for n in names], classes)


def read_pairs(source: str | Path, image_size: int | None = None) -> Pairs:
    """Pairs from a JSONL file or an image folder (see the module docstring); `image_size`: resize each image
    to it as it is read (None keeps each at its own size)."""
    path = Path(source)
    if path.is_file():
        from .text import jsonl_rows

        images, captions, names = [], [], []
        try:
            rows = list(jsonl_rows(path.read_text(encoding="utf-8"), path))
        except ValueError as e:
            raise UpcycleError(str(e)) from None
        for lineno, row in rows:
            if not isinstance(row, dict) or not isinstance(row.get("image"), str) \
                    or not isinstance(row.get("caption"), str):
                raise UpcycleError(f'{path}:{lineno}: expected {{"image": path, "caption": text}}')
            images.append(_image(path.parent / row["image"], image_size))
            captions.append(_caption(row["caption"], f"{path}:{lineno}"))
            names.append(row.get("label"))
    elif path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES)
        images, captions, names = [], [], []
        for file in files:
            caption = file.with_suffix(".txt")
            if not caption.is_file():
                raise UpcycleError(f"image {file} has no caption file {caption.name} (a regular file)")
            images.append(_image(file, image_size))
            try:
                captions.append(caption.read_text(encoding="utf-8").strip())
            except (OSError, UnicodeDecodeError) as e:
                raise UpcycleError(f"cannot read caption {caption}: {e}") from None
            names.append(file.parent.name if file.parent != path else None)
    elif path.exists():
        raise UpcycleError(f"image-caption data {source!r} is not a regular file or a folder (a pipe or a device)")
    else:
        raise UpcycleError(f"image-caption data {source!r}: no such file or folder (or use 'digits')")
    if not captions:
        raise UpcycleError(f"image-caption data {source}: no pairs found")
    return _with_labels(images, captions, names)


def load_pairs(source: str | None, *, split: str = "train", image_size: int | None = None) -> Pairs:
    """'digits' (or None) gives the digits split; anything else is read from disk, each image resized to
    `image_size` as it is read."""
    if source in (None, "digits"):
        train, held = digits_pairs()
        return train if split == "train" else held
    return read_pairs(source, image_size)


def pixel_values(images: list, image_size: int) -> torch.Tensor:
    """[N, 3, image_size, image_size] in [-1, 1] (bilinear resize; 1-channel images repeated)."""
    out = []
    for img in images:
        img = img.float() / 255.0 if img.dtype == torch.uint8 else img
        img = img.expand(3, -1, -1) if img.shape[0] == 1 else img[:3]
        if img.shape[-2:] != (image_size, image_size):
            img = F.interpolate(img[None], size=(image_size, image_size), mode="bilinear", align_corners=False)[0]
        out.append(img)
    return torch.stack(out) * 2.0 - 1.0


_WORDS = re.compile(r"\w+|[^\w\s]")


def caption_tokenizer(captions: list[str], max_length: int = 16):
    """A word-level fast tokenizer over the captions' vocabulary (lower-cased): [BOS] words [EOS], padded."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    words = sorted({w for c in captions for w in _WORDS.findall(c.lower())})
    vocab = {tok: i for i, tok in enumerate([*SPECIAL_TOKENS, *words])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.Lowercase()
    # the same word/punctuation split as _WORDS, so every training word is in the vocabulary
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    tok.post_processor = processors.TemplateProcessing(single="[BOS] $A [EOS]",
                                                       special_tokens=[("[BOS]", 2), ("[EOS]", 3)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="[BOS]", eos_token="[EOS]", pad_token="[PAD]",
                                   unk_token="[UNK]", model_max_length=max_length)


def encode_captions(tokenizer, captions: list[str], max_length: int, rows: int | None = None,
                    where: str = "captions") -> dict[str, torch.Tensor]:
    """Captions as padded ids and mask; with `rows` (the text tower's embedding rows), an id the tokenizer makes
    outside them is refused, naming `where`."""
    enc = tokenizer(captions, padding="max_length", truncation=True, max_length=max_length, return_tensors="pt")
    check_token_ids(enc["input_ids"], rows, f"{where} as tokenized")
    return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}
