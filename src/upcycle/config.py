"""Run configuration as data (docs/design.md principle 8): frozen keyword-only dataclasses, YAML recipes, `--set`.

A recipe is a YAML mapping with the same nesting as the dataclasses; `--set a.b=v` overrides one key (the value
is parsed as YAML, so `3`, `0.5`, `true`, `[1, 3]` and `null` mean what they say). Unknown keys and wrong types
are refused with the key's dotted path, before anything runs.

Numbers follow one rule, here and for method arguments (`coerce`): a number-typed key takes a number in any form
a person writes it (`1e-3`, `1E-3`, `.5`, `5.`, `1e+3`, `-2.5E-4`, `8`). YAML 1.1 reads some of these as
strings (`1e-3` has no dot), so a string that is a decimal number literal becomes a float for a float key, and an
int key takes a number whose value is whole (`1e5`, `8.0`) but refuses `2.5`. The words `inf` and `nan` (any case,
signed; YAML spells them `.inf`, `.nan`) are the float's non-finite values, as on the command line (`--lr inf`):
each key's range check then refuses them where a finite number is needed, saying so. Only number-typed keys
convert: `method=1e3` stays the string '1e3' (and is refused as an unknown method), and no other word is a number.
Booleans are YAML's (`true`, `no`...). The command-line flags of a config key go through the same rule (cli.py).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import reprlib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from .errors import UpcycleError

SCORES = ("softmax", "sigmoid")     # router score functions (upcycle.core.router)
# The allowed values of the string keys the command line offers as choices (the CLI's `choices` are these).
EXPORTS = ("upcycle", "hf")                            # ConvertConfig.export
SCHEDULES = ("linear", "cosine", "constant")           # TrainConfig.schedule
MIXED_PRECISIONS = ("auto", "no", "bf16", "fp16")      # TrainConfig.mixed_precision
ROUTER_INITS = ("random", "prompts", "data")           # SourcesConfig.router
NON_FFN = ("base", "average")                          # SourcesConfig.non_ffn
STORAGE_DTYPES = ("float32", "bfloat16", "float16")     # ConvertConfig.dtype (besides auto)
TASKS = ("causal_lm", "clip", "contrastive")           # TrainConfig.task
REPORT_TO = ("tensorboard", "wandb")                  # TrainConfig.report_to
# Held-out tokens of one causal-LM evaluation: training's (TrainConfig.eval_tokens) and `upcycle eval`'s
# default alike, so the same model reads the same perplexity in both (docs/training.md, "Watching a run").
EVAL_TOKENS = 16384


# Every bounded key declares its range (or choices) beside its default, and each config checks its own keys when
# it is made (`check_fields`), from YAML, --set, flags or Python alike. Upper bounds are far beyond any real run; they
# exist so that a typo or a hostile recipe (1e23 tokens) is refused before anything is allocated.
SEED_MAX = 2**32 - 1            # what every RNG the run seeds takes (NumPy's is the narrowest)
BIG = 10**9                     # a count no real run reaches (steps, tokens of one evaluation...)


@dataclass(frozen=True)
class Range:
    """The allowed interval of a number key (ints: whole numbers; floats: finite unless the interval says)."""

    low: float
    high: float
    low_open: bool = False
    high_open: bool = False

    def check(self, value, where: str) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return                  # a type error is the type check's to report (`coerce`)
        if isinstance(value, int):
            if value < self.low or (self.low_open and value == self.low):
                raise UpcycleError(f"{where} must be {'>' if self.low_open else '>='} {self.low:g}, got {value}")
            if value > self.high:
                raise UpcycleError(f"{where} must be at most {self.high:,}, got {value:,}")
            return
        ok = math.isfinite(value) and (value > self.low if self.low_open else value >= self.low) and \
            (value < self.high if self.high_open else value <= self.high)
        if not ok:
            interval = (f"{'(' if self.low_open else '['}{self.low:g}, {self.high:g}{')' if self.high_open else ']'}")
            raise UpcycleError(f"{where} must be a finite number in {interval}, got {_short(value)}")


def ranged(default, low: float, high: float, *, low_open: bool = False, high_open: bool = False, **kwargs):
    """A dataclass field with its allowed range."""
    return field(default=default, metadata={"range": Range(low, high, low_open, high_open)}, **kwargs)


def choice(default, choices: tuple, **kwargs):
    """A dataclass field that takes one of `choices`."""
    return field(default=default, metadata={"choices": choices}, **kwargs)


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxlist, _REPR.maxtuple, _REPR.maxdict, _REPR.maxstring, _REPR.maxother = 3, 6, 6, 6, 60, 60


def _short(value) -> str:
    """A value as an error message quotes it: its repr, shortened (a hostile recipe's value can be huge)."""
    return _REPR.repr(value)


def _clip(text: str, limit: int = 120) -> str:
    """Text the user typed, as a message quotes it (shortened when long)."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"


def _numbers(value):
    """The numbers in a value that may be a number, a list of numbers or a list of lists (DPSL's alpha table)."""
    if isinstance(value, (list, tuple)):
        for item in value:
            yield from _numbers(item)
    elif value is not None:
        yield value


@functools.cache
def _hints(cls: type) -> dict:
    return typing.get_type_hints(cls)


def check_fields(cfg, section: str = "") -> None:
    """Refuse any field of `cfg` outside its declared range or choices, or a non-boolean for a boolean key
    (configs made in Python skip `coerce`); `section` prefixes the key names."""
    hints = _hints(type(cfg))
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        where = section + f.name
        if hints[f.name] is bool and not isinstance(value, bool):
            raise UpcycleError(f"{where} must be true or false, got {_short(value)}")
        if "range" in f.metadata:
            for number in _numbers(value):
                f.metadata["range"].check(number, where)
        if "choices" in f.metadata and value is not None and value not in f.metadata["choices"]:
            raise UpcycleError(f"{where} must be one of {', '.join(map(str, f.metadata['choices']))}, "
                               f"got {_short(value)}")


@dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """The MoE layer's routing options (docs/methods.md §1), one object for the run config, the layer
    (`MoELayer.config`), its saved spec (upcycle_config.json), the conversion and the exporter. It refuses an
    impossible combination when it is made, so no layer is built from one."""

    num_experts: int = ranged(8, 1, 2**16)
    top_k: int = ranged(2, 1, 2**16)
    normalize_topk: bool = True            # renormalize the top-k weights to sum to 1 (exact copy preservation)
    capacity_factor_train: float | None = ranged(None, 0, math.inf, low_open=True, high_open=True)  # None: dropless
    capacity_factor_eval: float | None = ranged(None, 0, math.inf, low_open=True, high_open=True)
    renormalize_after_drop: bool = False
    score: str = choice("softmax", SCORES)   # router score function: softmax, or sigmoid (DeepSeek-V3; normalized)
    route_scale: float = ranged(1.0, 0, math.inf, low_open=True, high_open=True)   # DeepSeek-V3's routed scaling

    def __post_init__(self) -> None:
        check_fields(self, "moe.")
        if not 1 <= self.top_k <= self.num_experts:
            raise UpcycleError(f"moe.top_k must be between 1 and num_experts ({self.num_experts}), got {self.top_k}")
        if self.score == "sigmoid" and not self.normalize_topk:
            raise UpcycleError("moe.score sigmoid normalizes the selected scores (DeepSeek-V3): moe.normalize_topk "
                               "must be true")


@dataclass(frozen=True, kw_only=True)
class PlacementConfig:
    every: int = ranged(1, 1, 4096)        # block i (0-based) becomes MoE when (i + 1) % every == 0
    # explicit block indices (negative counts from the end); beats `every`
    layers: tuple[int, ...] | None = ranged(None, -4096, 4095)
    towers: tuple[str, ...] | None = None  # two-tower models (CLIP): "text", "vision"; None = every tower

    def __post_init__(self) -> None:
        check_fields(self, "placement.")


@dataclass(frozen=True, kw_only=True)
class CheckConfig:
    # A method that promises preservation passes when max |logit difference| <= noise_factor x the rounding
    # noise measured on the same probe, or a few units in the last place of max |dense logit| when that noise is
    # smaller (upcycle.conversion.preservation; the factor's measurements: docs/conversion.md).
    noise_factor: float = ranged(16.0, 0, math.inf, low_open=True, high_open=True)
    # Allowances a user may add on top (0 = none): pass anyway when max |logit difference| <= tolerance or
    # <= relative_tolerance x max |dense logit|.
    tolerance: float = ranged(0.0, 0, math.inf, high_open=True)
    relative_tolerance: float = ranged(0.0, 0, math.inf, high_open=True)
    sequences: int = ranged(4, 1, 4096)      # held-out probe batch: sequences x tokens
    tokens: int = ranged(128, 2, 2**20)
    text: str | None = None     # probe text file (.txt or .jsonl with "text"); default: held-out Wikipedia
    export_tolerance: float = ranged(1e-5, 0, math.inf, high_open=True)   # max |logit diff| of an export vs ours
    # The whole-model logit check next to the per-layer one: auto runs it in memory always and, when streaming,
    # when the output fits in the memory available (it then reads the dense checkpoint and the output once more,
    # a block at a time); true always, false never (the per-layer check still runs).
    end_to_end: bool | str = choice("auto", (True, False, "auto"))
    # Each MoE layer against the dense FFN on the probe's hidden states at its depth (the per-layer check, which
    # replays the probe through every block up to the last MoE layer). false skips it: a copy conversion then
    # only reads and writes (mergekit-moe's work); with end_to_end false too, nothing is checked and the report
    # says so (preservation passed: null).
    per_layer: bool = True

    def __post_init__(self) -> None:
        check_fields(self, "check.")


@dataclass(frozen=True, kw_only=True)
class CalibrationConfig:
    # Text for data-aware methods (cluster): a .txt (documents separated by blank lines) or .jsonl ("text")
    # file; None on the default model means the embedded Wikipedia train split (the probe uses held-out text).
    data: str | None = None
    tokens: int = ranged(65536, 1, 2**31)        # FFN-input tokens kept per layer (reservoir-sampled, no padding)
    sequence_length: int = ranged(512, 1, 2**20)  # documents are cut into rows of at most this many tokens
    batch_size: int = ranged(8, 1, 2**16)         # rows per forward while capturing

    def __post_init__(self) -> None:
        check_fields(self, "calibration.")


def _coefficient(default: float = 0.0):
    return ranged(default, 0, math.inf, high_open=True)


@dataclass(frozen=True, kw_only=True)
class RegularizerConfig:
    # Coefficients of the router losses (docs/methods.md §4); 0 switches a term off. Each term is the mean over MoE
    # layers of the per-layer loss (per token group when groups are given, then averaged).
    load_balance: float = _coefficient()
    z_loss: float = _coefficient()
    limoe_local: float = _coefficient()
    limoe_global: float = _coefficient()
    limoe_m: float = ranged(6.0, 1, math.inf, high_open=True)            # limoe_global threshold log m
    dpsl: float = _coefficient()
    # a float, a length-E list, or a [groups][E] table
    dpsl_alpha: float | list[float] | list[list[float]] = ranged(1.0, 0, math.inf, low_open=True, high_open=True)
    eesd: float = _coefficient()             # Expert-Ensemble Self-Distillation (needs an EMA teacher)
    eesd_beta: float = ranged(0.999, 0, 1, high_open=True)
    eesd_uncertain_fraction: float = ranged(1.0, 0, 1, low_open=True)   # < 1: teacher on the most uncertain tokens
    aux_free_rate: float = _coefficient()    # > 0: aux-loss-free selection bias, updated after each step
    # Router losses apply for the first `router_until` fraction of training steps (DPSL's recipe: router
    # regularizers only in the MoE warm-up phase); EESD and the aux-free bias are not affected.
    router_until: float = ranged(1.0, 0, 1)

    def __post_init__(self) -> None:
        check_fields(self, "regularizers.")


@dataclass(frozen=True, kw_only=True)
class ExpertSource:
    """One fine-tuned model of the base whose FFNs become routed experts (Branch-Train-MiX)."""

    model: str                  # a local folder of safetensors with the base's architecture and shapes
    # Text of this source (.txt documents separated by blank lines, or .jsonl "text"): its FFN-input centroid is
    # the `data` router's row, and its held-out share measures router-source agreement.
    data: str | None = None
    eval_data: str | None = None     # held-out text for the agreement; None: the last `held_out` of `data`
    prompts: tuple[str, ...] = ()    # the `prompts` router (mergekit-moe's positive_prompts)
    negative_prompts: tuple[str, ...] = ()
    count: int = ranged(1, 1, 2**16)    # experts made from this source (by the conversion's `method`)

    def __post_init__(self) -> None:
        check_fields(self, "sources.experts[].")


@dataclass(frozen=True, kw_only=True)
class SourcesConfig:
    """Several fine-tunes of one base merged into one MoE (`upcycle.conversion.merge`). No experts: the ordinary
    single-model conversion. The base is the conversion's `model`."""

    experts: tuple[ExpertSource, ...] = ()
    router: str = choice("data", ROUTER_INITS)
    # attention, embeddings, norms and dense blocks: the base's, or the experts' average
    non_ffn: str = choice("base", NON_FFN)
    shared_expert: bool = False     # the base's FFN as an always-on shared expert in every MoE layer
    held_out: float = ranged(0.1, 0, 1, high_open=True)   # share of each source's documents kept for agreement
    router_std: float = ranged(0.02, 0, math.inf, high_open=True)    # the `random` router's N(0, std^2) rows

    def __post_init__(self) -> None:
        check_fields(self, "sources.")


@dataclass(frozen=True, kw_only=True)
class ConvertConfig:
    model: str = "default"      # "default" (embedded SmolLM2), a Hugging Face id, or a local folder
    method: str = "copy"
    method_args: dict = field(default_factory=dict)
    moe: MoEConfig = field(default_factory=MoEConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    check: CheckConfig = field(default_factory=CheckConfig)
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)
    seed: int = ranged(0, 0, SEED_MAX)
    # dtype the written weights are stored in (and the in-memory conversion computes in): auto = the checkpoint's
    # own (config.json's torch_dtype / dtype), float32 when it states none
    dtype: str = choice("auto", ("auto", *STORAGE_DTYPES))
    # where calibration, the methods' linear algebra and the checks run: auto = the GPU when torch sees one
    device: str = "auto"
    # "upcycle" (any architecture) or "hf" (a stock transformers MoE class where one fits)
    export: str = choice("upcycle", EXPORTS)
    # with export=hf: auto, or a class of upcycle.export.registry (qwen2_moe, qwen3_moe, mixtral; checked there)
    export_class: str = "auto"
    # Streaming: read the dense checkpoint tensor by tensor and write the output shard by shard, one block in
    # memory. auto: when the model is a local folder of safetensors and an output folder is given; false: load
    # the whole model; true: refuse a checkpoint that cannot stream.
    streaming: bool | str = choice("auto", (True, False, "auto"))
    shard_size: str = "50GB"    # largest output shard (transformers' save_pretrained default); e.g. 5GB, 500MB
    sources: SourcesConfig = field(default_factory=SourcesConfig)   # several fine-tunes of `model`
    # No `overwrite` key: replacing an existing folder is a command-line decision (--overwrite), never a recipe's.

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True, kw_only=True)
class FreezeRule:
    # Parameter groups (see upcycle.train.freezing.GROUPS) or glob patterns on parameter names, kept frozen while
    # step < until x steps (until = 1.0: the whole run).
    params: tuple[str, ...]
    until: float = ranged(1.0, 0, 1)

    def __post_init__(self) -> None:
        check_fields(self, "freeze[].")


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    model: str = "default"      # an upcycle folder, a dense Hugging Face folder or id, or "default"
    # causal_lm | clip | contrastive; None: from the model (CLIP models: clip; encoders such as BERT: contrastive)
    task: str | None = choice(None, TASKS)
    # causal_lm: .txt / .jsonl ("text") file; None on the embedded model = the Wikipedia train split.
    # clip: "digits" (scikit-learn's 8x8 digits with templated captions), a JSONL file of
    # {"image", "caption"[, "label"]}, or a folder of images with same-name .txt captions.
    # contrastive: a .jsonl(.gz) of {"query", "document"[, "source", "doc_id"]}; None = the packaged pairs.
    data: str | None = None
    eval_data: str | None = None   # None: the held-out Wikipedia split / the digits test split, when they apply
    steps: int = ranged(100, 1, BIG)                # optimizer steps
    batch_size: int = ranged(8, 1, 2**20)           # global rows (sequences or image-caption pairs) per step
    grad_accum: int = ranged(1, 1, 2**16)           # micro-batches per optimizer step on each process
    sequence_length: int = ranged(256, 1, 2**20)    # causal_lm: packed row length
    lr: float = ranged(5e-5, 0, math.inf, low_open=True, high_open=True)
    min_lr_ratio: float = ranged(0.0, 0, 1)         # the schedule decays to lr x this
    warmup: float = ranged(0.02, 0, 1, high_open=True)   # fraction of steps with linear warmup
    schedule: str = choice("linear", SCHEDULES)     # after warmup
    weight_decay: float = ranged(0.0, 0, math.inf, high_open=True)   # AdamW decay on matrices (not biases, norms)
    betas: tuple[float, ...] = ranged((0.9, 0.95), 0, 1, high_open=True)
    clip_grad: float | None = ranged(1.0, 0, math.inf, low_open=True, high_open=True)  # None = no clipping
    mixed_precision: str = choice("auto", MIXED_PRECISIONS)   # auto: bf16 where the GPU has it, else no
    compile: bool = False           # torch.compile the model (docs/gpu.md: what compiles into one graph)
    train: tuple[str, ...] = ("all",)   # what trains at all: groups or globs (all, moe, routed, router, ...)
    freeze: tuple[FreezeRule, ...] = ()  # frozen for the first fraction of steps, e.g. SPRI's two stages
    regularizers: RegularizerConfig = field(default_factory=RegularizerConfig)
    checkpoint_every: int = ranged(0, 0, BIG)       # steps between checkpoints (0: only at the end and on Ctrl-C)
    keep_checkpoints: int = ranged(2, 1, 10**6)
    eval_every: int = ranged(0, 0, BIG)             # steps between evaluations (0: only before and after training)
    eval_tokens: int = ranged(EVAL_TOKENS, 1, 2**31)   # causal_lm: held-out tokens per evaluation (whole rows)
    eval_pairs: int = ranged(2048, 1, BIG)          # contrastive: held-out pairs per evaluation (a fixed sample)
    temperature: float = ranged(0.05, 0, 100, low_open=True)   # contrastive: InfoNCE temperature (fixed)
    report_to: str | None = choice(None, REPORT_TO)  # also send the log to TensorBoard or W&B (Accelerate)
    # A step whose loss or gradient norm is NaN/inf: "stop" the run (OUT keeps its last good checkpoint), or
    # "skip" it (no update; the schedule moves on) and stop only once more than max_skipped_steps were skipped.
    on_nonfinite: str = choice("stop", ("stop", "skip"))
    max_skipped_steps: int = ranged(10, 0, BIG)
    seed: int = ranged(0, 0, SEED_MAX)
    # No `overwrite` key: replacing an existing folder is a command-line decision (--overwrite), never a recipe's.

    def __post_init__(self) -> None:
        check_fields(self)
        if len(self.betas) != 2:
            raise UpcycleError(f"betas must be a pair, got {list(self.betas)}")


# A decimal number as people write it: sign, digits with an optional point (or a point and digits), exponent.
_NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")
_INTEGER = re.compile(r"[+-]?\d+")
_NON_FINITE = re.compile(r"[+-]?(inf|infinity|nan)", re.IGNORECASE)


def _number(value, kind: type, where: str):
    """`value` as `kind` (int or float): a YAML number, or a string YAML left unread such as '1e-3'."""
    wrong = UpcycleError(f"{where} must be {kind.__name__}, got {_short(value)} ({type(value).__name__})")
    if isinstance(value, bool):          # bool is an int subclass; true is not 1 here
        raise wrong
    if isinstance(value, str):
        text = value.strip()
        if _INTEGER.fullmatch(text):
            value = int(text)            # exact, however many digits
        elif _NUMBER.fullmatch(text) or _NON_FINITE.fullmatch(text):
            value = float(text)
        else:
            raise wrong
    if kind is float and isinstance(value, (int, float)):
        return float(value)
    if kind is int and isinstance(value, int):
        return value
    if kind is int and isinstance(value, float):
        # a whole number written as a float (`1e5` tokens, `8.0` experts) is that int; 2.5 is not an int
        if math.isfinite(value) and value.is_integer():
            return int(value)
        raise UpcycleError(f"{where} must be a whole number (int), got {_short(value)}")
    raise wrong


def _fits_shape(value, hint) -> bool:
    """Whether `value` has the outer shape of `hint` (a sequence for a list/tuple, a mapping for a dict or
    dataclass, a scalar otherwise): the union member whose error message to show."""
    origin = typing.get_origin(hint)
    if origin in (list, tuple) or hint in (list, tuple):
        return isinstance(value, (list, tuple))
    if origin is dict or hint is dict or dataclasses.is_dataclass(hint):
        return isinstance(value, dict)
    return not isinstance(value, (list, tuple, dict))


def coerce(value, hint, where: str):
    """`value` (from YAML, `--set` or Python) checked and converted to the type `hint` (see the module docstring
    for the number rule); `where` names the key in the error."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        members = [a for a in args if a is not type(None)]
        for arg in members:
            try:
                return coerce(value, arg, where)
            except UpcycleError as e:
                errors.append((arg, str(e)))
        # report the member the value was meant for: a list's error for a list, a number's for a scalar
        raise UpcycleError(next((e for arg, e in errors if _fits_shape(value, arg)), errors[0][1]))
    if dataclasses.is_dataclass(hint):
        return build(hint, value, where + ".")
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise UpcycleError(f"{where} must be a list, got {_short(value)}")
        return origin(coerce(v, args[0], f"{where}[{i}]") for i, v in enumerate(value))
    if hint is dict or origin is dict:
        if not isinstance(value, dict):
            raise UpcycleError(f"{where} must be a mapping, got {_short(value)}")
        return dict(value)
    if hint in (int, float):
        return _number(value, hint, where)
    if hint is bool and not isinstance(value, bool):
        raise UpcycleError(f"{where} must be true or false, got {_short(value)} ({type(value).__name__})")
    if hint is str and isinstance(value, bool):
        # YAML 1.1 reads yes/no/on/off as booleans: `mixed_precision: no` arrives as False
        raise UpcycleError(f"{where} must be a string, got {_short(value)}: YAML reads the words yes, no, on, off, "
                           f"true and false as booleans; quote the word ({where.rsplit('.', 1)[-1]}: 'no')")
    if not isinstance(value, hint):
        raise UpcycleError(f"{where} must be {hint.__name__}, got {_short(value)} ({type(value).__name__})")
    return value


def build(cls, data: dict | None, where: str = ""):
    """Build dataclass `cls` from a nested mapping, refusing unknown keys and wrong types."""
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise UpcycleError(f"{where or 'config'} must be a mapping, got {_short(data)}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = set(data) - set(names)
    if unknown:
        raise UpcycleError(f"unknown config key(s) {sorted(f'{where}{k}' for k in unknown)}; "
                           f"valid keys here: {', '.join(where + n for n in names)}")
    return cls(**{k: coerce(v, hints[k], where + k) for k, v in data.items()})


def _yaml_problem(error: yaml.YAMLError) -> str:
    """A one-line account of a YAML syntax error (PyYAML's own message spans several lines with a caret)."""
    problem = getattr(error, "problem", None) or str(error).splitlines()[0]
    mark = getattr(error, "problem_mark", None)
    return f"{problem} (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else problem


# A recipe is a few hundred bytes; these bounds only stop hostile YAML: a megabyte of text, and 100,000 values once
# aliases are expanded (nested aliases expand exponentially: 351 bytes can stand for billions of values).
MAX_RECIPE_BYTES = 2**20
MAX_YAML_VALUES = 100_000


def safe_yaml(text: str):
    """YAML's safe subset (no Python tags), refused when it expands to more than MAX_YAML_VALUES values, refers
    to itself or nests too deeply. Raises yaml.YAMLError or UpcycleError."""
    loader = yaml.SafeLoader(text)
    try:
        try:
            node = loader.get_single_node()
        except RecursionError:
            raise UpcycleError("the YAML nests too deeply") from None
        if node is None:
            return None
        _count_values(node)
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _count_values(root) -> int:
    """The number of values `root` stands for with its aliases expanded (each alias is the same node object, so
    a memo keeps this linear in the text); refused past the limit or for a value that contains itself."""
    sizes: dict[int, int] = {}
    stack = [(root, False)]
    on_path: set[int] = set()
    while stack:
        node, done = stack.pop()
        key = id(node)
        children = [] if isinstance(node, yaml.ScalarNode) else \
            [c for pair in node.value for c in pair] if isinstance(node, yaml.MappingNode) else list(node.value)
        if done:
            on_path.discard(key)
            sizes[key] = 1 + sum(sizes[id(c)] for c in children)
            if sizes[key] > MAX_YAML_VALUES:
                raise UpcycleError(f"the YAML expands to more than {MAX_YAML_VALUES:,} values (through its "
                                   f"aliases); a recipe is far smaller")
            continue
        if key in sizes:
            continue
        if key in on_path:
            raise UpcycleError("the YAML refers to itself (a recursive alias)")
        on_path.add(key)
        stack.append((node, True))
        stack.extend((c, False) for c in children if id(c) not in sizes)
    return sizes[id(root)]


def set_override(data: dict, assignment: str) -> None:
    """Apply one `a.b.c=value` to a nested mapping in place (the value is YAML; numbers see `coerce`)."""
    if "=" not in assignment:
        raise UpcycleError(f"--set expects key=value, got {_short(assignment)}")
    key, raw = assignment.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise UpcycleError(f"--set {assignment}: the key must be dotted names such as moe.top_k, got {_short(key)}")
    try:
        value = safe_yaml(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise UpcycleError(f"--set {_clip(assignment)}: the value is not valid YAML: {_yaml_problem(e)} "
                           f"(quote a string, close a [list])") from None
    except UpcycleError as e:
        raise UpcycleError(f"--set {_clip(assignment)}: {e}") from None
    node = data
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise UpcycleError(f"--set {key}: {part!r} is not a section")
    node[parts[-1]] = value


# The recipes that ship inside the package (package data, so a wheel has them too): one folder per command kind.
RECIPES = Path(__file__).resolve().parent / "recipes"
RECIPE_KINDS = ("convert", "train")
# A recipe *name* is one word of letters, digits, '-' and '_': no folder part and no suffix. Anything else is a
# path, so `./smollm2-copy` or `my.yaml` always reads the file, and a name never depends on the current directory.
_RECIPE_NAME = re.compile(r"[A-Za-z0-9_-]+")


def recipe_names(kind: str) -> tuple[str, ...]:
    """The packaged recipes of a command kind ('convert' or 'train'), by name."""
    if kind not in RECIPE_KINDS:
        raise ValueError(f"recipe kind {kind!r}: one of {RECIPE_KINDS}")
    return tuple(sorted(p.stem for p in (RECIPES / kind).glob("*.yaml")))


def recipe_path(text: str | Path | None, kind: str) -> Path | None:
    """What `--config TEXT` reads: a name (`smollm2-copy`) is the packaged `kind` recipe of that name, anything
    else a path (as given). An unknown name is refused with the names there are."""
    if text is None or isinstance(text, Path) or not _RECIPE_NAME.fullmatch(text):
        return None if text is None else Path(text)
    names = recipe_names(kind)
    if text not in names:
        hint = f"; to read the file {text!r} here, write ./{text}" if Path(text).is_file() else \
            "; a recipe file is given by its path (with a '/' or a .yaml suffix)"
        raise UpcycleError(f"--config {text}: no packaged {kind} recipe of that name (the {kind} recipes: "
                           f"{', '.join(names)}){hint}")
    return RECIPES / kind / f"{text}.yaml"


def load_recipe(path: str | Path | None) -> dict:
    """A YAML recipe as a nested mapping (empty when no path); a file that is missing, not a file, not text,
    not YAML or not a mapping is refused with its name."""
    if path is None:
        return {}
    file = Path(path).expanduser()
    if file.exists() and not file.is_dir() and not file.is_file():
        raise UpcycleError(f"recipe {path} is not a regular file (a pipe or a device); --config takes a YAML file")
    if file.is_file() and file.stat().st_size > MAX_RECIPE_BYTES:
        raise UpcycleError(f"recipe {path} is {file.stat().st_size:,} bytes; a recipe is at most "
                           f"{MAX_RECIPE_BYTES:,} bytes of YAML")
    try:
        data = safe_yaml(file.read_text(encoding="utf-8"))
    except UpcycleError as e:
        raise UpcycleError(f"recipe {path}: {e}") from None
    except FileNotFoundError:
        raise UpcycleError(f"recipe {path} does not exist") from None
    except IsADirectoryError:
        raise UpcycleError(f"recipe {path} is a directory; --config takes a YAML file") from None
    except UnicodeDecodeError:
        raise UpcycleError(f"recipe {path} is not a text file (a YAML recipe is UTF-8 text)") from None
    except OSError as e:       # permissions, a device, ...
        raise UpcycleError(f"recipe {path} cannot be read: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise UpcycleError(f"recipe {path} is not valid YAML: {_yaml_problem(e)}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UpcycleError(f"recipe {path} must be a mapping of config keys at the top level, "
                           f"got a {type(data).__name__}")
    return data


def to_dict(cfg) -> dict:
    """Plain nested dict of a config (tuples as lists), for YAML/JSON output."""
    def plain(v):
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        return v
    return plain(dataclasses.asdict(cfg))


OVERWRITE_IS_A_FLAG = ("overwrite is not a recipe or --set key: replacing an existing output is decided on the "
                       "command line only (--overwrite), so that a shared recipe cannot delete folders")


def refuse_overwrite_key(data: dict, where: str) -> None:
    """A recipe (or --set) that asks to replace outputs is refused with the reason."""
    if isinstance(data, dict) and "overwrite" in data:
        raise UpcycleError(f"{where}: {OVERWRITE_IS_A_FLAG}")
