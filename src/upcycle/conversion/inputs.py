"""What a conversion reads besides the weights, as one value made before any weight loads.

`ConversionInputs` holds the validated method and its arguments, whether the method promises the dense function
for this config, the tokenizer, the probe's text and the calibration batches, each with where it came from. It is
made once per conversion (`model_data.read_inputs` for a checkpoint, `pipeline.upcycle_model` for a model in
memory, `merge.merge_sources` for several sources) and handed to the block source and `orchestrator.run_conversion`
as it is. Making it is where a data-aware method without calibration data is refused, whichever path converts.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import MoEConfig
from ..methods import Method
from .validate import require_calibration


@dataclass(frozen=True)
class ConversionInputs:
    """Everything a conversion is given besides its config and weights (module docstring). `per_source`: a merge,
    whose data-aware experts calibrate on their own source's text (checked by `validate.check_sources`), not on
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


def promises_dense_function(method: Method, args: dict, moe: MoEConfig) -> bool:
    """Whether the conversion must reproduce the dense model: the method promises it for these MoE options
    (dropless, top-k renormalization as it needs), and no route scale other than 1 scales the routed output
    (no method's construction undoes one)."""
    return (method.preserves(args, moe.normalize_topk, moe.capacity_factor_eval is None)
            and moe.route_scale == 1.0)
