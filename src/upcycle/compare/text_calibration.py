"""The calibration data of data-aware methods (cluster) for an encoder in `upcycle compare`: the texts of the
training pairs, tokenized as the contrastive task tokenizes them.

A pair file is no calibration text (the converter would read its JSON lines as documents of prose), and an
encoder never sees packed documents: it reads one query or one document per row, with its special tokens
([CLS] text [SEP]), cut at the run's `sequence_length` (`upcycle.tasks.contrastive.PairBatches`). So the
calibration is the distinct queries and documents of the training split (`load_text_pairs(data, eval_data)[0]`:
never a held-out text), in a seeded order (seed 0, so one file serves every seed of a study), taken until they
hold `calibration.tokens` real tokens (the largest budget of the plan's cells; a cell with a smaller one
reservoir-samples it, `upcycle.conversion.calibration.Reservoir`), one text per row. They are written once, as
model inputs (input_ids, attention_mask), to OUT/calibration/train_texts.safetensors, which the conversion reads
as it reads any .safetensors of model inputs.

A .safetensors of model inputs has one width, so the rows are padded to the longest text taken (at most
`sequence_length`; the packaged pairs average ~15 tokens a text). Padding never reaches the reservoir (only real
tokens are sampled); it costs the calibration forward time and memory, not results.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from ..config import ConvertConfig, TrainConfig
from ..errors import UpcycleError
from ..outputs.staging import atomic_write

CALIBRATION_TEXTS = Path("calibration") / "train_texts.safetensors"
SEED = 0


@dataclass(frozen=True)
class TextCalibration:
    path: Path                      # the file to write
    data: str | None                # the training recipe's pair file (None: the packaged pairs)
    eval_data: str | None
    sequence_length: int            # tokens per text, as the task cuts them
    tokens: int                     # real tokens the file holds at least (the largest cell's calibration.tokens)

    def metadata(self) -> dict[str, str]:
        """What the file was made from (its safetensors metadata): a file made otherwise is not reused."""
        return {"data": str(self.data), "eval_data": str(self.eval_data),
                "sequence_length": str(self.sequence_length), "tokens": str(self.tokens), "seed": str(SEED)}


def text_calibration(path: Path, cells: list[tuple[TrainConfig, ConvertConfig]]) -> TextCalibration:
    """The one calibration file of the cells calibrated on the training texts; they must train on the same pairs
    with the same text length (one file serves them all)."""
    kinds = {(train.data, train.eval_data, train.sequence_length) for train, _ in cells}
    if len(kinds) > 1:
        raise UpcycleError(f"the data-aware methods calibrate on the texts of their training pairs, and their recipes "
                           f"name different data or sequence lengths ({sorted(map(str, kinds))}): give them one, or "
                           f"--convert-set calibration.data=FILE")
    data, eval_data, length = kinds.pop()
    return TextCalibration(path, data, eval_data, length, max(convert.calibration.tokens for _, convert in cells))


def calibration_texts(texts: list[str], tokenizer, tokens: int, sequence_length: int) -> list[str]:
    """Distinct `texts` in a seeded order until they hold `tokens` real tokens as the task tokenizes them."""
    order = list(dict.fromkeys(texts))
    random.Random(SEED).shuffle(order)
    taken, count = [], 0
    for start in range(0, len(order), 512):           # tokenized a chunk at a time: the budget is often reached early
        chunk = order[start:start + 512]
        lengths = [len(ids) for ids in tokenizer(chunk, truncation=True, max_length=sequence_length)["input_ids"]]
        for text, length in zip(chunk, lengths, strict=True):
            taken.append(text)
            count += length
            if count >= tokens:
                return taken
    return taken


def write_text_calibration(spec: TextCalibration, model: str, say=lambda message: None) -> bool:
    """Write spec.path (atomically) unless a file made from the same spec is there; refuse one made otherwise.
    Whether it wrote it."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from ..checkpoint.loading import dense_config, load_tokenizer
    from ..data.text_pairs import load_text_pairs, text_chars
    from ..tasks.embedding import tokenize

    if spec.path.is_file():
        with safe_open(str(spec.path), framework="pt") as f:
            made = f.metadata() or {}
        if made != spec.metadata():
            raise UpcycleError(f"{spec.path} was made from other settings ({made}, not {spec.metadata()}): use a new "
                               f"OUT, or move the file away if no finished conversion used it")
        return False
    model_path, _ = dense_config(model)
    tokenizer = load_tokenizer(model_path)
    if tokenizer is None:
        raise UpcycleError(f"{model} has no tokenizer to encode the calibration texts with")
    train, _ = load_text_pairs(spec.data, spec.eval_data, max_chars=text_chars(spec.sequence_length))
    texts = calibration_texts(train.queries + train.documents, tokenizer, spec.tokens, spec.sequence_length)
    enc = tokenize(tokenizer, texts, spec.sequence_length)
    spec.path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(spec.path, lambda tmp: save_file({k: v.contiguous() for k, v in enc.items()}, str(tmp),
                                                  metadata=spec.metadata()))
    say(f"calibration for data-aware methods: {len(texts)} texts of the training pairs, "
        f"{int(enc['attention_mask'].sum())} tokens in rows of {enc['input_ids'].shape[1]} ({spec.path})")
    return True
