"""What a conversion reads besides the weights, as one value made before any weight loads.

`ConversionInputs` holds the validated method and its arguments, whether the method promises the dense function
for this config, the tokenizer, the probe's text and the calibration batches, each with where it came from. It is
made once per conversion (`model_data.read_inputs` for a checkpoint, `pipeline.upcycle_model` for a model in
memory, `merge.merge_sources` for several sources) and handed to the block source and `orchestrator.run_conversion`
as it is. Making it is where a data-aware method without calibration data is refused, whichever path converts.

The config's `dtype: auto` is resolved once per path too (`with_resolved_dtype`), so the report and
run_config.yaml state the dtype the conversion used.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from torch import nn

from ..checkpoint.loading import resolve_dtype
from ..config import ConvertConfig
from ..methods import Method
from .validate import require_calibration


@dataclass(frozen=True)
class ConversionInputs:
    """Everything a conversion is given besides its config and weights (module docstring). `per_source`: a merge,
    whose data-aware experts calibrate on their own source's text (checked by `validate.validate`), not on
    `calibration`."""

    method: Method
    args: dict
    promised: bool
    tokenizer: object | None = None
    texts: list[str] | None = None
    text_source: str = "held-out text"
    calibration: list[dict] | None = None
    calibration_source: str | None = None
    per_source: bool = False

    def __post_init__(self) -> None:
        if not self.per_source:
            require_calibration(self.method, self.calibration)


def promises_dense_function(method: Method, args: dict, cfg: ConvertConfig) -> bool:
    """Whether the conversion must reproduce the dense model: the method promises it for these MoE options
    (dropless, top-k renormalization as it needs), and no route scale other than 1 scales the routed output
    (no method's construction undoes one)."""
    moe = cfg.moe
    return (method.preserves(args, moe.normalize_topk, moe.capacity_factor_eval is None)
            and moe.route_scale == 1.0)


def with_resolved_dtype(cfg: ConvertConfig, config=None, model: nn.Module | None = None) -> ConvertConfig:
    """`cfg` with `dtype: auto` replaced by the dtype the conversion computes in: the checkpoint's (`config`),
    or for a model given in memory its parameters' own."""
    if model is not None:
        if cfg.dtype != "auto":
            return cfg
        return dataclasses.replace(cfg, dtype=str(next(model.parameters()).dtype).removeprefix("torch."))
    return dataclasses.replace(cfg, dtype=resolve_dtype(cfg.dtype, config))
