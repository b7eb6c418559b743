"""Run configuration as data (docs/design.md principle 8): the schema, as frozen keyword-only dataclasses whose
every bounded key declares its range or choices beside its default and is checked when the config is made
(`check_fields`), from a recipe, `--set`, flags or Python alike. Reading recipes, `--set` and flag values into
these classes is `upcycle.config_reader`'s job.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import reprlib
import typing
from dataclasses import dataclass, field

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
EXPERT_KINDS = ("full", "delta")                       # MoEConfig.experts (upcycle.core.delta_experts)
CHECKPOINTING = ("none", "full", "moe")                # TrainConfig.activation_checkpointing (training.recompute)
REPORT_TO = ("tensorboard", "wandb")                  # TrainConfig.report_to
# Held-out tokens of one causal-LM evaluation: training's (TrainConfig.eval_tokens) and `upcycle eval`'s
# default alike, so the same model reads the same perplexity in both (docs/training.md, "Watching a run").
EVAL_TOKENS = 16384


# Every bounded key declares its range (or choices) beside its default, and each config checks its own keys when
# it is made (`check_fields`), from YAML, --set, flags or Python alike. Upper bounds are far beyond any real run; they
# exist so that a typo or a hostile recipe (1e23 tokens) is refused before anything is allocated.
SEED_MAX = 2**32 - 1            # what every RNG the run seeds takes (NumPy's is the narrowest)
BIG = 10**9                     # a count no real run reaches (steps, tokens of one evaluation...)


# Allowed values, one home for both places that declare them: a config key's range (`ranged`) and a method
# argument's bound in its signature (`Annotated[float, Range(0, 1)]`, read by `methods.registry`). A float must be
# finite to lie in any range: NaN and inf lie in none (an unbounded end is written inf, excluded).
@dataclass(frozen=True)
class Range:
    """A number between `low` and `high` (None: unbounded on that side), each end closed unless `*_open`."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def __post_init__(self) -> None:
        if self.low is not None and self.high is not None and self.low > self.high:
            raise TypeError(f"Range: low {self.low} > high {self.high}")

    def contains(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        if self.low is not None and not (value > self.low if self.low_open else value >= self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)

    def check(self, value, where: str) -> None:
        """Refuse a number outside the range with one line naming `where` (a config key); whole numbers are
        told their bound, floats the interval. A value that is no number is the type check's to report."""
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return
        if isinstance(value, int):
            if self.low is not None and (value < self.low or (self.low_open and value == self.low)):
                raise UpcycleError(f"{where} must be {'>' if self.low_open else '>='} {self.low:g}, got {value}")
            if self.high is not None and value > self.high:
                raise UpcycleError(f"{where} must be at most {self.high:,}, got {value:,}")
            return
        if not self.contains(value):
            raise UpcycleError(f"{where} must be a finite number in {self}, got {short_value(value)}")

    def __str__(self) -> str:
        low = "(-inf" if self.low is None else f"{'(' if self.low_open else '['}{self.low:g}"
        high = "inf)" if self.high is None else f"{self.high:g}{')' if self.high_open else ']'}"
        return f"{low}, {high}"

    def describe(self) -> str:
        """How an error or the listing says it: 'in [0, 1]', or 'finite' when unbounded."""
        return "finite" if self.low is None and self.high is None else f"in {self}"


@dataclass(frozen=True)
class OneOf:
    """A value from a fixed set (a string argument's choices)."""

    choices: tuple

    def __init__(self, *choices) -> None:
        if not choices:
            raise TypeError("OneOf needs at least one choice")
        object.__setattr__(self, "choices", tuple(choices))

    def contains(self, value) -> bool:
        return value in self.choices

    def __str__(self) -> str:
        return "{" + ", ".join(repr(c) for c in self.choices) + "}"

    def describe(self) -> str:
        return f"one of {', '.join(repr(c) for c in self.choices)}"


Bound = Range | OneOf


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxlist, _REPR.maxtuple, _REPR.maxdict, _REPR.maxstring, _REPR.maxother = 3, 6, 6, 6, 60, 60


def short_value(value) -> str:
    """A value as an error message quotes it: its repr, shortened (a hostile recipe's value can be huge)."""
    return _REPR.repr(value)


def ranged(default, low: float, high: float, *, low_open: bool = False, high_open: bool = False, **kwargs):
    """A dataclass field with its allowed range."""
    return field(default=default, metadata={"range": Range(low, high, low_open, high_open)}, **kwargs)


def choice(default, choices: tuple, **kwargs):
    """A dataclass field that takes one of `choices`."""
    return field(default=default, metadata={"choices": choices}, **kwargs)


def clip_text(text: str, limit: int = 120) -> str:
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
            raise UpcycleError(f"{where} must be true or false, got {short_value(value)}")
        if "range" in f.metadata:
            for number in _numbers(value):
                f.metadata["range"].check(number, where)
        if "choices" in f.metadata and value is not None and value not in f.metadata["choices"]:
            raise UpcycleError(f"{where} must be one of {', '.join(map(str, f.metadata['choices']))}, "
                               f"got {short_value(value)}")


MAX_EXPERTS = 2**16        # experts in one MoE layer (an index of the routing record fits int16 in a kernel)


@dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """The MoE layer's routing options (docs/methods.md §1), one object for the run config, the layer
    (`MoELayer.config`), its saved spec (upcycle_config.json), the conversion and the exporter. It refuses an
    impossible combination when it is made, so no layer is built from one."""

    num_experts: int = ranged(8, 1, MAX_EXPERTS)
    top_k: int = ranged(2, 1, MAX_EXPERTS)
    normalize_topk: bool = True            # renormalize the top-k weights to sum to 1 (exact copy preservation)
    capacity_factor_train: float | None = ranged(None, 0, math.inf, low_open=True, high_open=True)  # None: dropless
    capacity_factor_eval: float | None = ranged(None, 0, math.inf, low_open=True, high_open=True)
    renormalize_after_drop: bool = False
    score: str = choice("softmax", SCORES)   # router score function: softmax, or sigmoid (DeepSeek-V3; normalized)
    route_scale: float = ranged(1.0, 0, math.inf, low_open=True, high_open=True)   # DeepSeek-V3's routed scaling
    # How the routed experts are stored: full (E whole FFNs) or delta (one base FFN, the dense one at conversion,
    # plus a rank-`delta_rank` change per expert and matrix: PESC, DeRS); `train_base: false` trains the deltas only
    experts: str = choice("full", EXPERT_KINDS)
    delta_rank: int = ranged(16, 1, 2**16)
    train_base: bool = True

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
    batch_size: int = ranged(8, 1, 2**16)         # rows per batch (padded to its longest row) while capturing

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
    # Parameter groups (see upcycle.training.freezing.GROUPS) or glob patterns on parameter names, kept frozen while
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
    # recompute activations in the backward pass: none, every block (full), or upcycle's MoE layers (moe)
    activation_checkpointing: str = choice("none", CHECKPOINTING)
    # the memory each process may take, checked by the memory plan before the weights load (`--dry-run` prints it):
    # auto = the device's memory (a GPU's; the machine's RAM shared by its processes), or a size such as 70GB
    memory_budget: str = "auto"
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


def to_dict(cfg) -> dict:
    """Plain nested dict of a config (tuples as lists), for YAML/JSON output."""
    def plain(v):
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        return v
    return plain(dataclasses.asdict(cfg))
