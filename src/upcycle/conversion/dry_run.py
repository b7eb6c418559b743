"""`upcycle convert --dry-run`: what a conversion would do, from `config.json` alone.

The dense and the upcycled models are built on the meta device (`skeleton.py`), so the plan needs no weight and
works for any size (a Llama-3-70B config plans in a second). It reports the placement, the parameters before and
after (total, and active per token: k of E routed experts), the bytes the output takes on disk in each storage
dtype (routers stay float32), and an estimate of the real run's peak memory, from the sizes the streaming
conversion holds at once (`streaming.py`; the compute dtype is float32):
  overhead     the Python process with torch and transformers imported (measured: about 0.6 GB)
  trunk        embeddings, final norm, head, in float32: in memory only while the first blocks' inputs are
               computed, before any block, so the peak counts the larger of it and the per-block parts below
  block        the largest dense block in float32
  moe_block    its MoE replacement, built in the storage dtype
  write_queue  at most half a block's output (2 GiB at most) waiting for the background writer (storage dtype)
  method       the method's float32 experts for one layer (an upper bound: copy returns views of the dense FFN)
  similarity   the report's expert similarity: E x E Gram matrices in float64 (`metrics.experts`)
  calibration  data-aware methods: the calibration batches' hidden states at one depth and one layer's sample
The plan is `plan.make_plan`'s, the one the real run executes; a run whose estimate exceeds the machine's memory is
refused before OUT is claimed (`check_fits`). `benchmarks/speed/convert_scale.py` measures real runs;
its JSON holds the estimate next to the measured peak.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from ..checkpoint.lazy import block_paths
from ..checkpoint.skeleton import bytes_by_block, empty_model, output_bytes, tensor_specs
from ..core.grouped_ffn import CPU_MEMORY
from ..core.moe import moe_layers
from ..errors import UpcycleError
from ..machine import PROCESS_BYTES
from ..outputs.job import dry_run_job
from .model_data import calibration_corpus, read_inputs
from .plan import ConversionPlan
from .planned import planned_model
from .preservation import count_parameters
from .streaming import write_queue_bytes

GB = 10**9
OVERHEAD_BYTES = PROCESS_BYTES
STORAGE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def estimate(plan: ConversionPlan, *, calibration_tokens: int | None = None) -> dict:
    """The dry run's report of `plan` (module docstring): its decisions (`ConversionPlan.summary`), sizes and
    memory estimate. `calibration_tokens`: tokens of calibration data (data-aware methods)."""
    config, method, args, targets = plan.config, plan.method, plan.args, plan.targets
    dtype = STORAGE_DTYPES[plan.dtype]
    dense = empty_model(config, dtype)          # the dense numbers from a weightless model (linear in its blocks)
    dense_specs = tensor_specs(dense)
    before = count_parameters(dense)
    block_list = block_paths(dense)
    dense_sizes = bytes_by_block(dense_specs, block_list)
    model_class = type(dense).__name__
    model = plan.planned
    specs = tensor_specs(model)
    layers = moe_layers(model)
    # each storage dtype's bytes from one plan: the tensors in the plan's dtype take the storage dtype; the MoE
    # layers' routers and selection biases (float32 in every dtype) and integer buffers keep theirs
    kept = {f"{path}.{name}" for path, layer in layers.items()
            for name, _ in [*layer.router.state_dict(prefix="router.").items(), ("selection_bias", None)]}
    sizes = bytes_by_storage(specs, dtype, kept)
    moe_sizes = bytes_by_block(specs, block_list)
    element = torch.empty((), dtype=dtype).element_size()
    block_bytes = max((moe_sizes[t.path] for t in targets), default=0)
    dense_block_bytes = max((dense_sizes[t.path] for t in targets), default=0)
    trunk = output_bytes(dense_specs) - sum(dense_sizes.values())
    method_bytes = max((sum(p.numel() for p in layer.parameters()) * 4 for layer in layers.values()), default=0)
    hidden = model.config.get_text_config().hidden_size if hasattr(model.config, "get_text_config") else 0
    calib = 0
    if method.needs_calibration:
        tokens = calibration_tokens or plan.calibration.tokens
        calib = tokens * hidden * element * 2 + plan.calibration.tokens * hidden * 4
    f32 = 4 // element if element < 4 else 1           # storage bytes -> float32 bytes
    E = max((layer.num_experts for layer in layers.values()), default=0)
    estimate = {"overhead": OVERHEAD_BYTES, "trunk": trunk * f32, "block": dense_block_bytes * f32,
                "moe_block": block_bytes, "write_queue": write_queue_bytes(block_bytes), "method": method_bytes,
                "similarity": 3 * E * E * 8, "calibration": calib}
    per_block = sum(estimate[k] for k in ("block", "moe_block", "write_queue", "method", "similarity"))
    peak = OVERHEAD_BYTES + calib + max(estimate["trunk"], per_block)
    report = {
        **plan.summary(),
        "model_type": config.model_type, "model_class": model_class, "method": method.name,
        "method_args": args, "num_experts": plan.moe.num_experts, "top_k": plan.moe.top_k,
        "num_moe_layers": len(targets), "moe_layers": [t.name for t in targets],
        "parameters": {"before": before, "after": count_parameters(model)},
        "dense_bytes": output_bytes(dense_specs), "output_bytes": sizes,
        "largest_moe_block_bytes": block_bytes, "estimated_peak_bytes": peak,
        "estimate_parts_bytes": estimate, "dtype": plan.dtype,
    }
    if plan.moe.experts == "delta":
        report["as_full_experts"] = full_experts_sizes(plan, kept)
    return report


def full_experts_sizes(plan: ConversionPlan, kept: set[str]) -> dict:
    """What the same conversion with full experts (`moe.experts: full`) would count and write: the delta layers'
    saving, side by side in the dry run."""
    moe = dataclasses.replace(plan.moe, experts="full")
    dtype = STORAGE_DTYPES[plan.dtype]
    model, _ = planned_model(plan.config, moe, plan.placement, plan.layout_of, dtype=dtype)
    return {"parameters": count_parameters(model), "output_bytes": bytes_by_storage(tensor_specs(model), dtype, kept)}


def bytes_by_storage(specs, dtype: torch.dtype, kept: set[str]) -> dict[str, int]:
    """The bytes written in each storage dtype: the tensors in the plan's `dtype` take it, the `kept` ones (routers,
    selection biases) and integer buffers keep their own."""
    return {name: output_bytes([(n, shape, storage if dt == dtype and n not in kept else dt) for n, shape, dt in specs])
            for name, storage in STORAGE_DTYPES.items()}


def sizes(report: dict) -> str:
    """The estimate's sizes as lines for a person (below the plan's own description)."""
    gb = lambda n: f"{n / GB:.2f} GB"   # noqa: E731
    p = report["parameters"]
    lines = [f"  parameters: {p['before']['total']:,} -> {p['after']['total']:,} total; "
             f"{p['before']['active_per_token']:,} -> {p['after']['active_per_token']:,} active per token",
             "  output on disk: " + ", ".join(f"{k} {gb(v)}" for k, v in report["output_bytes"].items()),
             f"  estimated peak memory ({report['dtype']}): {gb(report['estimated_peak_bytes'])} ("
             + ", ".join(f"{k} {gb(v)}" for k, v in report["estimate_parts_bytes"].items() if v) + ")"]
    full = report.get("as_full_experts")
    if full is not None:
        lines.append(f"  as full experts (moe.experts: full): {full['parameters']['total']:,} total, "
                     f"{full['parameters']['active_per_token']:,} active per token; on disk {report['dtype']} "
                     f"{gb(full['output_bytes'][report['dtype']])} (delta experts: "
                     f"{gb(report['output_bytes'][report['dtype']])})")
    return "\n".join(lines)


def check_fits(plan: ConversionPlan, report: dict | None = None) -> None:
    """Refuse a conversion whose estimated peak exceeds this machine's memory (module docstring); `report`: the
    plan's `estimate`, when already made."""
    peak = (report or estimate(plan))["estimated_peak_bytes"]
    if peak > CPU_MEMORY:
        raise UpcycleError(f"converting to {plan.moe.num_experts} experts needs an estimated {peak / GB:.1f} GB at "
                           f"its peak, more than this machine's {CPU_MEMORY / GB:.1f} GB of memory (the plan's parts "
                           f"without OUT: --dry-run)")


def dry_run(plan: ConversionPlan, out: str | None = None, *, overwrite: bool = False) -> tuple[str, dict]:
    """`upcycle convert --dry-run` of `plan` (made as a run with OUT makes it, with `build=False`: a dry run
    writes nothing, the model cache too), through the runner's dry run (`outputs.job.dry_run_job`: OUT, when
    given, checked as the run's claim checks it, and the run's memory check), then the inputs the run reads before
    its weights, refused as the run refuses them; returns the description and the estimate. No weight is read,
    nothing is written."""
    report = estimate(plan)
    text = dry_run_job(plan, out, check=lambda: check_fits(plan, report), overwrite=overwrite)
    if Path(plan.path).is_dir():       # the inputs the run reads before its weights, and their refusals
        read_inputs(plan)              # (the embedded model's cache, unbuilt here, is read by its run alone)
    elif plan.calibration.data is not None:      # a user's calibration file, as the run's reading refuses it
        calibration_corpus(plan)
    return text + "\n" + sizes(report), report
