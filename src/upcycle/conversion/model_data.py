"""The data a conversion reads beside the weights, read and checked before the weights load: the tokenizer, the
probe's text (the preservation check) and the calibration data (data-aware methods such as cluster), made into one
`inputs.ConversionInputs` by `read_inputs`."""

from __future__ import annotations

import sys
from pathlib import Path

from tqdm.auto import tqdm

from ..checkpoint.loading import load_tokenizer
from ..core.architectures import PIXELS, TOKEN_IDS
from ..data.assets import DEFAULT_MODEL_NAMES, INSTALL_COMMAND
from ..data.model_inputs import tensor_batches, text_batches
from ..data.token_ids import check_token_ids, embedding_rows
from ..errors import UpcycleError
from ..files import file_problem
from .inputs import ConversionInputs
from .plan import MERGED, ConversionPlan


def read_inputs(plan: ConversionPlan) -> ConversionInputs:
    """The inputs of the planned conversion (no weight read): for one checkpoint, the tokenizer next to it, the
    calibration data and the probe's text, read and checked against the model before minutes of loading its
    weights; for a merge, the probe's text of the stock export's check (each source's own text calibrates its
    experts, read by the merge)."""
    method, args, config = plan.method, plan.args, plan.config
    if plan.route == MERGED:
        texts = probe_texts(plan.check.text) if plan.export == "hf" else None
        source = probe_source(plan.check.text) if texts else "random token ids"
        return ConversionInputs(method, args, promised=False, texts=texts, text_source=source, per_source=True)
    data, calibration_source = calibration_corpus(plan)
    tokenizer = load_tokenizer(plan.path)
    check_model_inputs(plan, tokenizer, data)
    texts = probe_texts(plan.check.text) if tokenizer else None                 # a malformed probe file fails here too
    return ConversionInputs(method, args, plan.promised, tokenizer=tokenizer, texts=texts,
                            text_source=probe_source(plan.check.text),
                            calibration=calibration_batches(plan, tokenizer, data, config),
                            calibration_source=calibration_source)


def check_model_inputs(plan: ConversionPlan, tokenizer, calibration_data: list | None) -> None:
    """Refuse, before the weights load, data the model cannot take (each tower's input is in its row of the
    architecture table): text for a model with an image tower (it calibrates on image-caption pairs), text
    without a tokenizer, model inputs lacking a tower's input, and a probe text file that would silently be
    replaced by random ids."""
    family, config = plan.family, plan.config
    towers = family.towers_of(config)
    reads = list(dict.fromkeys(tower.input for tower in towers.values()))     # each input once, in tower order
    name = plan.model
    if plan.check.text is not None and tokenizer is None:
        raise UpcycleError(f"check.text (--probe-text) {plan.check.text}: model {name!r} has no tokenizer to read "
                           f"it with (add the tokenizer files to the model folder, or leave out --probe-text to "
                           f"probe with seeded random token ids)")
    if plan.check.text is not None and TOKEN_IDS not in reads:
        raise UpcycleError(f"check.text (--probe-text) {plan.check.text}: model {name!r} is a vision model and "
                           f"takes no text")
    if calibration_data is None:
        return
    if isinstance(calibration_data[0], dict):      # model inputs from a .safetensors file
        missing = [key for key in reads if key not in calibration_data[0]]
        if missing:
            raise UpcycleError(f"calibration data {plan.calibration.data}: model {name!r} ({config.model_type}, "
                               f"towers {', '.join(towers)}) needs {' and '.join(missing)} in every batch")
        for number, batch in enumerate(calibration_data, 1):
            if TOKEN_IDS in batch:
                check_token_ids(batch[TOKEN_IDS], embedding_rows(config),
                                f"calibration data {plan.calibration.data} (batch {number})")
        return
    if PIXELS in reads:
        text = TOKEN_IDS in reads
        kind = f"a two-tower {family.display_name} model" if text else "a vision model"
        raise UpcycleError(f"calibration data {plan.calibration.data}: model {name!r} is {kind}, which calibrates "
                           f"on images, not text: pass image-caption pairs as a .safetensors file of model inputs "
                           f"({PIXELS}{f', {TOKEN_IDS}, attention_mask' if text else ''})")
    if tokenizer is None:
        raise UpcycleError(f"model {name!r} has no tokenizer, so calibration text cannot be tokenized; "
                           f"pass model inputs as a .safetensors file (input_ids, attention_mask)")


def probe_texts(text: str | None) -> list[str] | None:
    """The user's probe text file (`check.text`), else the embedded held-out Wikipedia split; None, said on the
    console, when that is not installed (the probe then takes seeded random token ids)."""
    from ..data.text import read_texts, wikipedia_split

    if text is not None:
        try:
            return read_texts(text)
        except (FileNotFoundError, ValueError) as e:
            raise UpcycleError(f"check.text: {e}") from None
    try:
        return wikipedia_split()[1]
    except (FileNotFoundError, OSError):
        # The conversion still runs and its report says "random token ids", but a report is read after the fact:
        # random ids check another thing than text does (and `eval` will want the text), so say it now.
        # (tqdm.write: the conversion's progress bar is already on the console)
        tqdm.write(f"[upcycle] warning: the embedded text is not installed, so the preservation check probes with "
                   f"random token ids instead of held-out Wikipedia text; run `{INSTALL_COMMAND}` or give "
                   f"--probe-text FILE", file=sys.stderr)
        return None


def probe_source(text: str | None) -> str:
    """Where the probe's text (`check.text`) comes from, as the report says it."""
    return f"text file {text}" if text else "held-out Wikipedia (embedded)"


def calibration_corpus(plan: ConversionPlan) -> tuple[list[str] | list[dict] | None, str | None]:
    """(data, source) for calibration, read before the model loads: documents from the user's text/JSONL file,
    or ready model-input batches from a .safetensors file; else the embedded Wikipedia train split on the
    default model when the method needs data; (None, None) when none is needed or none is at hand (making the
    `ConversionInputs` refuses a method that needs it)."""
    from ..data.text import read_texts, wikipedia_split

    method = plan.method
    data = plan.calibration.data
    if data is not None:
        if problem := file_problem(data):
            raise UpcycleError(f"calibration data {data}: {problem}")
        if Path(data).suffix.lower() == ".safetensors":
            return tensor_batches(data, batch_size=plan.calibration.batch_size), f"model inputs {data}"
        try:
            return read_texts(data), f"text file {data}"
        except (FileNotFoundError, ValueError) as e:
            raise UpcycleError(f"calibration data: {e}") from None
    if not method.needs_calibration or plan.model not in DEFAULT_MODEL_NAMES:
        return None, None
    try:
        return wikipedia_split()[0], "Wikipedia train split (embedded)"
    except (FileNotFoundError, OSError) as e:
        raise UpcycleError(f"method {method.name!r} needs calibration data and the embedded corpus is missing ({e});"
                           f" pass --calibration FILE") from None


def calibration_batches(plan: ConversionPlan, tokenizer, data: list | None, config=None) -> list[dict] | None:
    """Model-input batches from `calibration_corpus`'s data: the user's prepared batches as they are (their ids
    checked by `check_model_inputs`), or the text tokenized into the configured budget, its ids checked against
    the embedding of `config`'s model."""
    if data is None or isinstance(data[0], dict):
        return data
    c = plan.calibration
    return text_batches(tokenizer, data, c, seed=plan.seed,
                        embedding_rows=embedding_rows(config) if config is not None else None,
                        where=f"calibration data {c.data or '(embedded Wikipedia)'}")
